"""The output head and cross-entropy fused, in pieces: the logits of only one piece of tokens exist at a time, in
forward and in backward. Each piece's gradients (of the loss with respect to the hidden states and to the head's
weight) are computed in the forward pass, right after its loss, because the gradient of a cross-entropy needs
only its softmax; backward then scales them by the incoming gradient. So nothing is recomputed (a checkpointed
piece would run the head's GEMM again) and no logits are kept for backward."""

from __future__ import annotations

import torch

IGNORE = -100


def piece(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor):
    """(sum of the cross-entropies, d sum / d h, d sum / d weight in fp32) of one piece of tokens h [n, dim]."""
    logits = (h @ weight.t()).float()
    valid = targets != IGNORE
    safe = torch.where(valid, targets, 0)
    lse = logits.logsumexp(dim=-1)
    total = ((lse - logits.gather(1, safe[:, None]).squeeze(1)) * valid).sum()
    grad = logits.sub_(lse[:, None]).exp_()  # softmax, in the logits' memory
    grad.scatter_add_(1, safe[:, None], -valid[:, None].to(grad.dtype))
    grad = (grad * valid[:, None]).to(h.dtype)
    return total, grad @ weight, (grad.t() @ h).float()


class _FusedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, weight, targets, chunk: int, piece_fn):
        w = weight.to(h.dtype)
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        grad_h = torch.empty_like(h)
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        for lo in range(0, h.shape[0], chunk):
            t, gh, gw = piece_fn(h[lo:lo + chunk], w, targets[lo:lo + chunk])
            total += t
            grad_h[lo:lo + chunk] = gh
            grad_w += gw
        ctx.save_for_backward(grad_h, grad_w)
        ctx.weight_dtype = weight.dtype
        count = (targets != IGNORE).sum()
        ctx.mark_non_differentiable(count)
        return total, count

    @staticmethod
    def backward(ctx, grad_total, _grad_count):
        grad_h, grad_w = ctx.saved_tensors
        return grad_h * grad_total.to(grad_h.dtype), (grad_w * grad_total).to(ctx.weight_dtype), None, None, None


def fused_linear_cross_entropy(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk: int,
                               piece_fn=piece) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of the cross-entropies of h @ weight.T against targets, number of targets other than -100), taken
    `chunk` tokens at a time. h [N, dim] in the compute dtype; piece_fn: `piece`, or a compiled version of it."""
    return _FusedLinearCrossEntropy.apply(h, weight, targets, chunk, piece_fn)

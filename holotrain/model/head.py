"""The final norm, the output head and cross-entropy fused, in pieces: the logits of only one piece of tokens exist at
a time, in forward and in backward. Each piece's gradients (of the loss with respect to the hidden states, the norm's
weight and the head's weight) are computed in the forward pass, right after its loss, because the gradient of a
cross-entropy needs only its softmax; backward then scales them by the incoming gradient. So nothing is recomputed (a
checkpointed piece would run the head's GEMM again), and neither logits nor the norm's fp32 input and output are kept
for backward (at T = 1M and dim 2048 those would be 17 GB)."""

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


def _normed_piece(h: torch.Tensor, norm_weight: torch.Tensor, norm_fn, w: torch.Tensor, targets: torch.Tensor,
                  piece_fn):
    """`piece` of norm_fn(h, norm_weight), with the gradients taken back through the norm: (sum, d sum / d h,
    d sum / d head weight, d sum / d norm weight). The norm runs eagerly, as the model's own does, piece by piece."""
    with torch.enable_grad():
        x, nw = h.detach().requires_grad_(), norm_weight.detach().requires_grad_()
        y = norm_fn(x, nw)
    total, grad_y, grad_w = piece_fn(y.detach(), w, targets)
    grad_h, grad_nw = torch.autograd.grad(y, (x, nw), grad_y)
    return total, grad_h, grad_w, grad_nw


class _FusedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, norm_weight, weight, targets, chunk: int, piece_fn, norm_fn):
        w = weight.to(h.dtype)
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        grad_h = torch.empty_like(h)
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        grad_nw = None if norm_weight is None else torch.zeros_like(norm_weight, dtype=torch.float32)
        for lo in range(0, h.shape[0], chunk):
            if norm_weight is None:
                t, gh, gw = piece_fn(h[lo:lo + chunk], w, targets[lo:lo + chunk])
            else:
                t, gh, gw, gnw = _normed_piece(h[lo:lo + chunk], norm_weight, norm_fn, w, targets[lo:lo + chunk],
                                               piece_fn)
                grad_nw += gnw
            total += t
            grad_h[lo:lo + chunk] = gh
            grad_w += gw
        ctx.save_for_backward(grad_h, grad_w, grad_nw)
        ctx.weight_dtype = weight.dtype
        ctx.norm_dtype = None if norm_weight is None else norm_weight.dtype
        count = (targets != IGNORE).sum()
        ctx.mark_non_differentiable(count)
        return total, count

    @staticmethod
    def backward(ctx, grad_total, _grad_count):
        grad_h, grad_w, grad_nw = ctx.saved_tensors
        grad_norm = None if grad_nw is None else (grad_nw * grad_total).to(ctx.norm_dtype)
        return (grad_h * grad_total.to(grad_h.dtype), grad_norm, (grad_w * grad_total).to(ctx.weight_dtype),
                None, None, None, None)


def fused_linear_cross_entropy(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk: int,
                               piece_fn=piece, norm=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of the cross-entropies of h @ weight.T against targets, number of targets other than -100), taken
    `chunk` tokens at a time. h [N, dim] in the compute dtype; piece_fn: `piece`, or a compiled version of it.
    norm: (norm_weight, norm_fn) to take norm_fn(h, norm_weight) in place of h, within the pieces."""
    norm_weight, norm_fn = norm if norm is not None else (None, None)
    return _FusedLinearCrossEntropy.apply(h, norm_weight, weight, targets, chunk, piece_fn, norm_fn)

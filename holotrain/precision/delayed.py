"""FP8 linear layers with delayed scaling (training.fp8 = "delayed").

Each tensor a layer's GEMMs take in FP8 (its input and weight in e4m3, the gradient of its output in e5m2) is
scaled by the largest absolute value that tensor had over the layer's last HISTORY calls, not by its current one.
Why: with the current value (torchao's "tensorwise"), every cast is two passes over the tensor, one to find the
maximum and one to cast, and the scale of a saved input is found and applied again in backward (bench/RESULTS.md:
about a quarter of the 1.4b's FP8 step on an H200). A scale known before the tensor exists lets torch.compile
fuse the cast into the kernel that produces the tensor (a norm, the SwiGLU product, a residual's gradient); the
current maximum, kept for the history, is a reduction over the same values. Backward reuses the casts forward made.

The cost: a value above its tensor's recent maximum saturates at the format's largest number (448 for e4m3, 57344
for e5m2) until the history catches up, one call later. A layer's first call in a process has no history: it scales
by the current maxima, as tensorwise does (a second compiled variant of the block, for that one call). The histories
live in buffers that checkpoints do not keep, so a resumed run starts them afresh the same way.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

HISTORY = 16  # calls (micro-batches) whose maxima a scale covers
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
LARGEST = {E4M3: torch.finfo(E4M3).max, E5M2: torch.finfo(E5M2).max}
HISTORIES = ("fp8_amax_input", "fp8_amax_weight", "fp8_amax_grad_output")


def scale_from(history: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The factor that maps the history's largest magnitude onto the format's largest number."""
    return LARGEST[dtype] / history.amax().clamp(min=torch.finfo(torch.float32).tiny)


def scale_of(x: torch.Tensor, history: torch.Tensor, dtype: torch.dtype, first: bool) -> torch.Tensor:
    """x's scale: from the history, or from x itself on the layer's first call (no history yet)."""
    return scale_from(x.abs().amax().float() if first else history, dtype)


def to_fp8(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x * scale in `dtype`, saturating at its largest number."""
    return (x.float() * scale).clamp(-LARGEST[dtype], LARGEST[dtype]).to(dtype)


def record(history: torch.Tensor, x: torch.Tensor) -> None:
    """Puts x's largest magnitude first in the history, dropping the oldest. The maximum is taken per row first: a
    reduction the kernel that makes x (often a per-row reduction itself, as a norm is) can take on."""
    top = x.abs().amax(dim=-1).amax().float()
    history.copy_(torch.cat([top.reshape(1), history[:-1]]))


class _DelayedFp8Matmul(torch.autograd.Function):
    """x [M, K] @ w [N, K]^T with FP8 operands, and FP8 GEMMs for both gradients. torch._scaled_mm takes its first
    operand row-major and its second column-major, so forward also casts the transposed layouts backward needs."""

    @staticmethod
    def forward(ctx, x, w, amax_x, amax_w, amax_g, out_dtype, first):
        sx, sw = scale_of(x, amax_x, E4M3, first), scale_of(w, amax_w, E4M3, first)
        x8, w8 = to_fp8(x, sx, E4M3), to_fp8(w, sw, E4M3)
        record(amax_x, x)
        record(amax_w, w)
        ix, iw = sx.reciprocal(), sw.reciprocal()
        y = torch._scaled_mm(x8, w8.t(), scale_a=ix, scale_b=iw, out_dtype=out_dtype, use_fast_accum=True)
        # Saved: x^T and w^T in FP8 (a byte a value, where torchao keeps x and w in 16 or 32 bits to cast again).
        ctx.save_for_backward(x8.t().contiguous(), w8.t().contiguous(), ix, iw)
        ctx.amax_g, ctx.x_dtype, ctx.w_dtype, ctx.first = amax_g, x.dtype, w.dtype, first
        return y

    @staticmethod
    def backward(ctx, g):
        x8t, w8t, ix, iw = ctx.saved_tensors
        sg = scale_of(g, ctx.amax_g, E5M2, ctx.first)
        g8 = to_fp8(g, sg, E5M2)
        record(ctx.amax_g, g)
        ig = sg.reciprocal()
        grad_x = torch._scaled_mm(g8, w8t.t(), scale_a=ig, scale_b=iw, out_dtype=ctx.x_dtype)
        grad_w = torch._scaled_mm(g8.t().contiguous(), x8t.t(), scale_a=ig, scale_b=ix, out_dtype=ctx.w_dtype)
        return grad_x, grad_w, None, None, None, None, None


def delayed_fp8_matmul(module: nn.Module, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [..., K] @ w [N, K]^T through the module's scale histories; the output in the autocast dtype, if on."""
    out_dtype = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype
    first = not module.fp8_started
    with torch.autocast(x.device.type, enabled=False):
        y = _DelayedFp8Matmul.apply(x.reshape(-1, x.shape[-1]), w, *(getattr(module, h) for h in HISTORIES),
                                    out_dtype, first)
    module.fp8_started = True
    return y.reshape(*x.shape[:-1], y.shape[-1])


class DelayedFp8Linear(nn.Linear):
    """nn.Linear whose matmul runs in FP8 with delayed scaling; the weight stays an ordinary parameter."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = delayed_fp8_matmul(self, x, self.weight)
        return y if self.bias is None else y + self.bias


def _attach(holder: nn.Module) -> None:
    """Gives `holder` the three scale histories of one FP8 matmul (buffers that checkpoints do not keep)."""
    for name in HISTORIES:
        holder.register_buffer(name, torch.zeros(HISTORY, device=next(holder.parameters()).device),
                               persistent=False)
    holder.fp8_started = False


def convert(module: nn.Linear) -> None:
    """Makes the linear layer a DelayedFp8Linear, in place (the same parameters)."""
    _attach(module)
    module.__class__ = DelayedFp8Linear


def convert_group(parent: nn.Module, method: str, linears: list[nn.Linear]) -> None:
    """Replaces `parent.<method>`, which returns the outputs of `linears` (bias-free, one input), with one FP8 GEMM
    over their weights stacked: the input is cast once, not once a layer, the gradient of the input comes out of
    one GEMM, not as a sum of several, and the GEMMs are larger. The stacked weight has one scale."""
    _attach(parent)
    setattr(parent, method, functools.partial(_group_forward, parent, linears))


def _group_forward(holder: nn.Module, linears: list[nn.Linear], x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    ws = [lin.weight for lin in linears]
    y = delayed_fp8_matmul(holder, x, torch.cat(ws))
    return y.split([w.shape[0] for w in ws], dim=-1)


def reset(model: nn.Module) -> None:
    """Empties every scale history (after the model is materialized: buffers made on "meta" hold no values)."""
    for module in model.modules():
        if hasattr(module, "fp8_started"):
            for name in HISTORIES:
                getattr(module, name).zero_()
            module.fp8_started = False

"""FP8 linear layers with delayed scaling (training.fp8 = "delayed").

Each tensor a layer's GEMMs take in FP8 (its input and weight in e4m3, the gradient of its output in e5m2) is
scaled by the largest absolute value that tensor had over the layer's last HISTORY calls, not by its current one.
Why: with the current value (torchao's "tensorwise"), every cast is two passes over the tensor, one to find the
maximum and one to cast, and the scale of a saved input is found and applied again in backward (bench/RESULTS.md:
about a quarter of the 1.4b's FP8 step on an H200). A scale known before the tensor exists lets torch.compile
fuse the cast into the kernel that produces the tensor (a norm, the SwiGLU product, a residual's gradient); the
current maximum, kept for the history, is a reduction over the same values. Backward reuses the casts forward made.
Linears that read one input (q, k and v; gate and up) cast it once (convert_group).

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


class _DelayedFp8Matmuls(torch.autograd.Function):
    """x [M, K] @ w^T for each weight w [N, K] of linears that read the same x, with FP8 operands, and FP8 GEMMs for
    all gradients. x is cast once for all of them; each weight and each output's gradient has its own scale.
    torch._scaled_mm takes its first operand row-major and its second column-major, so forward also casts the
    transposed layouts backward needs."""

    @staticmethod
    def forward(ctx, x, amax_x, out_dtype, first, *weights_and_histories):
        n = len(weights_and_histories) // 3
        ws, amax_ws, amax_gs = (weights_and_histories[i * n:(i + 1) * n] for i in range(3))
        sx = scale_of(x, amax_x, E4M3, first)
        x8 = to_fp8(x, sx, E4M3)
        record(amax_x, x)
        ix = sx.reciprocal()
        ys, saved = [], []
        for w, amax_w in zip(ws, amax_ws):
            sw = scale_of(w, amax_w, E4M3, first)
            w8 = to_fp8(w, sw, E4M3)
            record(amax_w, w)
            iw = sw.reciprocal()
            ys.append(torch._scaled_mm(x8, w8.t(), scale_a=ix, scale_b=iw, out_dtype=out_dtype, use_fast_accum=True))
            saved += [w8.t().contiguous(), iw]
        # Saved: x^T and each w^T in FP8 (a byte a value, where torchao keeps x and w in 16 or 32 bits to cast again).
        ctx.save_for_backward(x8.t().contiguous(), ix, *saved)
        ctx.amax_gs, ctx.x_dtype, ctx.w_dtype, ctx.first = amax_gs, x.dtype, ws[0].dtype, first
        return tuple(ys)

    @staticmethod
    def backward(ctx, *gs):
        x8t, ix, *saved = ctx.saved_tensors
        grad_x, grad_ws = None, []
        for g, amax_g, w8t, iw in zip(gs, ctx.amax_gs, saved[0::2], saved[1::2]):
            sg = scale_of(g, amax_g, E5M2, ctx.first)
            g8 = to_fp8(g, sg, E5M2)
            record(amax_g, g)
            ig = sg.reciprocal()
            part = torch._scaled_mm(g8, w8t.t(), scale_a=ig, scale_b=iw, out_dtype=ctx.x_dtype)
            grad_x = part if grad_x is None else grad_x + part
            grad_ws.append(torch._scaled_mm(g8.t().contiguous(), x8t.t(), scale_a=ig, scale_b=ix,
                                            out_dtype=ctx.w_dtype))
        return grad_x, None, None, None, *grad_ws, *([None] * 2 * len(grad_ws))


def delayed_fp8_matmuls(linears: list[nn.Linear], x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """x [..., K] @ w^T for each linear's weight w [N, K] (DelayedFp8Linears that read this x), x cast to FP8 once
    by the first linear's input history; the outputs in the autocast dtype, if on."""
    lead = linears[0]
    out_dtype = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype
    first = not lead.fp8_started
    histories = [getattr(lin, h) for h in HISTORIES[1:] for lin in linears]
    with torch.autocast(x.device.type, enabled=False):
        ys = _DelayedFp8Matmuls.apply(x.reshape(-1, x.shape[-1]), lead.fp8_amax_input, out_dtype, first,
                                      *(lin.weight for lin in linears), *histories)
    for lin in linears:
        lin.fp8_started = True
    return tuple(y.reshape(*x.shape[:-1], y.shape[-1]) for y in ys)


class DelayedFp8Linear(nn.Linear):
    """nn.Linear whose matmul runs in FP8 with delayed scaling; the weight stays an ordinary parameter."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        (y,) = delayed_fp8_matmuls([self], x)
        return y if self.bias is None else y + self.bias


def convert(module: nn.Linear) -> None:
    """Makes the linear layer a DelayedFp8Linear, in place (the same parameters), with its three scale histories
    (buffers that checkpoints do not keep)."""
    for name in HISTORIES:
        module.register_buffer(name, torch.zeros(HISTORY, device=module.weight.device), persistent=False)
    module.fp8_started = False
    module.__class__ = DelayedFp8Linear


def convert_group(parent: nn.Module, method: str, linears: list[nn.Linear]) -> None:
    """Converts `linears` (bias-free, reading one input) and replaces `parent.<method>`, which returns their outputs,
    with one call that casts the input once for all of them: its scale is the first linear's (the others' input
    histories stay empty). Their GEMMs and all other scales stay their own."""
    for lin in linears:
        convert(lin)
    setattr(parent, method, functools.partial(delayed_fp8_matmuls, linears))


def reset(model: nn.Module) -> None:
    """Empties every scale history (after the model is materialized: buffers made on "meta" hold no values)."""
    for module in model.modules():
        if isinstance(module, DelayedFp8Linear):
            for name in HISTORIES:
                getattr(module, name).zero_()
            module.fp8_started = False

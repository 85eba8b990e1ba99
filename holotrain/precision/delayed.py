"""FP8 linear layers with delayed scaling (training.fp8 = "delayed").

Each tensor a layer's GEMMs take in FP8 (its input and weight in e4m3, the gradient of its output in e5m2) is
scaled by the largest absolute value that tensor had over the last HISTORY backward passes, not by its current one.
Why: with the current value (torchao's "tensorwise"), every cast is two passes over the tensor, one to find the
maximum and one to cast, and the scale of a saved input is found and applied again in backward (bench/RESULTS.md:
about a quarter of the 1.4b's FP8 step on an H200). A scale known before the tensor exists lets torch.compile
fuse the cast into the kernel that produces the tensor (a norm, the SwiGLU product, a residual's gradient); the
current maximum is a reduction over the same values. Backward reuses the casts forward made. Linears that read one
input (q, k and v; gate and up) cast it once (convert_group).

The bookkeeping stays out of the compiled blocks: a call only raises its layer's running maxima (`fp8_amax`, the
same on a recomputed forward), and after each backward `refresh` moves all layers' maxima into their histories
and computes every scale in a handful of kernels for the whole model. Done per call, it was about 1,500 tiny
kernels a step on the 1.4b, each costing more in launch gaps than in work.

The cost: a value above its tensor's recent maximum saturates at the format's largest number (448 for e4m3, 57344
for e5m2) until the next refresh. Before its first refresh a layer has no history: it scales by the current maxima,
as tensorwise does (a second compiled variant of the block, for that one step). The histories live in buffers that
checkpoints do not keep, so a resumed run starts them afresh the same way.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from holotrain.precision.transpose import fp8_transpose

HISTORY = 16  # backward passes (micro-batches) whose maxima a scale covers
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
LARGEST = {E4M3: torch.finfo(E4M3).max, E5M2: torch.finfo(E5M2).max}
# Each layer's state holds three tensors' values, in this order: its input, its weight, its output's gradient.
X, W, G = 0, 1, 2
FORMATS = (E4M3, E4M3, E5M2)
# The reciprocal scales the GEMMs take are buffers of their own: inductor's scaled-GEMM templates (torch 2.11) fail to
# lower a scale that is an element of a larger buffer.
INV_SCALES = ("fp8_inv_scale_x", "fp8_inv_scale_w", "fp8_inv_scale_g")
STATE = ("fp8_amax", "fp8_scale", *INV_SCALES)  # what a call reads and writes, in cast's argument order


def scale_from(history: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The factor that maps the history's largest magnitude onto the format's largest number."""
    return LARGEST[dtype] / history.amax().clamp(min=torch.finfo(torch.float32).tiny)


def to_fp8(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x * scale in `dtype`, saturating at its largest number."""
    return (x.float() * scale).clamp(-LARGEST[dtype], LARGEST[dtype]).to(dtype)


def cast(x: torch.Tensor, i: int, amax: torch.Tensor, scale: torch.Tensor, inv_x: torch.Tensor, inv_w: torch.Tensor,
         inv_g: torch.Tensor, first: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """x in FP8 by its layer's scale for tensor i (X, W or G), or by x's own maximum before the layer's first refresh,
    and the reciprocal scale its GEMM takes. Raises the layer's running maximum for tensor i to x's. The maximum is
    taken per row first: a reduction the kernel that makes x (often a per-row reduction itself, as a norm is) can
    take on."""
    top = x.abs().amax(dim=-1).amax().float()
    slot = amax[i:i + 1]
    slot.copy_(torch.maximum(slot, top.reshape(1)))
    if first:
        own = scale_from(top, FORMATS[i])
        return to_fp8(x, own, FORMATS[i]), own.reciprocal()
    return to_fp8(x, scale[i], FORMATS[i]), (inv_x, inv_w, inv_g)[i]


class _DelayedFp8Matmuls(torch.autograd.Function):
    """x [M, K] @ w^T for each weight w [N, K] of linears that read the same x, with FP8 operands, and FP8 GEMMs for
    all gradients. x is cast once for all of them, by the first linear's input scale; each weight and each output's
    gradient has its own scale. torch._scaled_mm takes its first operand row-major and its second column-major, so
    forward also casts the transposed layouts backward needs. `states`: each linear's buffers named in STATE.
    Forward's GEMM and the input gradient's accumulate in the tensor cores' faster, less precise mode (their sums
    run over the model's widths); the weight gradient's sums run over every token of the micro-batch and keep the
    precise mode."""

    @staticmethod
    def forward(ctx, x, out_dtype, first, *weights_and_states):
        n, k = len(weights_and_states) // (1 + len(STATE)), len(STATE)
        ws, states = weights_and_states[:n], [weights_and_states[n + k * j:n + k * (j + 1)] for j in range(n)]
        x8, ix = cast(x, X, *states[0], first)
        ys, saved = [], []
        for w, state in zip(ws, states):
            w8, iw = cast(w, W, *state, first)
            ys.append(torch._scaled_mm(x8, w8.t(), scale_a=ix, scale_b=iw, out_dtype=out_dtype, use_fast_accum=True))
            saved += [fp8_transpose(w8), iw]
        # Saved: x^T and each w^T in FP8 (a byte a value, where torchao keeps x and w in 16 or 32 bits to cast again).
        ctx.save_for_backward(fp8_transpose(x8), ix, *saved)
        ctx.states, ctx.x_dtype, ctx.w_dtype, ctx.first = states, x.dtype, ws[0].dtype, first
        return tuple(ys)

    @staticmethod
    def backward(ctx, *gs):
        x8t, ix, *saved = ctx.saved_tensors
        grad_x, grad_ws = None, []
        for g, state, w8t, iw in zip(gs, ctx.states, saved[0::2], saved[1::2]):
            g8, ig = cast(g, G, *state, ctx.first)
            part = torch._scaled_mm(g8, w8t.t(), scale_a=ig, scale_b=iw, out_dtype=ctx.x_dtype, use_fast_accum=True)
            grad_x = part if grad_x is None else grad_x + part
            grad_ws.append(torch._scaled_mm(fp8_transpose(g8), x8t.t(), scale_a=ig, scale_b=ix,
                                            out_dtype=ctx.w_dtype))
        return grad_x, None, None, *grad_ws, *([None] * len(STATE) * len(grad_ws))


def delayed_fp8_matmuls(linears: list[nn.Linear], x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """x [..., K] @ w^T for each linear's weight w [N, K] (DelayedFp8Linears that read this x), x cast to FP8 once
    by the first linear's input scale; the outputs in the autocast dtype, if on."""
    out_dtype = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype
    first = not linears[0].fp8_started
    states = [getattr(lin, name) for lin in linears for name in STATE]
    with torch.autocast(x.device.type, enabled=False):
        ys = _DelayedFp8Matmuls.apply(x.reshape(-1, x.shape[-1]), out_dtype, first,
                                      *(lin.weight for lin in linears), *states)
    return tuple(y.reshape(*x.shape[:-1], y.shape[-1]) for y in ys)


class DelayedFp8Linear(nn.Linear):
    """nn.Linear whose matmul runs in FP8 with delayed scaling; the weight stays an ordinary parameter."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        (y,) = delayed_fp8_matmuls([self], x)
        return y if self.bias is None else y + self.bias


def convert(module: nn.Linear) -> None:
    """Makes the linear layer a DelayedFp8Linear, in place (the same parameters), with its scaling state (buffers
    that checkpoints do not keep): running maxima, histories and scales of its input, weight and output gradient."""
    device = module.weight.device
    module.register_buffer("fp8_amax", torch.zeros(3, device=device), persistent=False)
    module.register_buffer("fp8_history", torch.zeros(3, HISTORY, device=device), persistent=False)
    module.register_buffer("fp8_scale", torch.ones(3, device=device), persistent=False)
    for name in INV_SCALES:
        module.register_buffer(name, torch.ones((), device=device), persistent=False)
    module.fp8_started = False
    module.__class__ = DelayedFp8Linear


def convert_group(parent: nn.Module, method: str, linears: list[nn.Linear]) -> None:
    """Converts `linears` (bias-free, reading one input) and replaces `parent.<method>`, which returns their outputs,
    with one call that casts the input once for all of them: its scale is the first linear's (the others' input
    state stays empty). Their GEMMs and all other scales stay their own."""
    for lin in linears:
        convert(lin)
    setattr(parent, method, functools.partial(delayed_fp8_matmuls, linears))


def layers(model: nn.Module) -> list[DelayedFp8Linear]:
    return [m for m in model.modules() if isinstance(m, DelayedFp8Linear)]


@torch.no_grad()
def reset(linears: list[DelayedFp8Linear]) -> None:
    """Empties the layers' scaling state (after the model is materialized: buffers made on "meta" hold no values)."""
    for lin in linears:
        lin.fp8_amax.zero_()
        lin.fp8_history.zero_()
        lin.fp8_scale.fill_(1.0)
        for name in INV_SCALES:
            getattr(lin, name).fill_(1.0)
        lin.fp8_started = False


@torch.no_grad()
def refresh(linears: list[DelayedFp8Linear]) -> None:
    """After a backward: every layer's running maxima become the newest entry of its histories, and its scales map the
    histories' maxima onto the formats' largest numbers. A tensor with no maximum yet (an input another linear of
    its group casts) keeps scale 1. One stack, a few kernels and one copy back for the whole model."""
    if not linears:
        return
    amax = torch.stack([lin.fp8_amax for lin in linears])  # [layers, 3]
    history = torch.stack([lin.fp8_history for lin in linears])  # [layers, 3, HISTORY]
    history = torch.cat([amax.unsqueeze(-1), history[..., :-1]], dim=-1)
    top = history.amax(dim=-1)
    largest = torch.full_like(top, LARGEST[E4M3])  # filled on the device: a tensor from a list would wait for it
    largest[:, G] = LARGEST[E5M2]
    scale = torch.where(top > 0, largest / top.clamp(min=torch.finfo(torch.float32).tiny), 1.0)
    torch._foreach_copy_([lin.fp8_history for lin in linears], list(history.unbind(0)))
    torch._foreach_copy_([lin.fp8_scale for lin in linears], list(scale.unbind(0)))
    torch._foreach_copy_([getattr(lin, name) for lin in linears for name in INV_SCALES],
                         list(scale.reciprocal().flatten().unbind(0)))
    torch._foreach_zero_([lin.fp8_amax for lin in linears])
    for lin in linears:
        lin.fp8_started = True

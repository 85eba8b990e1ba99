"""AdamW with its two moments stored in bf16 (memory.adamw_moments = "bf16"): 4 bytes a parameter instead of 8.

The weights and gradients stay fp32 and the update is computed in fp32; only the stored moments are rounded, and
stochastically: each is rounded up with probability equal to its distance from the bf16 value below, so the
rounding is unbiased and small increments survive on average. Round-to-nearest would freeze the second moment
wherever (1 - beta2) * (g^2 / v - 1) stays under half a bf16 ulp (2^-9): with beta2 = 0.999 that is most of the
time. The random bits come from the parameter's step count and its index (a hash, mix32), so a resumed run
draws the same ones, and the CPU's path the same as the GPU's.

On CUDA one Triton kernel per parameter group updates every tensor (optim/bf16_moments_kernel.py: a table of
pointers, one launch); elsewhere the same arithmetic runs per tensor in torch ops, which the GPU test compares the
kernel against. The update is torch's AdamW, with its fused kernel's `grad_scale` (the clip, folded into the read
of each gradient) and `found_inf` (skip the step, step counts unchanged), set as attributes by optim.step_clipped.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

# Distinct random streams for up to this many tensors per group per step.
TENSORS_PER_STEP = 1 << 16


def local(t: torch.Tensor) -> torch.Tensor:
    """The tensor this rank holds (an FSDP2 shard's local part)."""
    return t.to_local() if isinstance(t, DTensor) else t


def round_bf16_stochastic(x: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """fp32 `x` to bf16, rounded up with probability (the dropped 16 bits) / 2^16: `noise` holds uniform integers in
    [0, 2^16). Adding them below bf16's last bit and truncating carries into that bit exactly that often; the carry
    runs through the bit pattern, so a negative value rounds in magnitude the same way."""
    bits = x.view(torch.int32)
    return ((bits + noise.to(torch.int32)) & -65536).view(torch.float32).to(torch.bfloat16)


def stream_key(step: int, index: int, seed: int) -> int:
    """The random stream of tensor `index` of a group at its step `step` (both kernels use it)."""
    return (seed + step * TENSORS_PER_STEP + index) & 0x7FFF_FFFF_FFFF_FFFF


_M32 = 0xFFFF_FFFF


def _mul32(a, b: int):
    """a * b mod 2^32, for a < 2^32 (int or int64 tensor) without overflowing int64."""
    return (a * (b & 0xFFFF) + (((a * (b >> 16)) & 0xFFFF) << 16)) & _M32


def mix32(h):
    """MurmurHash3's 32-bit finalizer: a bijection whose output bits each depend on every input bit. The random
    bits of element i of a stream are mix32(i + stream(key)): cheap enough to draw two per value in the kernel,
    where Philox's ten rounds cost more than the update itself."""
    h = h ^ (h >> 16)
    h = _mul32(h, 0x85EBCA6B)
    h = h ^ (h >> 13)
    h = _mul32(h, 0xC2B2AE35)
    return h ^ (h >> 16)


def stream(key: int) -> int:
    """The 64-bit stream key folded to the 32 bits added to each element's index."""
    return mix32((key & _M32) ^ mix32(key >> 32))


def random_bits(numel: int, key: int, device) -> torch.Tensor:
    """The 32 random bits of each of `numel` values of stream `key` (int64, in [0, 2^32)): as the kernel draws them."""
    return mix32((torch.arange(numel, dtype=torch.int64, device=device) + stream(key)) & _M32)


def reference_update(p, g, m, v, step: float, index: int, seed: int, lr: float, beta1: float, beta2: float,
                     eps: float, weight_decay: float, grad_scale: float) -> None:
    """One tensor's AdamW step in torch ops, in place: `step` is its step count after this step."""
    g32 = g.float() / grad_scale
    m32 = m.float().lerp_(g32, 1 - beta1)
    v32 = v.float().mul_(beta2).addcmul_(g32, g32, value=1 - beta2)
    bias1, bias2 = 1 - beta1 ** step, 1 - beta2 ** step
    p.mul_(1 - lr * weight_decay)
    p.addcdiv_(m32, v32.sqrt().div_(bias2 ** 0.5).add_(eps), value=-lr / bias1)
    bits = random_bits(p.numel(), stream_key(int(step), index, seed), p.device).view(p.shape)
    m.copy_(round_bf16_stochastic(m32, bits & 0xFFFF))
    v.copy_(round_bf16_stochastic(v32, bits >> 16))


class AdamWBf16Moments(torch.optim.Optimizer):
    """torch.optim.AdamW's update and state layout ("step", "exp_avg", "exp_avg_sq" per parameter; a checkpoint of
    either loads into the other), with the moments in bf16. Parameters fp32, plain or FSDP2 DTensors."""

    def __init__(self, params, lr: float, betas: tuple[float, float], eps: float, weight_decay: float = 0.0,
                 seed: int = 0):
        # torch's fused AdamW's group keys, so that a checkpoint's param_groups load either way (a fused AdamW resumed
        # from this one's checkpoint stays fused).
        defaults = torch.optim.AdamW([torch.zeros(1)], lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                                     fused=True).defaults
        super().__init__(params, dict(defaults))
        self.seed = seed
        self.grad_scale: torch.Tensor | None = None  # the clip's divisor, a device scalar (step_clipped)
        self.found_inf: torch.Tensor | None = None  # nonzero: skip this step
        self._kernels: dict[int, object] = {}  # group index -> its CUDA kernel's tables
        # Optimizer.load_state_dict casts loaded moments to the parameters' dtype; they are stored in bf16.
        self.register_load_state_dict_post_hook(AdamWBf16Moments._moments_to_bf16)

    def _state(self, p: torch.Tensor) -> dict:
        state = self.state[p]
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float32, device=local(p).device)
            state["exp_avg"] = torch.zeros_like(p, dtype=torch.bfloat16, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.bfloat16, memory_format=torch.preserve_format)
        return state

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for index, group in enumerate(self.param_groups):
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            states = [self._state(p) for p in params]
            steps = [s["step"] for s in states]
            torch._foreach_add_(steps, 1.0)
            if self.found_inf is not None:
                torch._foreach_sub_(steps, [self.found_inf.to(steps[0].device)] * len(steps))
            tensors = [[local(x) for x in row] for row in
                       zip(*[(p, p.grad, s["exp_avg"], s["exp_avg_sq"]) for p, s in zip(params, states)])]
            self._update(index, group, *tensors, [local(s) for s in steps])
        return loss

    def _update(self, index: int, group: dict, ps, gs, ms, vs, steps) -> None:
        beta1, beta2 = group["betas"]
        seed = self.seed + index * 7919
        if _kernel_applies(ps, gs, ms, vs):
            from holotrain.optim.bf16_moments_kernel import GroupKernel

            kernel = self._kernels.get(index)
            if kernel is None or not kernel.matches(ps, ms, vs, steps):
                kernel = self._kernels[index] = GroupKernel(ps, ms, vs, steps)
            kernel.run(gs, self.grad_scale, self.found_inf, seed, TENSORS_PER_STEP, float(group["lr"]), beta1, beta2,
                       group["eps"], group["weight_decay"])
            return
        if self.found_inf is not None and self.found_inf.item():
            return
        scale = 1.0 if self.grad_scale is None else self.grad_scale.item()
        for i, (p, g, m, v, step) in enumerate(zip(ps, gs, ms, vs, steps)):
            reference_update(p, g, m, v, step.item(), i, seed, float(group["lr"]), beta1, beta2, group["eps"],
                             group["weight_decay"], scale)

    @staticmethod
    def _moments_to_bf16(optimizer: AdamWBf16Moments) -> None:
        for state in optimizer.state.values():
            for key in ("exp_avg", "exp_avg_sq"):
                if key in state and state[key].dtype != torch.bfloat16:
                    state[key] = state[key].to(torch.bfloat16)
            if "step" in state:
                state["step"] = state["step"].to(torch.float32)
        optimizer._kernels.clear()


def _kernel_applies(ps, gs, ms, vs) -> bool:
    """The Triton kernel's case: CUDA, contiguous, aligned, fp32 weights and gradients."""
    if not ps[0].is_cuda:
        return False
    from holotrain.optim.bf16_moments_kernel import aligned

    return all(p.dtype == torch.float32 and g.dtype == torch.float32 and p.is_contiguous() and g.is_contiguous()
               and m.is_contiguous() and v.is_contiguous() and aligned(p, g, m, v) for p, g, m, v in zip(ps, gs, ms, vs))

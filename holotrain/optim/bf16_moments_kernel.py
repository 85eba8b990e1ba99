"""The CUDA step of optim/bf16_moments.py: one Triton launch updates every tensor of a parameter group.

A table on the device holds each tensor's pointers (weight, first and second moment, step count) and a second one
its gradient's; the grid runs over blocks of BLOCK values, each block knowing its tensor and its place in it.
One launch instead of one per tensor matters for the small ones: a model has hundreds of norm weights whose
update takes less time than a launch. Gradients are new tensors every step (zero_grad sets them to None), so
their pointers are uploaded from a pinned buffer whenever they change, with no synchronization of the stream.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from holotrain.optim.bf16_moments import TENSORS_PER_STEP

BLOCK = 2048
_ALIGN = 16  # bytes: every pointer is checked for it, so the kernel may load 16-byte vectors


@triton.jit(do_not_specialize=["seed", "lr", "weight_decay"])
def _adamw_bf16(table, grads, numels, block_tensor, block_index, grad_scale, found_inf, seed, lr, beta1, beta2,
                log_beta1, log_beta2, eps, weight_decay, STREAMS: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    t = tl.load(block_tensor + pid)
    n = tl.load(numels + t)
    row = table + t * 4
    p_ptr = tl.multiple_of(tl.load(row).to(tl.pointer_type(tl.float32)), 16)
    m_ptr = tl.multiple_of(tl.load(row + 1).to(tl.pointer_type(tl.bfloat16)), 16)
    v_ptr = tl.multiple_of(tl.load(row + 2).to(tl.pointer_type(tl.bfloat16)), 16)
    step = tl.load(tl.load(row + 3).to(tl.pointer_type(tl.float32)))
    g_ptr = tl.multiple_of(tl.load(grads + t).to(tl.pointer_type(tl.float32)), 16)

    offs = tl.load(block_index + pid) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < tl.where(tl.load(found_inf) == 0, n, 0)  # a skipped step touches nothing
    p = tl.load(p_ptr + offs, mask=mask)
    g = tl.load(g_ptr + offs, mask=mask) / tl.load(grad_scale)
    m = tl.load(m_ptr + offs, mask=mask).to(tl.float32)
    v = tl.load(v_ptr + offs, mask=mask).to(tl.float32)

    m = m + (1 - beta1) * (g - m)
    v = beta2 * v + (1 - beta2) * g * g
    bias1 = 1 - tl.exp(step * log_beta1)
    bias2 = 1 - tl.exp(step * log_beta2)
    p = p * (1 - lr * weight_decay) - (lr / bias1) * m / (tl.sqrt(v) / tl.sqrt(bias2) + eps)
    tl.store(p_ptr + offs, p, mask=mask)

    # Stochastic rounding to bf16 (bf16_moments.round_bf16_stochastic): the low 16 random bits for m, the high for v.
    key = seed + step.to(tl.int64) * STREAMS + t
    r = tl.randint(key, offs).to(tl.int32, bitcast=True)
    m_bits = (m.to(tl.int32, bitcast=True) + (r & 0xFFFF)) & -65536
    v_bits = (v.to(tl.int32, bitcast=True) + ((r >> 16) & 0xFFFF)) & -65536
    tl.store(m_ptr + offs, m_bits.to(tl.float32, bitcast=True).to(tl.bfloat16), mask=mask)
    tl.store(v_ptr + offs, v_bits.to(tl.float32, bitcast=True).to(tl.bfloat16), mask=mask)


def aligned(*tensors: torch.Tensor) -> bool:
    return all(t.data_ptr() % _ALIGN == 0 for t in tensors)


def _pointers(*columns) -> tuple:
    return tuple(t.data_ptr() for column in columns for t in column)


class GroupKernel:
    """The tables of one parameter group, built once and rebuilt when a tensor moves (a loaded checkpoint)."""

    def __init__(self, ps, ms, vs, steps):
        device = ps[0].device
        self.key = _pointers(ps, ms, vs, steps)
        counts = torch.tensor([triton.cdiv(p.numel(), BLOCK) for p in ps])
        self.blocks = int(counts.sum())
        self.table = torch.tensor([[p.data_ptr(), m.data_ptr(), v.data_ptr(), s.data_ptr()]
                                   for p, m, v, s in zip(ps, ms, vs, steps)], dtype=torch.int64, device=device)
        self.numels = torch.tensor([p.numel() for p in ps], dtype=torch.int32, device=device)
        self.block_tensor = torch.repeat_interleave(torch.arange(len(ps), dtype=torch.int32), counts).to(device)
        firsts = torch.cumsum(counts, 0) - counts
        self.block_index = (torch.arange(self.blocks) - torch.repeat_interleave(firsts, counts)).to(
            torch.int32).to(device)
        self.grad_key: tuple | None = None
        self.grads_host = torch.empty(len(ps), dtype=torch.int64, pin_memory=True)
        self.grads = torch.empty(len(ps), dtype=torch.int64, device=device)
        self.uploaded: torch.cuda.Event | None = None
        self.one = torch.ones((), device=device)
        self.zero = torch.zeros((), device=device)

    def matches(self, ps, ms, vs, steps) -> bool:
        return _pointers(ps, ms, vs, steps) == self.key

    def run(self, gs, grad_scale, found_inf, seed: int, lr: float, beta1: float, beta2: float, eps: float,
            weight_decay: float) -> None:
        key = _pointers(gs)
        if key != self.grad_key:
            if self.uploaded is not None:
                self.uploaded.synchronize()  # the last upload has read the pinned buffer (long done by now)
            self.grads_host.numpy()[:] = key
            self.grads.copy_(self.grads_host, non_blocking=True)
            self.uploaded = torch.cuda.Event()
            self.uploaded.record()
            self.grad_key = key
        _adamw_bf16[(self.blocks,)](
            self.table, self.grads, self.numels, self.block_tensor, self.block_index,
            self.one if grad_scale is None else grad_scale, self.zero if found_inf is None else found_inf,
            seed, lr, beta1, beta2, math.log(beta1), math.log(beta2), eps, weight_decay,
            STREAMS=TENSORS_PER_STEP, BLOCK=BLOCK, num_warps=4)

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

BLOCK = 2048
_ALIGN = 16  # bytes: every pointer is checked for it, so the kernel may load 16-byte vectors


@triton.jit
def _mix32(h):
    # bf16_moments.mix32 on uint32 values (multiplication wraps at 2^32).
    h ^= h >> 16
    h *= 0x85EBCA6B
    h ^= h >> 13
    h *= 0xC2B2AE35
    return h ^ (h >> 16)


@triton.jit
def _update(p_ptr, g_ptr, m_ptr, v_ptr, offs, bound, scale, stream, lr, beta1, beta2, bias1, bias2, eps,
            weight_decay, MASKED: tl.constexpr):
    if MASKED:
        mask = offs < bound
        p = tl.load(p_ptr + offs, mask=mask)
        g = tl.load(g_ptr + offs, mask=mask)
        m = tl.load(m_ptr + offs, mask=mask).to(tl.float32)
        v = tl.load(v_ptr + offs, mask=mask).to(tl.float32)
    else:  # a whole block: no mask, so the loads and stores are 16-byte vectors
        p = tl.load(p_ptr + offs)
        g = tl.load(g_ptr + offs)
        m = tl.load(m_ptr + offs).to(tl.float32)
        v = tl.load(v_ptr + offs).to(tl.float32)
    g = g / scale
    m = m + (1 - beta1) * (g - m)
    v = beta2 * v + (1 - beta2) * g * g
    p = p * (1 - lr * weight_decay) - (lr / bias1) * m / (tl.sqrt(v) / tl.sqrt(bias2) + eps)
    # Stochastic rounding to bf16 (bf16_moments.round_bf16_stochastic): the low 16 random bits for m, the high for v.
    r = _mix32(offs.to(tl.uint32) + stream)
    m_bits = (m.to(tl.int32, bitcast=True) + (r & 0xFFFF).to(tl.int32)) & -65536
    v_bits = (v.to(tl.int32, bitcast=True) + (r >> 16).to(tl.int32)) & -65536
    m = m_bits.to(tl.float32, bitcast=True).to(tl.bfloat16)
    v = v_bits.to(tl.float32, bitcast=True).to(tl.bfloat16)
    if MASKED:
        tl.store(p_ptr + offs, p, mask=mask)
        tl.store(m_ptr + offs, m, mask=mask)
        tl.store(v_ptr + offs, v, mask=mask)
    else:
        tl.store(p_ptr + offs, p)
        tl.store(m_ptr + offs, m)
        tl.store(v_ptr + offs, v)


@triton.jit(do_not_specialize=["seed", "lr", "weight_decay"])
def _adamw_bf16(table, grads, numels, block_tensor, block_index, grad_scale, found_inf, seed, lr, beta1, beta2,
                log_beta1, log_beta2, eps, weight_decay, STREAMS: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    t = tl.load(block_tensor + pid)
    row = table + t * 4
    p_ptr = tl.multiple_of(tl.load(row).to(tl.pointer_type(tl.float32)), 16)
    m_ptr = tl.multiple_of(tl.load(row + 1).to(tl.pointer_type(tl.bfloat16)), 16)
    v_ptr = tl.multiple_of(tl.load(row + 2).to(tl.pointer_type(tl.bfloat16)), 16)
    step = tl.load(tl.load(row + 3).to(tl.pointer_type(tl.float32)))
    g_ptr = tl.multiple_of(tl.load(grads + t).to(tl.pointer_type(tl.float32)), 16)
    bound = tl.where(tl.load(found_inf) == 0, tl.load(numels + t), 0)  # a skipped step touches nothing
    start = tl.load(block_index + pid) * BLOCK
    offs = start + tl.arange(0, BLOCK)

    # The random stream: bf16_moments.stream_key, folded to 32 bits as bf16_moments.stream does.
    key = seed + step.to(tl.int64) * STREAMS + t
    stream = _mix32((key & 0xFFFFFFFF).to(tl.uint32) ^ _mix32((key >> 32).to(tl.uint32)))
    bias1 = 1 - tl.exp(step * log_beta1)
    bias2 = 1 - tl.exp(step * log_beta2)
    scale = tl.load(grad_scale)
    if start + BLOCK <= bound:
        _update(p_ptr, g_ptr, m_ptr, v_ptr, offs, bound, scale, stream, lr, beta1, beta2, bias1, bias2, eps,
                weight_decay, False)
    elif start < bound:
        _update(p_ptr, g_ptr, m_ptr, v_ptr, offs, bound, scale, stream, lr, beta1, beta2, bias1, bias2, eps,
                weight_decay, True)


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

    def run(self, gs, grad_scale, found_inf, seed: int, streams: int, lr: float, beta1: float, beta2: float,
            eps: float, weight_decay: float) -> None:
        """`seed` and `streams`: bf16_moments.stream_key's (a stream per tensor, `streams` of them per step)."""
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
            STREAMS=streams, BLOCK=BLOCK, num_warps=4)

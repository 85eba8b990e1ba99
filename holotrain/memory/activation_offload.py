"""Activation offload: the first blocks' saved tensors wait in pinned host memory between forward and backward.

`memory.activation_offload_blocks = N` applies to blocks 0..N-1. Their GPU memory is free at the step's peak, the
end of forward, and nothing is recomputed: the cost is PCIe traffic, which overlaps compute on copy streams of its
own. A block recomputed whole (activation checkpointing "full") saves only its input, which then waits on the host:
at long sequences, where one [B, T, dim] input per block is most of the memory, the blocks' inputs beyond what the
GPU holds go there (Arctic's offloaded checkpoints), their copies small beside the block's attention. The 1.4b at
micro-batch 16 without checkpointing keeps about 2.2 GB per block for backward, and the link moves that in about
45 ms; the whole forward takes about 140 ms, the backward of the blocks above the offloaded ones twice that.

How: the model runs its blocks through this object (its `run_blocks` hook), each outside the block's compiled
region. An offloaded block runs under torch.autograd.graph.saved_tensors_hooks. A compiled block saves its tensors when its
forward returns and unpacks them all when its backward starts; an eager block, op by op.
- Pack: a GPU tensor of at least MIN_BYTES is copied, on the offload stream, into a pinned host buffer of its own
  (made on the first step, reused by every later one), once the compute stream has produced it. record_stream
  tells the allocator that its memory may be reused only when that copy is done.
- Fetch: the copy back, on the fetch stream, into a fresh GPU tensor with the same strides (compiled backward
  code expects them). Fetches start as early as memory allows: block j's when the gradient reaches block
  j + n_layers - 1 - N, when as many blocks have finished their backward (and freed what they kept) as have been
  fetched. So the copies back run under the backward of the blocks above, and the step's peak stays the end of
  forward.
- Unpack: the compute stream waits for the tensor's fetch.
On a CPU the same bookkeeping copies into host buffers and back, without streams: the reference path the tests
compare against training without offload.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn.attention.flex_attention import BlockMask

MIN_BYTES = 1 << 20  # smaller saved tensors (norm weights, statistics) stay where they are
# The PCIe link, for the planner: the offload engine's copies on the H200 moved 13.5 GB to the host in 0.27 s and
# back in 0.32 s (bench/RESULTS.md).
OUT_BYTES_S, BACK_BYTES_S = 50e9, 42e9


def exposed_copy_s(offloaded_bytes: float, blocks: int, n_layers: int, forward_s: float, backward_s: float) -> float:
    """Seconds one micro-batch's backward waits for the copies back, by the module's rule: the blocks' copies go
    out one after another as their forwards end and come back one after another, each queued when the gradient
    reaches the block fetch_lead() above it and needed when that block's own backward starts. Forward never waits:
    it only frees the memory later."""
    if not blocks or offloaded_bytes <= 0:
        return 0.0
    back = offloaded_bytes / blocks / BACK_BYTES_S  # one block's
    fwd, bwd = forward_s / n_layers, backward_s / n_layers
    # Backward's clock starts at the end of forward: the last copy out lands this long after (or before) that.
    out_done = fwd + offloaded_bytes / OUT_BYTES_S - forward_s
    delay = 0.0
    fetched = out_done
    lead = fetch_lead(blocks, n_layers)
    for j in range(blocks - 1, -1, -1):  # the copies back, in backward's order
        queued = (n_layers - 1 - (j + lead)) * bwd + delay
        fetched = max(queued, fetched, out_done) + back
        needed = (n_layers - 1 - j) * bwd + delay
        delay += max(0.0, fetched - needed)
    return delay


def fetch_lead(blocks: int, n_layers: int) -> int:
    """How many blocks above it a block's copy back is queued: as many blocks have then freed what they kept as
    have been fetched (see the module's note); 0, on demand, when every block is offloaded."""
    return max(0, n_layers - 1 - blocks)


@dataclass
class _Slot:
    """One saved tensor's host buffer, reused step after step."""

    host: torch.Tensor
    fetched: torch.cuda.Event | None = None  # its last copy back has read it (on a GPU)


class _Packed:
    """What autograd keeps for one offloaded tensor: where it waits, and its way back."""

    __slots__ = ("slot", "stored", "size", "stride", "dtype", "device", "on_device", "arrived")

    def __init__(self, slot: _Slot, stored, size, stride, dtype, device):
        self.slot, self.stored = slot, stored
        self.size, self.stride, self.dtype, self.device = size, stride, dtype, device
        self.on_device: torch.Tensor | None = None
        self.arrived = None  # the fetch's event (GPU)


class ActivationOffload:
    saves_to_host = True  # the model's run_blocks hook: evaluation then runs without grad (nothing to copy out)

    def __init__(self, n_blocks: int, n_layers: int, device: torch.device, min_bytes: int = MIN_BYTES,
                 announce: bool = False):
        self.n_blocks, self.min_bytes = n_blocks, min_bytes
        self.lead = fetch_lead(n_blocks, n_layers)
        self._announce = announce  # one line after the first backward: what the host holds
        self.cuda = device.type == "cuda"
        if self.cuda and device.index is None:  # "cuda" names the current card; tensors name it by its index
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        self._slots: dict[tuple[int, int], _Slot] = {}
        self._packed: dict[int, list[_Packed]] = {}  # block -> its tensors of the last forward, until fetched
        self._block = 0
        self._count = 0
        self._shared: set[int] = set()
        if self.cuda:
            self._offload_stream = torch.cuda.Stream(device)
            self._fetch_stream = torch.cuda.Stream(device)

    @property
    def host_bytes(self) -> int:
        """Pinned host memory held for the saved tensors (after the first step)."""
        return sum(s.host.untyped_storage().nbytes() for s in self._slots.values())

    def __call__(self, blocks: list[tuple[int, torch.nn.Module]], h: torch.Tensor, *args) -> torch.Tensor:
        for index, block in blocks:
            h = self.run_block(index, block, h, *args)
        return h

    def run_block(self, index: int, block: torch.nn.Module, h: torch.Tensor, *args):
        """Block `index` of the model on `h`; its saved tensors go to the host if it is one of the first N."""
        if index < self.n_blocks and torch.is_grad_enabled():
            self._block, self._count = index, 0
            self._packed[index] = []
            # The block's other inputs (the rotary tables, the document mask) are every block's: they stay put.
            self._shared = {t.untyped_storage().data_ptr() for t in _tensors_of(args)}
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                out = block(h, *args)
        else:
            out = block(h, *args)
        # Marks only where backward queues a fetch (blocks lead .. lead+N-1), and on block 0 until the announcement.
        if out.requires_grad and (self.lead <= index < self.n_blocks + self.lead or (index == 0 and self._announce)):
            out = _BackwardReached.apply(out, self, index)
        return out

    # ---- forward
    def _pack(self, t: torch.Tensor):
        if (isinstance(t, torch.nn.Parameter) or t.device != self.device or t.numel() * t.element_size() < self.min_bytes
                or not _dense(t) or t.untyped_storage().data_ptr() in self._shared):
            return t
        slot = self._slot(t)
        if self.cuda:
            produced = torch.cuda.current_stream(self.device).record_event()
            with torch.cuda.stream(self._offload_stream):
                self._offload_stream.wait_event(produced)
                if slot.fetched is not None:  # the buffer's last copy back has read it
                    self._offload_stream.wait_event(slot.fetched)
                slot.host.copy_(t, non_blocking=True)
                stored = self._offload_stream.record_event()
            t.record_stream(self._offload_stream)
        else:
            slot.host.copy_(t)
            stored = None
        packed = _Packed(slot, stored, t.shape, t.stride(), t.dtype, t.device)
        self._packed[self._block].append(packed)
        return packed

    def _slot(self, t: torch.Tensor) -> _Slot:
        key = (self._block, self._count)
        self._count += 1
        slot = self._slots.get(key)
        if slot is None or slot.host.shape != t.shape or slot.host.stride() != t.stride() or slot.host.dtype != t.dtype:
            host = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cpu", pin_memory=self.cuda)
            slot = self._slots[key] = _Slot(host)
        return slot

    # ---- backward
    def backward_reached(self, index: int) -> None:
        """The gradient has reached block `index`'s output: fetch the offloaded blocks it will need soon."""
        for block in range(min(index, self.n_blocks - 1), max(index - self.lead, 0) - 1, -1):
            for packed in self._packed.pop(block, ()):
                self._fetch(packed)
        if index == 0 and self._announce:
            self._announce = False
            print(f"holotrain: activation offload: blocks 0-{self.n_blocks - 1} keep {len(self._slots)} saved tensors, "
                  f"{self.host_bytes / 1e9:.2f} GB, in {'pinned ' if self.cuda else ''}host memory", flush=True)

    def _fetch(self, p: _Packed) -> None:
        if p.on_device is not None or p.arrived is not None:
            return
        p.on_device = torch.empty_strided(p.size, p.stride, dtype=p.dtype, device=p.device)
        if self.cuda:
            free = torch.cuda.current_stream(self.device).record_event()  # the new tensor's memory is free by then
            with torch.cuda.stream(self._fetch_stream):
                self._fetch_stream.wait_event(free)
                self._fetch_stream.wait_event(p.stored)
                p.on_device.copy_(p.slot.host, non_blocking=True)
                p.arrived = p.slot.fetched = self._fetch_stream.record_event()
            p.on_device.record_stream(self._fetch_stream)
        else:
            p.on_device.copy_(p.slot.host)

    def _unpack(self, p):
        if not isinstance(p, _Packed):
            return p
        self._fetch(p)  # not yet fetched (its block's backward came before any prefetch reached it)
        if p.arrived is not None:
            torch.cuda.current_stream(self.device).wait_event(p.arrived)
        out, p.on_device, p.arrived = p.on_device, None, None  # autograd holds it now, for as long as it needs it
        return out


def _tensors_of(args) -> list[torch.Tensor]:
    """The tensors among a block's inputs, those a BlockMask holds included: at T = 1M its four [T/128, T/128] index
    tensors are 1.07 GB, every block's, and would otherwise be copied out once per offloaded block."""
    found = []
    for a in args:
        if isinstance(a, torch.Tensor):
            found.append(a)
        elif isinstance(a, BlockMask):
            found += [t for t in a.as_tuple() if isinstance(t, torch.Tensor)]
    return found


def _dense(t: torch.Tensor) -> bool:
    """Whether t's elements fill a span of its storage exactly once (a permutation of a contiguous tensor): then a
    buffer made with t's strides holds it, and the copies move that span as one block."""
    expected = 1
    for stride, size in sorted((st, sz) for sz, st in zip(t.shape, t.stride()) if sz != 1):
        if stride != expected:
            return False
        expected *= size
    return True


class _BackwardReached(torch.autograd.Function):
    """Identity on a block's output whose backward tells the offload that the gradient has reached that block."""

    @staticmethod
    def forward(ctx, x, offload: ActivationOffload, index: int):
        ctx.offload, ctx.index = offload, index
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.offload.backward_reached(ctx.index)
        return grad, None, None

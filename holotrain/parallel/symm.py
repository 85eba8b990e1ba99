"""Symmetric memory for the fused tensor-parallel kernels: buffers that every rank of a group maps, made and checked
collectively. No Triton here (the CPU tests run the checks over gloo on shared-memory files).

A buffer starts with SYMM_HEADER bytes (the reduce-scatter's per-source counters, the self-test's head marker); the
kernels' data follows. Making one is collective: the ranks first agree on the size (agree_symm_size), then every
rank's markers must read back through every rank's mapping (symm_self_test). Either check fails on every rank
alike, so no rank goes on alone into an op whose symmetric-memory barrier would wait for a peer that never comes
(that barrier traps after its timeout, and a trapped kernel loses the CUDA context: "unspecified launch failure" at
the next launch).
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

SYMM_HEADER = 4096  # bytes at the start of a fused workspace: reduce-scatter counters, self-test marker
_MARKER = 2048  # byte offset of the self-test's head marker, inside the header


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _gather_ints(group: dist.ProcessGroup, values: list[int], device: torch.device) -> list[list[int]]:
    """Every rank's `values` (same length on every rank), in rank order. A collective, so also a barrier."""
    mine = torch.tensor(values, dtype=torch.int64, device=device)
    rows = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(rows, mine, group=group)
    return torch.stack(rows).cpu().tolist()


def agree_symm_size(group: dist.ProcessGroup, nbytes: int, device: torch.device, what: str) -> None:
    """Before a symmetric allocation: every rank asks for the same size, or every rank raises (a shape that
    differs between ranks would otherwise map buffers of different sizes, or hang one rank in the rendezvous)."""
    sizes = [row[0] for row in _gather_ints(group, [nbytes], device)]
    if len(set(sizes)) != 1:
        raise RuntimeError(f"fused TP: the ranks asked for {what} buffers of different sizes {sizes} (bytes, in rank "
                           "order): their operands' shapes differ (raised on every rank)")


def symm_self_test(group: dist.ProcessGroup, rank: int, world: int, local: torch.Tensor, views: list[torch.Tensor],
                   device: torch.device, what: str) -> None:
    """A new symmetric buffer's check: every rank's markers, at the head (inside the header) and at the tail of
    its buffer, must read back through every rank's mapping of that buffer (`views[r]`: rank r's buffer as this
    rank maps it; `local`: this rank's own). Collective; on a mismatch every rank raises the same error, naming
    what each rank read, so the ranks stay in step.

    The order matters: write own markers; barrier; read everyone's; exchange what was read (an all-gather,
    which also keeps any rank from clearing its markers while a peer still reads them); clear own markers;
    barrier (no peer kernel may store into the buffer before the clearing is done). Clearing right after
    reading, with no exchange in between, would let a rank that leaves the first barrier later than its peer
    find the peer's marker already cleared ("markers read [1, 0], expected [1, 2]"): it would raise alone and
    leave its peer waiting in the op's symmetric-memory barrier until that barrier's timeout traps the peer's
    CUDA context.
    """
    nbytes = local.numel()
    spots = [(_MARKER, 1)]  # (byte offset, marker base): rank r writes base + r there
    tail = (nbytes // 4 - 1) * 4
    if tail >= SYMM_HEADER:
        spots.append((tail, 1 << 16))
    local[:SYMM_HEADER].zero_()
    for off, base in spots:
        local[off:off + 4].view(torch.int32).fill_(base + rank)
    _sync(device)
    dist.barrier(group=group)  # every rank's markers are in place
    seen = torch.cat([v[off:off + 4] for v in views for off, _ in spots]).view(torch.int32).tolist()
    table = _gather_ints(group, seen, device)  # every rank has read: from here on markers may be cleared
    expected = [base + r for r in range(world) for _, base in spots]
    if any(row != expected for row in table):
        lines = "; ".join(f"rank {q} read {row}" + ("" if row == expected else " (WRONG)")
                          for q, row in enumerate(table))
        raise RuntimeError(
            f"fused TP: symmetric memory self-test failed ({what}, {nbytes} bytes; raised on every rank): markers "
            f"read through each rank's mappings, head{' and tail' if len(spots) > 1 else ''} per source rank: "
            f"{lines}; expected {expected}. A wrong value: that rank's view of a peer's buffer does not show what "
            "the peer wrote there.")
    for off, _ in spots:
        local[off:off + 4].zero_()
    _sync(device)
    dist.barrier(group=group)


class SymmBuffer:
    """One symmetric buffer of the group: the local tensor, its handle, and every rank's base address.

    Collective: every rank of the group must make the same SymmBuffer at the same point, with the same size."""

    def __init__(self, group: dist.ProcessGroup, nbytes: int, device: torch.device, what: str = "workspace"):
        import torch.distributed._symmetric_memory as symm_mem

        agree_symm_size(group, nbytes, device, what)  # never map buffers of different sizes
        self.nbytes = nbytes
        self.what = what
        self.tensor = symm_mem.empty(nbytes, dtype=torch.uint8, device=device)
        try:
            self.handle = symm_mem.rendezvous(self.tensor, group.group_name)
        except Exception as e:
            raise RuntimeError(
                f"fused TP: symmetric-memory rendezvous of {nbytes / 2**20:.0f} MiB failed on rank {dist.get_rank()} "
                f"(torch {torch.__version__}; TORCH_SYMM_MEM_DISABLE_MULTICAST="
                f"{os.environ.get('TORCH_SYMM_MEM_DISABLE_MULTICAST')}): {e}") from e
        rank, world = self.handle.rank, self.handle.world_size
        # get_buffer offsets count from the handle's buffer start; find where our tensor lies in it.
        own = self.handle.get_buffer(rank, (1,), torch.uint8)
        self.offset = self.tensor.data_ptr() - own.data_ptr()
        self.views = [self.handle.get_buffer(r, (nbytes,), torch.uint8, storage_offset=self.offset)
                      for r in range(world)]
        self.bases = torch.tensor([v.data_ptr() for v in self.views], dtype=torch.int64, device=device)
        symm_self_test(group, rank, world, self.tensor, self.views, device, f"{what}, offset {self.offset}")

    def describe(self) -> str:
        return f"{self.what} {self.nbytes / 2**20:.1f} MiB at offset {self.offset}"

    def view(self, rank: int, offset_bytes: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        n = 1
        for s in shape:
            n *= s
        size = torch.tensor([], dtype=dtype).element_size()
        return self.views[rank][offset_bytes:offset_bytes + n * size].view(dtype).view(shape)


def write_flag(flags: torch.Tensor, index: int) -> None:
    """flags[index] = 1 on the current stream, after everything before it on that stream (no SM needed)."""
    from torch._C._distributed_c10d import _SymmetricMemory

    try:
        _SymmetricMemory.stream_write_value32(flags.view(torch.uint32), index, 1)
    except (AttributeError, RuntimeError, TypeError):  # older torch: a one-element fill (a kernel)
        flags[index : index + 1].fill_(1)

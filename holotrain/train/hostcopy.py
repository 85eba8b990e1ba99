"""A training state copied into one flat host buffer: every tensor of the state (a DTensor's local shard) at its own
aligned offset. One allocation and one page-locking instead of hundreds, and a buffer that can be a file in
/dev/shm as easily as ordinary memory: the checkpoint writer's reused host copy and the in-memory snapshots'
files share this layout."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
from torch.distributed.tensor import DTensor

_ALIGN = 64  # bytes: every tensor's offset, so a view of any dtype is aligned
_PIECE = 32 << 20  # bytes per host-to-host copy task

Key = tuple  # a leaf's place in the nested state: dict keys and list indices


def leaves(obj, path: Key = ()) -> Iterator[tuple[Key, object]]:
    """Every leaf of a nested state (dicts, lists, tuples) with its path; tensors and DTensors are leaves."""
    if isinstance(obj, torch.Tensor):
        yield path, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from leaves(v, (*path, k))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from leaves(v, (*path, i))
    else:
        yield path, obj


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def replace_leaves(obj, new: dict, path: Key = ()):
    """`obj` with the leaves named in `new` (path -> value) replaced; tuples stay tuples."""
    if path in new:
        return new[path]
    if isinstance(obj, dict):
        return {k: replace_leaves(v, new, (*path, k)) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)) and not isinstance(obj, torch.Size):
        return type(obj)(replace_leaves(v, new, (*path, i)) for i, v in enumerate(obj))
    return obj


class FlatLayout:
    """Where each tensor of a state lives in a flat byte buffer: path -> (offset, shape, dtype)."""

    def __init__(self, entries: dict[Key, tuple[int, torch.Size, torch.dtype]], nbytes: int):
        self.entries, self.nbytes = entries, nbytes

    @classmethod
    def of(cls, state: dict, skip: frozenset = frozenset()) -> FlatLayout:
        """The layout of every tensor of `state` but those at the paths in `skip`."""
        entries, offset = {}, 0
        for path, leaf in leaves(state):
            if isinstance(leaf, torch.Tensor) and path not in skip:
                t = local(leaf)
                entries[path] = (offset, t.shape, t.dtype)
                offset += -(-t.numel() * t.element_size() // _ALIGN) * _ALIGN
        return cls(entries, offset)

    def view(self, buf: torch.Tensor, path: Key) -> torch.Tensor:
        offset, shape, dtype = self.entries[path]
        n = shape.numel() * dtype.itemsize
        return buf[offset:offset + n].view(dtype).view(shape)

    def describe(self) -> list:
        """JSON-able: [[path, dtype name, shape, offset], ...]."""
        return [[list(p), str(d).removeprefix("torch."), list(s), o] for p, (o, s, d) in self.entries.items()]

    @classmethod
    def from_description(cls, rows: list, nbytes: int) -> FlatLayout:
        return cls({tuple(p): (o, torch.Size(s), getattr(torch, d)) for p, d, s, o in rows}, nbytes)

    def __eq__(self, other) -> bool:
        return isinstance(other, FlatLayout) and self.entries == other.entries and self.nbytes == other.nbytes


def copy_into(state: dict, layout: FlatLayout, buf: torch.Tensor, non_blocking: bool,
              skip: frozenset = frozenset(), stream: torch.cuda.Stream | None = None) -> dict:
    """Copies every tensor of `state` that the layout places (but those at the paths in `skip`) into its place in
    `buf`: device tensors queued (when non_blocking the caller synchronizes; on `stream`, behind the work already
    queued on the current one), host tensors (the offload engine's masters and moments: most of the bytes, then) on
    several threads at once, as one thread is far from the host's memory bandwidth. Returns the state with those
    copies in place of the tensors (a DTensor's copy wrapped again on its mesh, as DCP saves host DTensors); other
    tensors stay as they are."""
    copies, host = {}, []
    if stream is not None:
        stream.wait_stream(torch.cuda.current_stream(stream.device))
    with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
        for path, leaf in leaves(state):
            if isinstance(leaf, torch.Tensor) and path in layout.entries and path not in skip:
                dst, src = layout.view(buf, path), local(leaf).detach()
                if src.device.type == "cpu" and src.is_contiguous():
                    host.append((dst.view(-1), src.view(-1)))
                else:
                    dst.copy_(src, non_blocking=non_blocking)
                    if stream is not None and src.is_cuda:
                        src.record_stream(stream)  # a temporary of the state dict is not reused while it is read
                if isinstance(leaf, DTensor):
                    dst = DTensor.from_local(dst, leaf.device_mesh, leaf.placements, run_check=False,
                                             shape=leaf.shape, stride=leaf.stride())
                copies[path] = dst
    _parallel_copy(host)
    return replace_leaves(state, copies)


class BehindTheStep:
    """Device-to-host copies of the training state that run while the next step computes (on a GPU): queued on a
    stream of their own behind the step just finished, they overlap the next step's forward and backward, which
    only read the weights and moments; the optimizer's next update waits for them on the device
    (StepOptimizer.update_after). The host waits only where the optimizer cannot defer its update (the offload
    engine, which writes device weights during the step), and the reader of the copy waits in `ready`."""

    def __init__(self, device: torch.device):
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.event: torch.cuda.Event | None = None

    def copy(self, state: dict, layout: FlatLayout, buf: torch.Tensor, optimizer,
             skip: frozenset = frozenset()) -> dict:
        """copy_into(state, ...) into `buf` (page-locked on a GPU); returns the copies, which are complete only
        after `ready()`."""
        copied = copy_into(state, layout, buf, non_blocking=self.stream is not None, skip=skip, stream=self.stream)
        if self.stream is not None:
            self.event = torch.cuda.Event()
            self.event.record(self.stream)
            if not optimizer.update_after(self.event):
                self.ready()
        return copied

    def ready(self) -> None:
        """Waits for the copies (on any thread). One copy at a time: the caller waits for the reader of the last
        one before it queues the next."""
        if self.event is not None:
            self.event.synchronize()
            self.event = None


def _parallel_copy(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """dst.copy_(src) for flat host tensors, in pieces of at most _PIECE bytes spread over a thread pool."""
    pieces = []
    for dst, src in pairs:
        step = max(1, _PIECE // src.element_size())
        pieces += [(dst[i:i + step], src[i:i + step]) for i in range(0, src.numel(), step)]
    if not pieces:
        return
    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        list(pool.map(_copy_bytes, pieces))


def _copy_bytes(pair: tuple[torch.Tensor, torch.Tensor]) -> None:
    """One piece, as bytes, on this thread alone (numpy releases the GIL): torch's copy_ would start a team of
    intra-op threads per piece, several pieces at once oversubscribing the cores the offload engine's step uses."""
    dst, src = pair
    np.copyto(dst.view(torch.uint8).numpy(), src.view(torch.uint8).numpy())


def copy_from(state: dict, layout: FlatLayout, buf: torch.Tensor) -> None:
    """The inverse of copy_into: every tensor of `state` (in place) from its place in `buf`."""
    for path, leaf in leaves(state):
        if isinstance(leaf, torch.Tensor):
            local(leaf).detach().copy_(layout.view(buf, path))

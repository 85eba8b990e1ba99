"""Host memory for the offload engine: the optimizer's state on huge pages, and exact-size page-locked buffers for
the copies to and from the GPU."""

from __future__ import annotations

import ctypes
import functools
import platform

import torch

_PAGE = 4096
_HUGE = 2 << 20
_MADV_HUGEPAGE = 14


@functools.cache
def _libc():
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


def advise_huge_pages(t: torch.Tensor) -> None:
    """Ask for 2 MiB pages for the whole 2 MiB-aligned interior of a fresh (untouched) host tensor. The optimizer
    streams tens of GB per step through masters and moments; with 4 KiB pages every 4 KiB is a TLB miss (THP in
    "madvise" mode, a common default, gives huge pages only where asked). A no-op where unsupported."""
    libc = _libc()
    nbytes = t.numel() * t.element_size()
    if libc is None or platform.system() != "Linux" or nbytes < 2 * _HUGE:
        return
    start = -(-t.data_ptr() // _HUGE) * _HUGE
    end = (t.data_ptr() + nbytes) // _HUGE * _HUGE
    if end > start:
        libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), ctypes.c_int(_MADV_HUGEPAGE))


def host_empty(numel: int, dtype: torch.dtype, zero: bool = False) -> torch.Tensor:
    """Host memory for the optimizer's state, on huge pages where the OS gives them (advised before first touch)."""
    t = torch.empty(numel, dtype=dtype)
    advise_huge_pages(t)
    return t.zero_() if zero else t


def pinned_empty(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """Page-locked host memory of exactly this size. torch's pinned allocator rounds each allocation up to a power
    of two (a 630 MB bucket would pin 1 GB); page-locking an ordinary allocation with cudaHostRegister does not.
    Falls back to torch's allocator if registering fails. Registered buffers are released with `unregister`."""
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    span = -(-nbytes // _PAGE) * _PAGE
    raw = torch.empty(span + _PAGE, dtype=torch.uint8)
    advise_huge_pages(raw)  # before cudaHostRegister faults the pages in
    start = -raw.data_ptr() % _PAGE  # page-aligned, so no page is shared with another registration
    region = raw[start:start + span]
    if not page_lock(region):
        return torch.empty(numel, dtype=dtype, pin_memory=True)
    tensor = region[:nbytes].view(dtype)
    tensor._holotrain_registered = True
    return tensor


def page_lock(region: torch.Tensor) -> bool:
    """Page-locks a page-aligned host tensor in place with cudaHostRegister (ordinary memory, or a shared file
    mapping); False where that is not possible. The caller undoes it with `unregister` before freeing."""
    nbytes = region.numel() * region.element_size()
    try:
        ok = nbytes > 0 and int(torch.cuda.cudart().cudaHostRegister(region.data_ptr(), nbytes, 0)) == 0
    except (AttributeError, RuntimeError, TypeError):
        return False
    if ok:
        region._holotrain_registered = True
    return ok


def unregister(tensor: torch.Tensor) -> None:
    """Undoes pinned_empty's cudaHostRegister (nothing for other tensors). No copy may still be using it."""
    if getattr(tensor, "_holotrain_registered", False):
        torch.cuda.cudart().cudaHostUnregister(tensor.data_ptr())
        tensor._holotrain_registered = False

"""Shared-memory blocks of a data plane (on Linux, files in /dev/shm), named so that leftovers can be found and removed
without touching anyone else's.

A block's name is `ht<run>_<pid>_<random>`: <run> a digest of the run directory, <pid> the plane process that owns
the block (its loaders name the chunks they hand it after it, too). A sweep removes the blocks of the run whose owner
is gone, and the sweeping process's own; the blocks of a live plane are never touched, even those of a second
process started on the same run directory by mistake. (Owners are told apart by pid, so processes that share
/dev/shm must share a pid namespace too: containers with a common /dev/shm need a common pid namespace.)

This module is imported by loader processes: it must not import torch.
"""

from __future__ import annotations

import hashlib
import os
import secrets
from multiprocessing import shared_memory
from pathlib import Path

SHM_DIR = Path("/dev/shm")


def shm_prefix(run_dir: Path) -> str:
    """The prefix of the shared-memory blocks of the run directory's data planes on this node."""
    return "ht" + hashlib.sha256(str(Path(run_dir).resolve()).encode()).hexdigest()[:10] + "_"


def owner_prefix(prefix: str, pid: int) -> str:
    """The prefix of the blocks owned by plane `pid` ("" when the run has no prefix: random names)."""
    return f"{prefix}{pid}_" if prefix else ""


def new_block(size: int, prefix: str = "") -> shared_memory.SharedMemory:
    """A new block named `prefix` + 8 random hex digits (an owner_prefix), or a random name without one. The names
    stay under 31 characters, the limit some systems put on them."""
    while True:
        try:
            return shared_memory.SharedMemory(create=True, size=size,
                                              name=f"{prefix}{secrets.token_hex(4)}" if prefix else None)
        except FileExistsError:  # one random name in four billion is taken: draw another
            continue


def unlink_block(name: str) -> None:
    """Frees a block whoever created it; a block already gone is fine."""
    try:
        shm = shared_memory.SharedMemory(name=name)
        shm.close()
        shm.unlink()
    except FileNotFoundError:
        pass


def sweep_blocks(prefix: str) -> int:
    """Removes the blocks named with the run's `prefix` whose owner is gone, or is this process; returns how many.
    Blocks in flight when a plane died, or when its training process was killed, are found this way and not leaked.
    A name without an owner pid (an older holotrain's) counts as gone."""
    if not prefix or not SHM_DIR.is_dir():
        return 0
    removed = 0
    for path in SHM_DIR.glob(f"{prefix}*"):
        owner = _owner(path.name[len(prefix):])
        if owner is not None and owner != os.getpid() and _alive(owner):
            continue
        try:
            path.unlink()
            removed += 1
        except FileNotFoundError:
            pass
    return removed


def _owner(rest: str) -> int | None:
    pid, sep, _ = rest.partition("_")
    return int(pid) if sep and pid.isdigit() else None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # signal 0: only asks whether the process exists
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, under another user
        return True
    return True

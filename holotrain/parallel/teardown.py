"""Ending a distributed process: every process group destroyed for real, its native threads joined, before the
interpreter shuts down.

`dist.destroy_process_group()` alone is not enough. It drops torch.distributed's own references, but a
DeviceMesh keeps the groups it was built from (`DeviceMesh._pg_registry`, seen in torch 2.13), and DTensor keeps
meshes in module-level caches (its redistribution and sharding-propagation caches hold DTensorSpecs). Any
process that made a DTensor (TP, FSDP2, `full_tensor()`) therefore still holds its gloo/NCCL backend after
destroying it: the backend's worker threads (gloo: `pt_gloo_runloop` x2 and `gloo_tcp_loop`) run on into
interpreter shutdown. A worker thread that drops the last reference to a finished collective's work frees that
work's tensors; a tensor with a Python object needs the GIL, and `take_gil` during `Py_FinalizeEx` ends the
thread with `pthread_exit`, whose forced unwind through the work's (noexcept) destructor calls std::terminate:
"terminate called without an active exception", SIGABRT, after the job has succeeded. Whether the thread is
that late is a matter of scheduling (rare unloaded, likelier under load), hence a flaky abort.

`destroy_process_groups()` destroys the groups, clears every mesh's group registry (the groups in it are
destroyed and unusable anyway), collects the cycles that may hold a group (a TP model's bound forwards hold its
TPComm), and reports any group still alive. Destroying the last reference runs the backend's destructor,
which waits for its queued work and joins its threads, while the interpreter is still whole.
"""

from __future__ import annotations

import gc
import os
import weakref

import torch.distributed as dist

# Names of the native threads a gloo process group runs (Linux thread names, /proc/self/task/*/comm).
GLOO_THREAD_NAMES = ("pt_gloo_runloop", "gloo_tcp_loop")


def _group_refs() -> list[tuple[str, weakref.ref]]:
    """(name, weak reference) of every process group torch.distributed knows now, the default one included
    (weak: this function must not keep any of them alive)."""
    if not (dist.is_available() and dist.is_initialized()):
        return []
    from torch.distributed import distributed_c10d as c10d

    groups = list(getattr(c10d._world, "pg_map", {}).keys())  # private, but the only list of all groups
    world = dist.group.WORLD
    if world is not None and world not in groups:
        groups.append(world)
    refs = []
    for group in groups:
        try:
            refs.append((group.group_name, weakref.ref(group)))
        except (TypeError, RuntimeError):  # a group type without weak references: not checked
            pass
    return refs


def _release_mesh_groups() -> int:
    """Empties the group registry of every DeviceMesh alive; returns how many meshes held groups."""
    try:
        from torch.distributed.device_mesh import DeviceMesh
    except ImportError:  # torch built without distributed
        return 0
    released = 0
    for obj in gc.get_objects():
        # By the type's MRO: DeviceMesh's metaclass has a Python __instancecheck__ that would touch every object.
        if DeviceMesh in type(obj).__mro__:
            registry = getattr(obj, "_pg_registry", None)
            if isinstance(registry, dict) and registry:
                registry.clear()
                released += 1
    return released


def destroy_process_groups() -> list[str]:
    """Destroys every process group of this process and drops the references torch keeps to them, so that
    their native objects (and threads) go now, not at interpreter shutdown. Call it once the process is done
    with torch.distributed, from a frame that no longer holds the model or its meshes (a TP model's TPComm
    holds its group). Safe to call when nothing is initialized, and twice.

    Returns the names of the groups still alive afterwards (something outside torch holds them): empty when
    every group is gone."""
    refs = _group_refs()
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    _release_mesh_groups()
    gc.collect()
    return [name for name, ref in refs if ref() is not None]


def native_threads() -> list[str]:
    """This process's native thread names (Linux; empty elsewhere)."""
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return []
    names = []
    for tid in tasks:
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                names.append(f.read().strip())
        except OSError:  # the thread ended meanwhile
            pass
    return names


def leftover_backend_threads() -> list[str]:
    """Native threads of a process-group backend still running (gloo's; empty when every group was destroyed)."""
    return [n for n in native_threads() if n.startswith(GLOO_THREAD_NAMES)]

"""Process-group setup from torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK)."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist

from holotrain.errors import ConfigError


@dataclass
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    local_world_size: int = 1  # ranks on this node (torchrun's LOCAL_WORLD_SIZE)

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed(device_choice: str) -> DistEnv:
    """Picks the device and, when launched by torchrun with WORLD_SIZE > 1, joins the process group
    (NCCL on GPU, gloo on CPU)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    use_cuda = device_choice == "cuda" or (device_choice == "auto" and torch.cuda.is_available())
    if use_cuda and not torch.cuda.is_available():
        raise ConfigError("job.device is 'cuda' but no CUDA device is available")
    if use_cuda:
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    if world > 1 and not dist.is_initialized():
        dist.init_process_group(backend="nccl" if use_cuda else "gloo", device_id=device if use_cuda else None,
                                **_restart_safe_store(rank, world))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    return DistEnv(rank=rank, world_size=world, local_rank=local_rank, device=device, local_world_size=local_world)


def _restart_safe_store(rank: int, world: int) -> dict:
    """init_process_group's store, safe across `torchrun --max-restarts`: keyword arguments ({}: torch's env://).

    torchrun's agent hosts the workers' TCPStore and keeps it (and every key in it) across restarts, and env:// adds
    no per-attempt prefix (pytorch issue #135712). A restarted rank could then read a key the previous attempt wrote,
    such as its peer's address in gloo's connectFullMesh (init_process_group, or a new_group such as the checkpoint
    writer's), before the restarted peer writes its own, and fail with "Connection refused"."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or "TORCHELASTIC_RESTART_COUNT" not in os.environ:
        return {}  # not the agent's store: every attempt has a store of its own
    if os.environ.get("GROUP_WORLD_SIZE", "1") != "1":
        # Each agent counts only the restarts its own workers' failures caused: the count cannot name the attempt.
        if rank == 0 and int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")) > 0:
            print("holotrain: warning: torchrun --max-restarts over several nodes keeps one store across restarts; "
                  "set TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 for torchrun on every node, so that a restarted rank "
                  "does not read the previous attempt's addresses", file=sys.stderr, flush=True)
        return {}
    # One agent: every worker has its TORCHELASTIC_RESTART_COUNT, so each attempt gets a key space of its own.
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False,
                          timeout=dist.constants.default_pg_timeout)
    prefix = f"holotrain/attempt-{os.environ['TORCHELASTIC_RESTART_COUNT']}"
    return {"store": dist.PrefixStore(prefix, store), "rank": rank, "world_size": world}


def device_mesh(env: DistEnv, tp: int = 1, cp: int = 1, pp: int = 1):
    """The device mesh of a layout on this launch (parallel/dims.py builds it); None on one process."""
    from holotrain.parallel.dims import ParallelDims

    return ParallelDims(world=env.world_size, pp=pp, cp=cp, tp=tp).build_mesh(env.device.type)


def fsdp_mesh(mesh):
    """The dimension FSDP2 shards over: "dp", or dp and cp flattened into one (the ranks of a context-parallel group
    hold the same weights and each computes gradients from its share of the sequence)."""
    if "cp" not in mesh.mesh_dim_names:
        return mesh["dp"]
    return mesh["dp", "cp"]._flatten("dp_cp")


def destroy_distributed() -> None:
    """Destroys every process group and joins the backends' threads (parallel/teardown.py): a group kept by a
    DeviceMesh past dist.destroy_process_group() can abort the process at interpreter shutdown."""
    from holotrain.parallel.teardown import destroy_process_groups

    left = destroy_process_groups()
    if left:
        print(f"holotrain: warning: process groups still alive after teardown: {', '.join(left)}", file=sys.stderr)

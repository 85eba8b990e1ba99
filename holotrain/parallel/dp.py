"""Data parallelism with FSDP2 (`fully_shard`): each block is one all-gather / reduce-scatter unit."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method
from torch.distributed.tensor import DTensor, Shard


def apply_fsdp(model: nn.Module, mesh: DeviceMesh, param_dtype: torch.dtype, reshard_after_forward: bool,
               expert_mesh: DeviceMesh | None = None) -> None:
    """Shards `model` in place over `mesh`. Parameters are gathered in `param_dtype`; gradients are
    reduced in fp32 so that bf16 training sums ranks' gradients without rounding each partial sum.

    `expert_mesh` (expert parallelism, parallel/ep.py): the ranks holding the same experts, over which each
    mixture-of-experts layer's expert weights (DTensors split by expert) are sharded, as a unit of their own."""
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    # Tensor-parallel parameters (DTensors on the "tp" mesh, parallel/tp.py) that TP already splits along dim 0
    # are split by FSDP along dim 1: plain Shard placements on the 2-D mesh, which every torch >= 2.11 can
    # distribute and initialize (FSDP's default would interleave the two splits of dim 0).
    kw = {"shard_placement_fn": _fsdp_dim} if any(isinstance(p, DTensor) for p in model.parameters()) else {}
    blocks = list(model.layers.values())
    experts = model.moe_modules() if expert_mesh is not None else {}
    for i, block in enumerate(blocks):
        # The last block's parameters are needed again at once by backward: keep them gathered.
        reshard = reshard_after_forward and i < len(blocks) - 1
        for key, moe in experts.items():
            if model.layers[key] is block:
                _shard_experts(moe, mesh, expert_mesh, mp, reshard)
        fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard, **kw)
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward, **kw)
    # Generation's forward (the eval's samples): the root's parameters (embedding, final norm, head) gathered for it too.
    register_fsdp_forward_method(model, "decode")


def _shard_experts(moe: nn.Module, mesh: DeviceMesh, expert_mesh: DeviceMesh, mp: MixedPrecisionPolicy,
                   reshard: bool) -> None:
    """A mixture-of-experts layer under expert parallelism: its router (and shared experts) over every data-parallel
    rank, its expert weights over the ranks holding the same experts (the exchange, parallel/ep.py, scales their
    gradients so that this mesh's average is the whole data-parallel mean)."""
    for child in moe.children():
        fully_shard(child, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard)
    fully_shard(moe, mesh=expert_mesh, mp_policy=mp, reshard_after_forward=reshard, shard_placement_fn=_fsdp_dim)


def _fsdp_dim(param: nn.Parameter) -> Shard | None:
    if isinstance(param, DTensor) and param.ndim >= 2 and any(
        isinstance(p, Shard) and p.dim == 0 for p in param.placements
    ):
        return Shard(1)
    return None  # FSDP's default, dim 0

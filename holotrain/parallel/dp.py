"""Data parallelism with FSDP2 (`fully_shard`): each block is one all-gather / reduce-scatter unit."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard


def apply_fsdp(model: nn.Module, mesh: DeviceMesh, param_dtype: torch.dtype, reshard_after_forward: bool) -> None:
    """Shards `model` in place over `mesh`. Parameters are gathered in `param_dtype`; gradients are
    reduced in fp32 so that bf16 training sums ranks' gradients without rounding each partial sum."""
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    # Tensor-parallel parameters (DTensors on the "tp" mesh, parallel/tp.py) that TP already splits along dim 0
    # are split by FSDP along dim 1: plain Shard placements on the 2-D mesh, which every torch >= 2.11 can
    # distribute and initialize (FSDP's default would interleave the two splits of dim 0).
    kw = {"shard_placement_fn": _fsdp_dim} if any(isinstance(p, DTensor) for p in model.parameters()) else {}
    blocks = list(model.layers.values())
    for i, block in enumerate(blocks):
        # The last block's parameters are needed again at once by backward: keep them gathered.
        fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward and i < len(blocks) - 1,
                    **kw)
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward, **kw)


def _fsdp_dim(param: nn.Parameter) -> Shard | None:
    if isinstance(param, DTensor) and param.ndim >= 2 and any(
        isinstance(p, Shard) and p.dim == 0 for p in param.placements
    ):
        return Shard(1)
    return None  # FSDP's default, dim 0

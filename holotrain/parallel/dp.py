"""Data parallelism with FSDP2 (`fully_shard`): each block is one all-gather / reduce-scatter unit."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard


def apply_fsdp(model: nn.Module, mesh: DeviceMesh, param_dtype: torch.dtype, reshard_after_forward: bool) -> None:
    """Shards `model` in place over `mesh`. Parameters are gathered in `param_dtype`; gradients are
    reduced in fp32 so that bf16 training sums ranks' gradients without rounding each partial sum."""
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    blocks = list(model.layers.values())
    for i, block in enumerate(blocks):
        # The last block's parameters are needed again at once by backward: keep them gathered.
        fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward and i < len(blocks) - 1)
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward)

"""Parallelism: the layout (dims.py), FSDP2, tensor, context and pipeline parallelism. Names load on first use, so
that a process that needs only the layout (the data plane: parallel/dims.py) does not import torch.distributed."""

__all__ = ["apply_fsdp", "apply_tp", "DistEnv", "device_mesh", "init_distributed"]

_LAZY = {
    "apply_fsdp": "holotrain.parallel.dp",
    "apply_tp": "holotrain.parallel.tp",
    "DistEnv": "holotrain.parallel.launch",
    "device_mesh": "holotrain.parallel.launch",
    "init_distributed": "holotrain.parallel.launch",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'holotrain.parallel' has no attribute {name!r}")

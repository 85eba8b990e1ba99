from holotrain.parallel.dp import apply_fsdp
from holotrain.parallel.launch import DistEnv, init_distributed

__all__ = ["apply_fsdp", "DistEnv", "init_distributed"]

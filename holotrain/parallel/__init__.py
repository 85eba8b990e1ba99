from holotrain.parallel.dp import apply_fsdp
from holotrain.parallel.launch import DistEnv, device_mesh, init_distributed
from holotrain.parallel.tp import apply_tp

__all__ = ["apply_fsdp", "apply_tp", "DistEnv", "device_mesh", "init_distributed"]

"""Whether two ranks can share one GPU under NCCL: the question behind measuring peer replicas of RAM snapshots
with two local ranks on a one-GPU machine. Each rank joins an NCCL group on cuda:0 and all-reduces four ones.
Usage: torchrun --standalone --nproc_per_node=2 bench/nccl_two_ranks_one_gpu.py"""

import os

import torch
import torch.distributed as dist

torch.cuda.set_device(0)
try:
    dist.init_process_group("nccl", device_id=torch.device("cuda", 0))
    x = torch.ones(4, device="cuda")
    dist.all_reduce(x)
    torch.cuda.synchronize()
    print(f"rank {dist.get_rank()}: all_reduce on one GPU gave {x.tolist()}", flush=True)
except Exception as e:  # what NCCL answers is the result
    print(f"rank {os.environ['RANK']}: {type(e).__name__}: {str(e)[:400]}", flush=True)

"""Run by tests/test_hf_import.py under torchrun (2 gloo ranks): each Hugging Face directory given is imported
unsharded, sharded by FSDP2 over both ranks, and split by tensor parallelism over both ranks; the three give the
same logits. Prints 'HF IMPORT WORKER OK'."""

import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from holotrain.config import load_config, resolve  # noqa: E402
from holotrain.parallel import DistEnv  # noqa: E402
from holotrain.parallel.teardown import destroy_process_groups  # noqa: E402
from holotrain.train.trainer import build_model  # noqa: E402

VOCAB = 320


def logits(directory: str, env: DistEnv, tp: int) -> torch.Tensor:
    cfg = resolve(load_config(None, [f"--model.init_from={directory}", "--data.seq_len=32", "--job.device=cpu",
                                     f"--parallel.tp={tp}"]), tokenizer_vocab=VOCAB)
    model = build_model(cfg, env, torch.float32).eval()
    tokens = torch.randint(0, VOCAB, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = model(tokens)
    return out.full_tensor() if hasattr(out, "full_tensor") else out


def main():
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    sharded = DistEnv(rank=rank, world_size=world, local_rank=rank, device=torch.device("cpu"), local_world_size=world)
    alone = DistEnv(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    for directory in sys.argv[1:]:
        want = logits(directory, alone, tp=1)
        for name, tp in (("fsdp dp=2", 1), ("tp=2", 2)):
            got = logits(directory, sharded, tp)
            err = (got - want).abs().max().item()
            print(f"rank {rank} {Path(directory).name} {name}: max abs diff {err:.2e}", flush=True)
            assert err <= 1e-5, (directory, name, err)
    dist.barrier()
    if rank == 0:
        print("HF IMPORT WORKER OK", flush=True)
    destroy_process_groups()


if __name__ == "__main__":
    main()

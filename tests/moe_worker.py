"""Run by tests/test_moe.py under torchrun (2 gloo ranks): the mixture-of-experts families against one process.
Hugging Face imports (a checkpoint in several files, experts of one block split across them) sharded by FSDP2 give
one rank's logits; a model under FSDP2 (dp=2, with the auxiliary losses on), context parallelism (cp=2) and pipeline
parallelism (pp=2) gives one process's losses over tests/families_worker.py's steps of packed documents. Prints
'MOE WORKER OK'."""

import dataclasses
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from holotrain.config import load_config, resolve  # noqa: E402
from holotrain.model import ModelArgs, build  # noqa: E402
from holotrain.parallel import DistEnv  # noqa: E402
from holotrain.parallel.teardown import destroy_process_groups  # noqa: E402
from holotrain.train.trainer import build_model  # noqa: E402
from tests.families_worker import SHAPE, STEPS, layout_losses, reference  # noqa: E402
from tests.hf_models import VOCAB  # noqa: E402
from tests.test_moe import make_hf_moe  # noqa: E402

MOE = dict(n_experts=4, n_active_experts=2, moe_ffn_dim=48, norm_topk_prob=True)
MODELS = {
    "qwen3_moe": ModelArgs(family="qwen3_moe", qk_norm=True, dense_layers=(2,), **{**SHAPE, "head_dim": 16}, **MOE),
    "mixtral": ModelArgs(family="mixtral", sliding_window=8, **{**SHAPE, "ffn_dim": 48}, **MOE),
}


def logits(directory: str, env: DistEnv) -> torch.Tensor:
    cfg = resolve(load_config(None, [f"--model.init_from={directory}", "--data.seq_len=32", "--job.device=cpu"]),
                  tokenizer_vocab=VOCAB)
    model = build_model(cfg, env, torch.float32).eval()
    tokens = torch.randint(0, VOCAB, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return model(tokens)


def main():
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    env = DistEnv(rank=rank, world_size=world, local_rank=rank, device=torch.device("cpu"), local_world_size=world)
    alone = DistEnv(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    with tempfile.TemporaryDirectory() as tmp:
        where = [tmp]
        dist.broadcast_object_list(where, src=0)
        for kind in ("qwen3_moe", "mixtral"):
            directory = Path(where[0]) / kind
            if rank == 0:
                make_hf_moe(directory, kind, shard=True)
                assert len(list(directory.glob("*.safetensors"))) > 2
            dist.barrier()
            err = (logits(str(directory), env) - logits(str(directory), alone)).abs().max().item()
            print(f"rank {rank} {kind} import under fsdp dp=2: max abs diff {err:.2e}", flush=True)
            assert err <= 1e-5, (kind, err)
        dist.barrier()
    for family, args in MODELS.items():
        torch.manual_seed(0)
        for label, layout, coefs in (("fsdp dp=2, aux losses", dict(), (0.05, 0.01)), ("cp=2", dict(cp=2), (0, 0)),
                                     ("pp=2", dict(pp=2), (0, 0))):
            base = build(dataclasses.replace(args, moe_aux_loss_coef=coefs[0], router_z_loss_coef=coefs[1]))
            base.init_weights(seed=7)
            with torch.no_grad():  # routers with clear choices: no near-tie that rounding could turn
                for moe in base.moe_modules().values():
                    moe.router.weight.mul_(20)
            got, dp, d = layout_losses(base, env, **layout)
            want = [r[d] for r in reference(base, dp)]
            worst = max(abs(a - b) for a, b in zip(got, want))
            if worst > 1e-5:
                raise AssertionError(f"rank {rank} {family} {label}: losses {got}, one process {want}")
            if rank == 0:
                print(f"{family} {label}: {STEPS} losses equal one process's (max difference {worst:.1e})", flush=True)
    dist.barrier()
    if rank == 0:
        print("MOE WORKER OK", flush=True)
    destroy_process_groups()


if __name__ == "__main__":
    main()

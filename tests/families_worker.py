"""Run by tests/test_families.py under torchrun (2 gloo ranks): every model family under FSDP2 (dp=2), tensor
parallelism (tp=2), context parallelism (cp=2) and pipeline parallelism (pp=2, 1F1B) against one process, in fp32.

Every rank computes the reference itself: the whole model trained by SGD for STEPS steps, each replica's batch in
N_MICRO micro-batches (holotrain's gradient accumulation: each micro-batch's mean loss over the count), the replicas'
gradients averaged. Each layout trains a copy through holotrain's levers on the same packed documents (some targets
masked; every other step single sequences) and must give the same loss at every step (within 1e-5). Prints
'FAMILIES WORKER OK' when all pass."""

import copy
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from holotrain.config import ParallelConfig  # noqa: E402
from holotrain.model import ModelArgs, build  # noqa: E402
from holotrain.parallel.cp import apply_cp  # noqa: E402
from holotrain.parallel.dp import apply_fsdp  # noqa: E402
from holotrain.parallel.launch import DistEnv, device_mesh, fsdp_mesh  # noqa: E402
from holotrain.parallel.pp import Pipeline, rank_stages, stage_bounds, stage_model, unit_costs  # noqa: E402
from holotrain.parallel.teardown import destroy_process_groups  # noqa: E402
from holotrain.parallel.tp import apply_tp  # noqa: E402

T, ROWS, N_MICRO, STEPS = 32, 2, 2, 5
SHAPE = dict(dim=64, n_layers=4, n_heads=8, n_kv_heads=4, ffn_dim=96, vocab_size=128, max_seq_len=T)
FAMILIES = {
    "llama": ModelArgs(family="llama", **SHAPE),
    "qwen2": ModelArgs(family="qwen2", qkv_bias=True, **SHAPE),
    "qwen3": ModelArgs(family="qwen3", qk_norm=True, **{**SHAPE, "n_heads": 4, "n_kv_heads": 2}, head_dim=32),
    "mistral": ModelArgs(family="mistral", sliding_window=8, **SHAPE),
}
LAYOUTS = {"fsdp dp=2": dict(), "tp=2": dict(tp=2), "cp=2": dict(cp=2), "pp=2": dict(pp=2)}


def batch(step: int, replica: int, vocab: int):
    g = torch.Generator().manual_seed(1000 * step + replica)
    tokens = torch.randint(0, vocab, (ROWS * N_MICRO, T), generator=g)
    targets = torch.randint(0, vocab, (ROWS * N_MICRO, T), generator=g)
    targets[0, 3:9] = -100  # a masked span (chat: a user turn)
    targets[:, -2:] = -100  # padding at the end of each row
    if step % 2:
        return tokens, targets, None
    doc_ids = torch.zeros_like(tokens)
    for r in range(0, doc_ids.shape[0], 2):
        for c in sorted(torch.randperm(T - 1, generator=g)[:3].add(1).tolist()):
            doc_ids[r, c:] += 1
    return tokens, targets, doc_ids


def micro_batches(tokens, targets, doc_ids):
    docs = [None] * N_MICRO if doc_ids is None else doc_ids.chunk(N_MICRO)
    return list(zip(tokens.chunk(N_MICRO), targets.chunk(N_MICRO), docs))


def reference(base, dp: int) -> list[list[float]]:
    """Per step, per replica: the step's loss (the mean of its micro-batches' mean losses)."""
    model = copy.deepcopy(base)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    losses = []
    for step in range(STEPS):
        per_replica = []
        for r in range(dp):
            total = 0.0
            for tok, tgt, doc in micro_batches(*batch(step, r, base.args.vocab_size)):
                loss = model(tok, tgt, doc) / N_MICRO
                (loss / dp).backward()
                total += loss.item()
            per_replica.append(total)
        losses.append(per_replica)
        opt.step()
        opt.zero_grad()
    return losses


def layout_losses(base, env: DistEnv, tp: int = 1, cp: int = 1, pp: int = 1) -> tuple[list[float], int, int]:
    mesh = device_mesh(env, tp=tp, cp=cp, pp=pp)
    dp, d = mesh["dp"].size(), mesh["dp"].get_local_rank()
    if pp > 1:
        ids = rank_stages(mesh["pp"].get_local_rank(), pp, "1f1b")
        bounds = stage_bounds(unit_costs(base.args, T), pp)
        models = [stage_model(copy.deepcopy(base), *bounds[s]) for s in ids]
        pipe = Pipeline(models, ids, pp, mesh["pp"], "1f1b", N_MICRO, torch.device("cpu"))
    else:
        model = copy.deepcopy(base)
        if tp > 1:
            apply_tp(model, mesh["tp"], ParallelConfig())
        if cp > 1:
            apply_cp(model, mesh["cp"], "auto")
        if dp * cp > 1:
            apply_fsdp(model, fsdp_mesh(mesh), torch.float32, reshard_after_forward=True)
        models = [model]
    opt = torch.optim.SGD([p for m in models for p in m.parameters()], lr=0.05)
    losses = []
    for step in range(STEPS):
        tokens, targets, doc_ids = batch(step, d, base.args.vocab_size)
        if pp > 1:
            loss = pipe.step(tokens, targets, doc_ids=doc_ids)
        else:
            loss = 0.0
            for tok, tgt, doc in micro_batches(tokens, targets, doc_ids):
                part = models[0](tok, tgt, doc) / N_MICRO
                part.backward()
                loss = loss + part.detach()
            if cp > 1:  # each rank's loss is its weighted share of the sequence's: their mean is the sequence's
                dist.all_reduce(loss, op=dist.ReduceOp.AVG, group=mesh["cp"].get_group())
        losses.append(float(loss))
        opt.step()
        opt.zero_grad()
    return losses, dp, d


def main():
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    env = DistEnv(rank=rank, world_size=world, local_rank=rank, device=torch.device("cpu"), local_world_size=world)
    for family, args in FAMILIES.items():
        torch.manual_seed(0)
        base = build(args)
        base.init_weights(seed=7)
        refs = {dp: reference(base, dp) for dp in (1, 2)}
        for label, sizes in LAYOUTS.items():
            got, dp, d = layout_losses(base, env, **sizes)
            want = [refs[dp][s][d] for s in range(STEPS)]
            worst = max(abs(a - b) for a, b in zip(got, want))
            if worst > 1e-5:
                raise AssertionError(f"rank {rank} {family} {label}: losses {got}, one process {want}")
            if rank == 0:
                print(f"{family} {label}: {STEPS} losses equal one process's (max difference {worst:.1e})", flush=True)
    destroy_process_groups()
    if rank == 0:
        print("FAMILIES WORKER OK", flush=True)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()

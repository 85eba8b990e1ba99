"""Run by tests/test_pp.py under torchrun (4 gloo ranks): pipeline parallelism against one process, in fp32.

Every rank computes the reference itself, once per data-parallel layout: the whole model trained for some steps
by SGD, each replica's batch taken in n_microbatches micro-batches with holotrain's gradient accumulation (each
micro-batch's mean loss over the count), the gradients averaged over replicas, clipped to a norm on the last step.
On the same 4 ranks each layout (pp=4, pp=2 x dp=2 with FSDP2 on every stage, pp=2 x tp=2 with every stage split
by tensor parallelism, pp=2 x cp=2 with every sequence split by ring context parallelism) cuts a copy of the model into cost-balanced stages and trains it with each schedule on the same packed documents (some targets masked; every
third step single sequences, without doc_ids), comparing the loss and the whole model's gradient norm at every
step, every parameter's gradient at the first, the clipping at the last, and the weights after it. Prints
'PP WORKER OK' when all pass."""

import copy
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from holotrain.config import ParallelConfig  # noqa: E402
from holotrain.model import Decoder, ModelArgs, build
from holotrain.parallel.cp import apply_cp  # noqa: E402
from holotrain.parallel.dp import apply_fsdp  # noqa: E402
from holotrain.parallel.launch import DistEnv, device_mesh, fsdp_mesh  # noqa: E402
from holotrain.parallel.pp import (SCHEDULES, Pipeline, clip_grad_norm, grad_norm, rank_stages,  # noqa: E402
                                   stage_bounds, stage_model, stages_per_rank, unit_costs)
from holotrain.parallel.teardown import destroy_process_groups  # noqa: E402
from holotrain.parallel.tp import apply_tp  # noqa: E402

T, MICRO = 32, 1  # tokens per row, rows per micro-batch
MAX_NORM = 0.5  # below the gradients' norm: the clipping on the last step is active

# (pp, tp, cp) -> optimizer steps: 8 at pp=4 and at pp=2 x dp=2 (on 4 ranks, dp is what pp, tp and cp leave), 5 for
# the layouts that split each stage further (pp=2 x tp=2, pp=2 x cp=2).
STEPS = {(4, 1, 1): 8, (2, 1, 1): 8, (2, 2, 1): 5, (2, 1, 2): 5}
N_MICRO = 4  # micro-batches per step


def batch(rows: int, vocab: int, seed: int):
    """Packed rows: documents of ragged lengths (every other row a single document), padding and a masked span."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (rows, T), generator=g)
    targets = torch.randint(0, vocab, (rows, T), generator=g)
    doc_ids = torch.zeros(rows, T, dtype=torch.long)
    for r in range(0, rows, 2):
        for c in sorted(torch.randperm(T - 1, generator=g)[:3].add(1).tolist()):
            doc_ids[r, c:] += 1
    targets[0, 3:9] = -100  # a masked span (chat: a user turn)
    targets[:, -2:] = -100  # padding at the end of each row
    return tokens, targets, doc_ids


def step_batches(step: int, dp: int, n_micro: int, vocab: int) -> list:
    """Each replica's batch of the step; every third step's rows are single sequences (doc_ids None: the plain
    causal path on every stage)."""
    batches = [batch(n_micro * MICRO, vocab, seed=1000 * step + r) for r in range(dp)]
    return [(tokens, targets, None if step % 3 == 1 else doc_ids) for tokens, targets, doc_ids in batches]


def optimizer(params):
    # SGD with momentum at a small rate: rounding differences (FSDP2's reduction sums the replicas in its own order)
    # stay as small as they start. At lr=0.1 the run is chaotic enough that they pass 1e-5 of the gradient norm by
    # step 9 at pp=2 x dp=2. AdamW divides each gradient by its own magnitude, so where one is near zero its rounding
    # decides a whole step of that weight.
    return torch.optim.SGD(params, lr=0.02, momentum=0.9)


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def close(what: str, got: torch.Tensor, want: torch.Tensor, tol: float) -> None:
    err = (got.double() - want.double()).abs().max().item()
    scale = want.double().abs().max().item() + 1e-12
    if err > tol * scale:
        raise AssertionError(f"rank {dist.get_rank()} {what}: max error {err:.3e} (scale {scale:.3e})")


@dataclass
class Reference:
    losses: list  # per step, per replica: the mean over micro-batches of their mean losses
    norms: list  # per step: the whole model's gradient norm before clipping
    first_grads: dict  # the first step's gradients
    weights: dict  # after the last step


def reference(base: Decoder, dp: int, n_micro: int, steps: int) -> Reference:
    """One process: holotrain's gradient accumulation over n_micro micro-batches, the replicas' mean."""
    model = copy.deepcopy(base)
    opt = optimizer(model.parameters())
    losses, norms, first = [], [], {}
    for step in range(steps):
        replica_losses = []
        for tokens, targets, doc_ids in step_batches(step, dp, n_micro, base.args.vocab_size):
            total = 0.0
            docs = [None] * n_micro if doc_ids is None else doc_ids.chunk(n_micro)
            for tok, tgt, doc in zip(tokens.chunk(n_micro), targets.chunk(n_micro), docs):
                loss = model(tok, tgt, doc) / n_micro
                (loss / dp).backward()  # FSDP2 averages the replicas' gradients
                total += loss.item()
            replica_losses.append(total)
        losses.append(replica_losses)
        norms.append(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]))
        if step == 0:
            first = {n: p.grad.clone() for n, p in model.named_parameters()}
        if step == steps - 1:
            assert norms[-1] > MAX_NORM, norms[-1]
            torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        opt.step()
        opt.zero_grad()
    return Reference(losses, norms, first, {n: p.detach().clone() for n, p in model.named_parameters()})


def check_layout(base: Decoder, mesh, schedule: str, steps: int, ref: Reference) -> str:
    args = base.args
    pp, dp = mesh["pp"].size(), mesh["dp"].size()
    tp, cp = (mesh[k].size() if k in mesh.mesh_dim_names else 1 for k in ("tp", "cp"))
    d = mesh["dp"].get_local_rank()  # this rank's replica: its rows
    n_micro = N_MICRO
    label = f"pp={pp} dp={dp} tp={tp} cp={cp} {schedule}"

    n_stages = pp * stages_per_rank(schedule)
    bounds = stage_bounds(unit_costs(args, T), n_stages)
    stage_ids = rank_stages(mesh["pp"].get_local_rank(), pp, schedule)
    models = [stage_model(copy.deepcopy(base), *bounds[s]) for s in stage_ids]
    if tp > 1:
        for m in models:
            apply_tp(m, mesh["tp"], ParallelConfig())
    if cp > 1:
        for m in models:
            apply_cp(m, mesh["cp"], "ring")
    if dp * cp > 1:  # FSDP2 averages the gradients over the replicas and a sequence's context-parallel ranks
        for m in models:
            apply_fsdp(m, fsdp_mesh(mesh), torch.float32, reshard_after_forward=True)
    pipe = Pipeline(models, stage_ids, n_stages, mesh["pp"], schedule, n_micro, torch.device("cpu"))
    opt = optimizer([p for m in models for p in m.parameters()])

    for step in range(steps):
        tokens, targets, doc_ids = step_batches(step, dp, n_micro, args.vocab_size)[d]
        loss = pipe.step(tokens, targets, doc_ids=doc_ids).item()
        if abs(loss - ref.losses[step][d]) > 1e-5:
            raise AssertionError(f"rank {dist.get_rank()} {label} step {step}: loss {loss:.7f}, "
                                 f"one process {ref.losses[step][d]:.7f}")
        close(f"{label} step {step} grad norm", grad_norm(models, mesh["pp"]), ref.norms[step], 1e-5)
        if step == 0:
            for m in models:
                for name, p in m.named_parameters():
                    close(f"{label} grad {name}", full(p.grad), ref.first_grads[name], 2e-5)
        if step == steps - 1:
            # Only here: the norm summed stage by stage rounds differently from one process's, and the steps after
            # it would carry that rounding.
            close(f"{label} clipping norm", clip_grad_norm(models, mesh["pp"], MAX_NORM), ref.norms[step], 1e-5)
            close(f"{label} norm after clipping", grad_norm(models, mesh["pp"]), torch.tensor(MAX_NORM), 1e-5)
        opt.step()
        opt.zero_grad()

    held = 0
    for m in models:
        for name, p in m.named_parameters():
            close(f"{label} weight {name} after {steps} steps", full(p.detach()), ref.weights[name], 2e-5)
            held += 1
    held = torch.tensor([held])
    dist.all_reduce(held)
    assert held.item() == len(ref.weights) * dp * tp * cp, (held.item(), len(ref.weights))  # each on one stage
    return f"{label}: stages {bounds}, {steps} steps: losses, gradients and weights equal one process's"


def main():
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    env = DistEnv(rank=rank, world_size=world, local_rank=rank, device=torch.device("cpu"), local_world_size=world)
    args = ModelArgs(dim=64, n_layers=8, n_heads=8, n_kv_heads=4, ffn_dim=96, vocab_size=256, max_seq_len=T)
    torch.manual_seed(0)
    base = build(args)
    base.init_weights(seed=7)
    for (pp, tp, cp), steps in STEPS.items():
        mesh = device_mesh(env, tp=tp, cp=cp, pp=pp)
        ref = reference(base, mesh["dp"].size(), N_MICRO, steps)
        for schedule in SCHEDULES:
            line = check_layout(base, mesh, schedule, steps, ref)
            if rank == 0:
                print(line, flush=True)
    destroy_process_groups()
    if rank == 0:
        print("PP WORKER OK", flush=True)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()

"""Run by tests/test_ep.py under torchrun (gloo), 2 or 4 ranks. First expert parallelism's dispatch and combine
against one process's computation: each rank routes its own tokens (uneven counts, some experts empty) to E experts
of which it holds E / world; outputs and the gradients of the tokens and of its experts' weights must equal the same
computation done with every expert on every rank.

Then a Qwen3-MoE model through the parallel lever (experts split by parallel.ep, FSDP2 over the rest) and the
trainer's AdamW with clipping, over 8 steps of packed documents (tests/families_worker.py's batches), against one
process training on every replica's rows: ep=2 on 2 ranks; ep=4 and dp=2 x ep=2 on 4, with the first step's
gradients compared too. On 4 ranks a checkpoint written at step 4 by dp=2 x ep=2 resumes at ep=4 and at ep=1."""

import copy
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from holotrain.model import ModelArgs, build  # noqa: E402
from holotrain.optim import AdamWHyper, DeviceAdamW  # noqa: E402
from holotrain.parallel.config import ParallelConfig  # noqa: E402
from holotrain.parallel.ep import combine, dispatch  # noqa: E402
from holotrain.parallel.launch import DistEnv  # noqa: E402
from holotrain.parallel.lever import Parallel  # noqa: E402
from holotrain.parallel.teardown import destroy_process_groups  # noqa: E402
from holotrain.train.checkpoint import load_checkpoint, save_checkpoint  # noqa: E402
from tests.families_worker import SHAPE, batch, micro_batches  # noqa: E402

STEPS, SAVED_AT, LR = 8, 4, 1e-3
# eps 1e-6: with 1e-8, AdamW's division by the root of tiny second moments lifts the rounding of a different
# reduction order to 4e-5 in the loss by step 20 under plain FSDP2 at dp=4 as much as under expert parallelism.
HYPER = AdamWHyper(betas=(0.9, 0.95), eps=1e-6, weight_decay=0.1, clip=1.0)
MODEL = ModelArgs(family="qwen3_moe", qk_norm=True, **{**SHAPE, "head_dim": 16}, n_experts=8, n_active_experts=2,
                  moe_ffn_dim=48, norm_topk_prob=True, dense_layers=(2,), moe_aux_loss_coef=0.01,
                  router_z_loss_coef=0.001)


def exchange_equals_one_process(rank: int, world: int) -> None:
    E, D = 8, 16
    torch.manual_seed(0)
    weights = torch.randn(E, D, D, dtype=torch.float64)  # the same on every rank
    local = E // world
    mine = weights[rank * local:(rank + 1) * local].clone().requires_grad_(True)

    g = torch.Generator().manual_seed(100 + rank)
    n = 5 + 7 * rank
    experts = torch.randint(0, E, (n,), generator=g)
    experts[experts == 3] = 2  # expert 3 gets no token from any rank
    experts, _ = experts.sort()
    x = torch.randn(n, D, dtype=torch.float64, generator=g, requires_grad=True)
    counts = torch.bincount(experts, minlength=E)

    rows, local_counts, how = dispatch(x, counts, None)
    parts = [r @ w for r, w in zip(rows.split(local_counts.tolist()), mine)]
    y = combine(torch.cat(parts), how, None)
    upstream = torch.randn(n, D, dtype=torch.float64, generator=g)
    (y * upstream).sum().backward()

    full = weights.clone().requires_grad_(True)
    x_ref = x.detach().clone().requires_grad_(True)
    y_ref = torch.einsum("nd,nde->ne", x_ref, full[experts])
    (y_ref * upstream).sum().backward()
    dist.all_reduce(full.grad)  # every rank's tokens' contribution to each expert
    assert torch.allclose(y, y_ref, atol=1e-12), (y - y_ref).abs().max()
    assert torch.allclose(x.grad, x_ref.grad, atol=1e-12)
    assert torch.allclose(mine.grad, full.grad[rank * local:(rank + 1) * local], atol=1e-12)
    if rank == 0:
        print(f"exchange at world={world} equals one process", flush=True)


def reference(base, dp: int) -> tuple[list[list[float]], dict]:
    """One process: per step, per replica, the step's loss (the mean of its micro-batches'); and the first step's
    gradients by parameter name."""
    model = copy.deepcopy(base)
    opt = DeviceAdamW(model, HYPER, LR, sharded=False)
    losses, grads = [], {}
    for step in range(STEPS):
        opt.begin(LR, 2)
        per_replica = []
        for r in range(dp):
            total = 0.0
            for tok, tgt, doc in micro_batches(*batch(step, r, base.args.vocab_size)):
                loss = model(tok, tgt, doc) / 2
                (loss / dp).backward()
                total += loss.item()
            per_replica.append(total)
        if step == 0:
            grads = {name: p.grad.clone() for name, p in model.named_parameters()}
        losses.append(per_replica)
        opt.finish()
    return losses, grads


def layout(base, env: DistEnv, ep: int):
    """The model under the parallel lever with parallel.ep = ep, and the trainer's AdamW over it."""
    par = Parallel(ParallelConfig(ep=ep), env)
    model = copy.deepcopy(base)
    par.apply_ep(model)
    par.apply_fsdp(model, torch.float32)
    return par, model, DeviceAdamW(model, HYPER, LR, sharded=True)


def train(par, model, opt, steps: range, grads: dict | None = None) -> list[float]:
    """This rank's losses over `steps`; with `grads` (the reference's first step), the full gradients compared."""
    d = par.dims.dp_index(dist.get_rank())
    losses = []
    for step in steps:
        opt.begin(LR, 2)
        loss = 0.0
        for tok, tgt, doc in micro_batches(*batch(step, d, base_vocab(model))):
            part = model(tok, tgt, doc) / 2
            part.backward()
            loss += part.item()
        if grads is not None and step == 0:
            for name, p in model.named_parameters():
                got = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
                assert torch.allclose(got, grads[name], rtol=1e-4, atol=1e-6), (name, (got - grads[name]).abs().max())
        losses.append(loss)
        opt.finish()
    return losses


def base_vocab(model) -> int:
    return model.args.vocab_size


def check(label: str, got: list[float], want: list[float]) -> None:
    worst = max(abs(a - b) for a, b in zip(got, want))
    if worst > 1e-5:
        raise AssertionError(f"rank {dist.get_rank()} {label}: losses {got}, one process {want}")
    if dist.get_rank() == 0:
        print(f"{label}: {len(got)} losses equal one process's (max difference {worst:.1e})", flush=True)


def model_equals_one_process(rank: int, world: int) -> None:
    env = DistEnv(rank=rank, world_size=world, local_rank=rank, device=torch.device("cpu"), local_world_size=world)
    torch.manual_seed(0)
    base = build(MODEL)
    base.init_weights(seed=7)
    with torch.no_grad():  # routers with clear choices: no near-tie that rounding could turn
        for moe in base.moe_modules().values():
            moe.router.weight.mul_(20)
    want, grads = reference(base, world)
    mine = [row[rank] for row in want]
    for ep in (4, 2) if world == 4 else (2,):
        par, model, opt = layout(base, env, ep)
        label = f"ep={ep}" + (f" x dp={par.dims.expert_dp}" if par.dims.expert_dp > 1 else "")
        if ep != 2 or world == 2:
            check(label, train(par, model, opt, range(STEPS), grads), mine)
            continue
        # dp=2 x ep=2: a checkpoint at SAVED_AT, resumed at ep=4 and ep=1 (FSDP2 alone) over the remaining steps.
        where = [tempfile.mkdtemp() if rank == 0 else None]
        dist.broadcast_object_list(where, src=0)
        first = train(par, model, opt, range(SAVED_AT), grads)
        path = save_checkpoint(Path(where[0]), SAVED_AT, opt, {"step": SAVED_AT}, keep=1)
        check(label, first + train(par, model, opt, range(SAVED_AT, STEPS)), mine)
        for resumed in (4, 1):
            par, model, opt = layout(base, env, resumed)
            load_checkpoint(path, opt)
            check(f"{label} checkpoint resumed at ep={resumed}", train(par, model, opt, range(SAVED_AT, STEPS)),
                  mine[SAVED_AT:])


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    exchange_equals_one_process(rank, world)
    model_equals_one_process(rank, world)
    dist.barrier()
    if rank == 0:
        print(f"EP OK world={world}", flush=True)
    destroy_process_groups()


if __name__ == "__main__":
    main()

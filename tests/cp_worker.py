"""Run by tests/test_cp.py under torchrun (4 gloo ranks): context parallelism against one process, in fp32.

Every rank computes the reference itself: the whole model on the whole batch, its loss and gradients. Then, on the
same 4 ranks, each layout below builds its mesh through holotrain's parallel lever, applies context parallelism
(and tensor parallelism, and FSDP2) to a copy of the model, trains one micro-batch of packed documents (some
targets masked, as padding and chat turns leave them) and compares the loss and every parameter's gradient with
the reference. Prints 'CP WORKER OK' when all pass."""

import copy
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from holotrain.config import ParallelConfig  # noqa: E402
from holotrain.model import ModelArgs, build  # noqa: E402
from holotrain.parallel.launch import DistEnv  # noqa: E402
from holotrain.parallel.lever import Parallel  # noqa: E402
from holotrain.parallel.teardown import destroy_process_groups  # noqa: E402

B, T = 2, 32  # rows per data-parallel rank, tokens per row

# (dp, cp, tp, cp_mode)
LAYOUTS = [(1, 4, 1, "ring"), (1, 4, 1, "alltoall"), (2, 2, 1, "ring"), (2, 2, 1, "alltoall"), (1, 2, 2, "ring"),
           (1, 2, 2, "alltoall")]


def batch(rows: int, vocab: int, seed: int):
    """Packed rows: documents of ragged lengths (one row a single document), padding targets and masked spans."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (rows, T), generator=g)
    targets = torch.randint(0, vocab, (rows, T), generator=g)
    doc_ids = torch.zeros(rows, T, dtype=torch.long)
    for r in range(rows):
        if r % 2 == 0:
            cuts = sorted(torch.randperm(T - 1, generator=g)[:4].add(1).tolist())
            for c in cuts:
                doc_ids[r, c:] += 1
    targets[0, 3:9] = -100  # a masked span (chat: a user turn)
    targets[:, -3:] = -100  # padding at the end of each row
    return tokens, targets, doc_ids


def grads(model) -> dict:
    out = {}
    for name, p in model.named_parameters():
        g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        out[name.replace("._checkpoint_wrapped_module", "")] = g
    return out


def close(what: str, got: torch.Tensor, want: torch.Tensor, tol: float = 2e-5) -> None:
    err = (got.double() - want.double()).abs().max().item()
    scale = want.double().abs().max().item() + 1e-12
    if err > tol * scale:
        raise AssertionError(f"rank {dist.get_rank()} {what}: max error {err:.3e} (scale {scale:.3e})")


def main():
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    env = DistEnv(rank=rank, world_size=world, local_rank=rank, device=torch.device("cpu"), local_world_size=world)
    args = ModelArgs(dim=64, n_layers=2, n_heads=8, n_kv_heads=4, ffn_dim=96, vocab_size=128, max_seq_len=T)
    torch.manual_seed(0)
    base = build(args)
    base.init_weights(seed=7)

    for dp, cp, tp, mode in LAYOUTS:
        assert dp * cp * tp == world
        # The reference: each data-parallel rank's rows, its mean loss; the step's loss and gradients are their mean.
        ref = copy.deepcopy(base)
        losses = []
        for d in range(dp):
            loss = ref(*batch(B, args.vocab_size, seed=100 + d)[:2], doc_ids=batch(B, args.vocab_size, 100 + d)[2]) / dp
            loss.backward()
            losses.append(loss.detach())
        want_loss, want = sum(losses), grads(ref)

        model = copy.deepcopy(base)
        par = Parallel(ParallelConfig(cp=cp, tp=tp, cp_mode=mode), env)
        par.apply_tp(model)
        par.apply_cp(model)
        par.apply_fsdp(model, torch.float32)
        assert par.cp_mode == mode
        d = rank // (cp * tp)  # this rank's data-parallel index: its rows
        tokens, targets, doc_ids = batch(B, args.vocab_size, seed=100 + d)
        loss = model(tokens, targets, doc_ids)
        loss.backward()
        got_loss = loss.detach().clone()
        dist.all_reduce(got_loss, op=dist.ReduceOp.AVG)  # the trainer's mean over ranks
        label = f"dp={dp} cp={cp} tp={tp} {mode}"
        close(f"{label} loss", got_loss, want_loss, 1e-6)
        got = grads(model)
        assert set(got) == set(want), (set(got) ^ set(want))
        for name in want:
            close(f"{label} grad {name}", got[name], want[name])
        if rank == 0:
            print(f"{label}: loss {got_loss.item():.6f} and {len(want)} gradients equal one process's", flush=True)
    destroy_process_groups()
    if rank == 0:
        print("CP WORKER OK", flush=True)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()

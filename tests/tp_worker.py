"""Run by tests/test_tp.py under torchrun (2 gloo ranks): every tensor-parallel piece against its dense
computation, forward and backward. Prints 'TP WORKER OK' when all checks pass.

With --teardown CYCLES: the process-group teardown alone, CYCLES times in the process (init, a TP model's forward
and backward, a DTensor gathered, then holotrain's teardown); prints 'TEARDOWN OK' when every cycle left no
group and no gloo thread behind.

Either way the process ends with holotrain.parallel.teardown.destroy_process_groups() and fails (exit 1) if a
process group or a gloo thread outlives it: one still running at interpreter shutdown can abort the process
(SIGABRT, "terminate called without an active exception") after every check passed."""

import argparse
import os
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from torch.distributed.device_mesh import init_device_mesh  # noqa: E402

from holotrain.config import ParallelConfig  # noqa: E402
from holotrain.model import ModelArgs, build  # noqa: E402
from holotrain.parallel.overlap import TPComm, ag_linear, linear_rs  # noqa: E402
from holotrain.parallel.teardown import destroy_process_groups, leftover_backend_threads  # noqa: E402
from holotrain.parallel.tp import _VocabParallelCrossEntropy, apply_tp  # noqa: E402


def close(name, got, want, tol):
    err = (got.double() - want.double()).abs().max().item()
    scale = want.double().abs().max().item() + 1e-12
    ok = err <= tol * scale
    if dist.get_rank() == 0 or not ok:
        verdict = "ok" if ok else "FAIL"
        print(f"rank {dist.get_rank()} {name}: max err {err:.2e} (scale {scale:.2e}) {verdict}", flush=True)
    if not ok:
        raise AssertionError(f"{name}: max error {err} > {tol} x {scale}")


def main():
    dist.init_process_group("gloo")
    rank, W = dist.get_rank(), dist.get_world_size()
    comm = TPComm(dist.group.WORLD, "none")
    g = torch.Generator().manual_seed(1234)  # same full tensors on every rank; each takes its slice
    dt = torch.float64
    M, K, N = 12, 10, 8
    m, nl, kl = M // W, N // W, K // W
    rows, cols = slice(rank * m, (rank + 1) * m), slice(rank * nl, (rank + 1) * nl)
    kcols = slice(rank * kl, (rank + 1) * kl)

    # Column-parallel: y = all_gather(x) @ w.T with w split by output rows.
    X, Wt, dY = (torch.randn(*s, generator=g, dtype=dt) for s in ((M, K), (N, K), (M, N)))
    x, w = X[rows].clone().requires_grad_(), Wt[cols].clone().requires_grad_()
    y = ag_linear(x, w, comm)
    y.backward(dY[:, cols])
    close("column forward", y, X @ Wt[cols].T, 1e-12)
    # Input gradient of the whole layer: every rank's columns contribute, summed by the reduce-scatter.
    close("column grad input", x.grad, (dY @ Wt)[rows], 1e-12)
    close("column grad weight", w.grad, dY[:, cols].T @ X, 1e-12)

    # Row-parallel: y = reduce_scatter(x @ w.T) with w split by input columns.
    X, Wt = torch.randn(M, K, generator=g, dtype=dt), torch.randn(N, K, generator=g, dtype=dt)
    dY = torch.randn(M, N, generator=g, dtype=dt)
    x, w = X[:, kcols].clone().requires_grad_(), Wt[:, kcols].clone().requires_grad_()
    y = linear_rs(x, w, comm)
    y.backward(dY[rows])
    close("row forward", y, (X @ Wt.T)[rows], 1e-12)
    close("row grad input", x.grad, dY @ Wt[:, kcols], 1e-12)
    close("row grad weight", w.grad, dY.T @ X[:, kcols], 1e-12)

    # Vocabulary-parallel cross-entropy, with ignored targets.
    V = 10
    logits = torch.randn(M, V, generator=g, dtype=dt) * 3
    targets = torch.randint(0, V, (M,), generator=g)
    targets[[1, 5]] = -100
    vl = V // W
    local = logits[:, rank * vl:(rank + 1) * vl].clone().requires_grad_()
    loss = _VocabParallelCrossEntropy.apply(local, targets, comm)
    loss.backward()
    full = logits.clone().requires_grad_()
    want = F.cross_entropy(full, targets, ignore_index=-100)
    want.backward()
    close("vocab-parallel cross-entropy", loss, want, 1e-6)
    close("vocab-parallel cross-entropy grad", local.grad, full.grad[:, rank * vl:(rank + 1) * vl], 1e-6)

    # The whole model: TP over 2 ranks against the dense model, same seed, packed documents, ignored targets.
    args = ModelArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=48, vocab_size=64, max_seq_len=16)
    dense = build(args)
    dense.init_weights(seed=7)
    mesh = init_device_mesh("cpu", (W,), mesh_dim_names=("tp",))
    with torch.device("meta"):
        model = build(args)
    try:  # the config's parallel section, not the overlap mode alone
        apply_tp(model, mesh, "none")
        raise AssertionError("apply_tp took a string for the parallel section")
    except TypeError as e:
        assert "parallel section" in str(e), e
    section = ParallelConfig(tp=W, tp_overlap="none", tp_spin_limit=12345, tp_barrier_ms=678, tp_piece_mb=0.5)
    tp_comm = apply_tp(model, mesh, section)
    knobs = (tp_comm.mode, tp_comm.spin_limit, tp_comm.barrier_ms, tp_comm.piece_mb)
    assert knobs == ("none", 12345, 678, 0.5), knobs
    model.to_empty(device="cpu")
    model.init_weights(seed=7)
    B, T = 3, 16
    tokens = torch.randint(0, 64, (B, T), generator=g)
    targets = torch.randint(0, 64, (B, T), generator=g)
    targets[0, :3] = -100
    doc_ids = torch.tensor([[0] * 5 + [1] * 11, [0] * 16, [0] * 2 + [1] * 7 + [2] * 7])
    for docs in (None, doc_ids):
        dense.zero_grad()
        model.zero_grad()
        want = dense(tokens, targets, docs)
        want.backward()
        got = model(tokens, targets, docs)
        got.backward()
        tag = "packed" if docs is not None else "causal"
        close(f"model loss ({tag})", got, want, 1e-5)
        for (name, p), (_, q) in zip(model.named_parameters(), dense.named_parameters()):
            close(f"model grad {name} ({tag})", p.grad.full_tensor(), q.grad, 2e-4)
    with torch.no_grad():
        close("model logits", model(tokens), dense(tokens), 1e-5)
    dist.barrier()
    if rank == 0:
        print("TP WORKER OK", flush=True)
    # The process groups are destroyed by the caller, once this frame (the models, meshes, TPComm) is gone.


def teardown_cycle(cycle: int) -> None:
    """One process-group lifetime with everything that holds a group past dist.destroy_process_group(): a
    DeviceMesh (its group registry) kept by DTensor's caches, a TP model (its bound forwards hold the TPComm),
    and a collective as the last operation."""
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), int(os.environ["WORLD_SIZE"]),
                          is_master=False)
    # A key space of its own per cycle: a rank re-joining must not read the previous cycle's addresses.
    dist.init_process_group("gloo", store=dist.PrefixStore(f"teardown-{cycle}", store),
                            rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
    W = dist.get_world_size()
    mesh = init_device_mesh("cpu", (W,), mesh_dim_names=("tp",))
    args = ModelArgs(dim=16, n_layers=1, n_heads=2, n_kv_heads=2, ffn_dim=16, vocab_size=16, max_seq_len=8)
    with torch.device("meta"):
        model = build(args)
    apply_tp(model, mesh, ParallelConfig(tp=W, tp_overlap="none"))
    model.to_empty(device="cpu")
    model.init_weights(seed=cycle)
    g = torch.Generator().manual_seed(cycle)
    tokens = torch.randint(0, 16, (2, 8), generator=g)
    model(tokens, tokens).backward()
    model.output.weight.grad.full_tensor()
    t = torch.ones(3)
    dist.all_reduce(t)  # the last work: its tensor has a Python object
    assert t.eq(W).all(), t


def check_teardown(tag: str) -> bool:
    """holotrain's teardown; False (with the reason on stderr) if a group or a gloo thread outlived it."""
    left, threads = destroy_process_groups(), leftover_backend_threads()
    if left or threads:
        print(f"rank {os.environ.get('RANK')} {tag}: process groups alive after teardown: {left or 'none'}; gloo "
              f"threads still running: {threads or 'none'}", file=sys.stderr, flush=True)
    return not left and not threads


def run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--teardown", type=int, default=0, metavar="CYCLES")
    a = parser.parse_args(argv)
    ok = True
    try:
        if a.teardown:
            for cycle in range(a.teardown):
                teardown_cycle(cycle)
                ok = check_teardown(f"cycle {cycle}") and ok
            if ok and os.environ.get("RANK") == "0":
                print("TEARDOWN OK", flush=True)
        else:
            main()
    except Exception:
        traceback.print_exc()
        ok = False
    # Here, with main's frame and any traceback gone, nothing of ours holds a process group.
    return 0 if check_teardown("exit") and ok else 1


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(run(sys.argv[1:]))

"""Run by tests/test_gpu_tp.py (and bench/gpu/parallel.sh, part tp) under torchrun on 2 GPUs (NCCL): the fused Triton ops and torch
async-TP against the unfused bf16 result (NCCL collective + cuBLAS), on fresh random inputs each run, into outputs
poisoned with NaN.

Every case runs in step on all ranks and ends with the ranks agreeing on its outcome: "PASS name" only when every
rank passed; otherwise each failing rank prints its error and traceback, every rank prints a DIAG line (the fused
path's state: calls, workspaces, counters, error word), rank 0 prints "FAIL name (ranks [...])", and the fused
workspaces are rebuilt on every rank before the next case (a bad one never poisons the rest). A case that hangs is
ended by a per-case watchdog (HOLOTRAIN_TEST_CASE_S, stacks dumped); a lost CUDA context (a trapped or faulting
kernel) ends the process at once with a note, as nothing after it could run. "RUN name" is printed before each
case, so a log cut short still says where. The last line says how many failed.

  torchrun --standalone --nproc_per_node=2 tests/gpu_tp_worker.py [--quick] [--groups basic,large,model]
      [--spin-limit N] [--barrier-ms MS] [--piece-mb MB]

Groups: basic (symmetric-memory self-test stress, the Triton GEMM alone, M=8192 and an odd shape, queued calls,
autograd), large (the M=16384 and K=8192 shapes), model (a TP=2 Llama in every mode). --quick: basic, fewer shapes.
--spin-limit, --barrier-ms, --piece-mb: the fused path's parallel.tp_spin_limit, tp_barrier_ms and tp_piece_mb for
every TPComm and model of the run (default: the config's defaults).
"""

from __future__ import annotations

import argparse
import dataclasses
import faulthandler
import os
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from holotrain.config import ParallelConfig  # noqa: E402
from holotrain.parallel.overlap import TPComm, ag_linear, all_gather_matmul, linear_rs, matmul_reduce_scatter  # noqa: E402

# (M rows over the group, K, N): the benchmark's shapes and an odd one (no dimension a multiple of a tile).
GROUP_SHAPES = {
    "basic": [(8192, 4096, 14336), (2000, 1032, 1040)],
    "large": [(16384, 4096, 14336), (8192, 8192, 14336), (16384, 8192, 14336)],
}
QUICK = [(8192, 4096, 14336), (2000, 1032, 1040)]
GROUPS = ("basic", "large", "model")
CASE_S = float(os.environ.get("HOLOTRAIN_TEST_CASE_S", "90"))
FAILED: list[str] = []
PASSED: list[str] = []
DEVICE = "cuda"  # the agreement's device ("cpu" only for a dry run of this harness over gloo)
GRAVEYARD: list = []  # fused states replaced after a failure: kept alive (a peer's late work may touch them)
KNOBS: dict = {}  # the fused path's settings from the command line: TPComm's spin_limit, barrier_ms, piece_mb


def make_comm(group, mode: str) -> TPComm:
    return TPComm(group, mode, **KNOBS)


def log(msg: str, all_ranks: bool = False) -> None:
    if all_ranks or dist.get_rank() == 0:
        print(f"[rank {dist.get_rank()}] {msg}", flush=True)


def context_alive() -> str | None:
    """None if this rank's CUDA context still runs kernels, else the error."""
    try:
        if DEVICE == "cuda":
            torch.cuda.synchronize()
        torch.ones(1, device=DEVICE).add_(1).item()
        return None
    except Exception as e:  # sticky CUDA errors (a trap, an illegal address) land here
        return f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"


def fused_state(comms: dict) -> str:
    comm = comms.get("fused")
    if comm is None or comm._fused is None:
        return "fused path not created"
    try:
        return comm.fused.state()
    except Exception as e:
        return f"state unavailable: {type(e).__name__}: {e}"


def check(name: str, fn, comms: dict, fused: bool = True) -> None:
    """Runs one case on every rank; the ranks agree on its outcome (see the module docstring)."""
    log(f"RUN {name}")
    faulthandler.dump_traceback_later(CASE_S, exit=True)
    t0 = time.perf_counter()
    err, detail = None, None
    try:
        detail = fn()
        if DEVICE == "cuda":
            torch.cuda.synchronize()
    except Exception as e:
        err = f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
    elapsed = time.perf_counter() - t0
    dead = context_alive()
    if dead is not None:
        log(f"FAIL {name} ({elapsed:.1f} s): {err or 'no exception in the case itself'}", all_ranks=True)
        log(f"DIAG {name}: CUDA context lost on this rank ({dead}): a kernel trapped (a symmetric-memory barrier "
            "timing out: the ranks went out of step) or faulted (an illegal address). The cases after this one cannot "
            "run in this process; ending it.", all_ranks=True)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(3)
    flags = torch.tensor([1 if err else 0], device=DEVICE)
    everyone = [torch.zeros_like(flags) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, flags)
    bad = [r for r, f in enumerate(everyone) if f.item()]
    faulthandler.dump_traceback_later(CASE_S, exit=True)  # re-armed: covers the reference work up to the next case
    if not bad:
        PASSED.append(name)
        log(f"PASS {name} {detail or ''} ({elapsed:.1f} s)")
        return
    FAILED.append(name)
    if err:
        log(f"FAIL {name} ({elapsed:.1f} s): {err}", all_ranks=True)
    mem = f"; {torch.cuda.memory_allocated() / 2**30:.1f} GiB allocated" if DEVICE == "cuda" else ""
    log(f"DIAG {name}: failed on ranks {bad}; {fused_state(comms)}{mem}", all_ranks=True)
    log(f"FAIL {name} (ranks {bad})")
    if fused and "fused" in comms:  # every rank together: the next case starts from fresh workspaces
        GRAVEYARD.append(comms["fused"])
        comms["fused"] = make_comm(dist.group.WORLD, "fused")
    dist.barrier()


def compare(name: str, got: torch.Tensor, want: torch.Tensor, tol: float = 1e-2) -> str:
    """Relative Frobenius error within `tol`, no NaN (poisoned outputs left unwritten), no wrong tile."""
    if got.shape != want.shape:
        raise AssertionError(f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}")
    nan = torch.isnan(got).sum().item()
    if nan:
        bad = torch.isnan(got).nonzero()[:3].tolist()
        raise AssertionError(f"{name}: {nan} NaN elements (unwritten, e.g. at {bad})")
    d = (got.float() - want.float())
    rel = (d.norm() / want.float().norm().clamp(min=1e-30)).item()
    rms = want.float().pow(2).mean().sqrt().item()
    worst = d.abs().max().item() / max(rms, 1e-30)
    if rel > tol or worst > 0.25:
        idx = d.abs().argmax().item()
        r, c = divmod(idx, got.shape[1])
        raise AssertionError(f"{name}: relative error {rel:.2e} (tol {tol}), worst element {worst:.2e} x rms at "
                             f"({r}, {c}): got {got[r, c].item()}, want {want[r, c].item()}")
    return f"rel {rel:.1e}"


def poisoned(shape, device) -> torch.Tensor:
    return torch.full(shape, float("nan"), dtype=torch.bfloat16, device=device)


def main() -> None:
    defaults = ParallelConfig()
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true")
    p.add_argument("--groups", default=",".join(GROUPS))
    p.add_argument("--spin-limit", type=int, default=defaults.tp_spin_limit, help="parallel.tp_spin_limit")
    p.add_argument("--barrier-ms", type=int, default=defaults.tp_barrier_ms, help="parallel.tp_barrier_ms")
    p.add_argument("--piece-mb", type=float, default=defaults.tp_piece_mb, help="parallel.tp_piece_mb")
    args = p.parse_args()
    quick = args.quick
    groups = set(args.groups.split(","))
    unknown = groups - set(GROUPS)
    if unknown:
        raise SystemExit(f"unknown --groups {sorted(unknown)}; known: {', '.join(GROUPS)}")
    if quick:
        groups = {"basic"}
    KNOBS.update(spin_limit=args.spin_limit, barrier_ms=args.barrier_ms, piece_mb=args.piece_mb)
    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    device = torch.device("cuda", local)
    dist.init_process_group("nccl", device_id=device)
    rank, W = dist.get_rank(), dist.get_world_size()
    faulthandler.dump_traceback_later(CASE_S, exit=True)  # re-armed by every case: a hang anywhere ends the run
    seed = torch.tensor([int.from_bytes(os.urandom(4), "little") if rank == 0 else 0], device=device)
    dist.broadcast(seed, 0)
    seed = int(seed.item())
    knobs = {k: os.environ.get(k) for k in ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "NCCL_NVLS_ENABLE",
                                            "HOLOTRAIN_TEST_CASE_S")}
    knobs.update(KNOBS)
    log(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, world {W}, seed {seed}, groups "
        f"{','.join(g for g in GROUPS if g in groups)}, {knobs}")
    try:
        import triton

        log(f"triton {triton.__version__}")
    except ImportError:
        log("triton missing: the fused checks will fail")
    gen = torch.Generator(device=device).manual_seed(seed * 8 + rank)  # each rank its own data
    group = dist.group.WORLD
    comms = {}
    for mode in ("none", "async_tp", "fused"):
        try:
            comms[mode] = make_comm(group, mode)
        except Exception as e:
            FAILED.append(f"TPComm({mode})")
            log(f"FAIL TPComm({mode}): {type(e).__name__}: {e}", all_ranks=True)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen, device=device, dtype=torch.float32) * scale).to(torch.bfloat16)

    def symm_stress():
        """Fresh symmetric buffers back to back, sizes growing and shrinking, each through its self-test (a race in
        the self-test itself shows at random allocations)."""
        from holotrain.parallel.symm import SymmBuffer

        sizes = [4096 * (1 + (i * 37) % 16) + 4096 * 256 * (i % 3) for i in range(24)]
        keep = [SymmBuffer(group, n, device, f"stress buffer {i}") for i, n in enumerate(sizes)]
        return f"{len(keep)} buffers of {min(sizes)}..{max(sizes)} bytes, every marker read back on every rank"

    # The GEMM cores alone against cuBLAS: Triton, and the warp-specialized Gluon one (also on a ragged shape).
    def gemm_alone():
        from holotrain.parallel.overlap_kernels import triton_matmul
        from holotrain.parallel.tiles import Tiles

        out = []
        for core, (M, K, N) in ((0, (4096, 4096, 3584)), (1, (4096, 4096, 3584)), (1, (1000, 1040, 520))):
            for layout in ("nk", "kn"):
                a = rand(M, K)
                w = rand(N, K, scale=K ** -0.5) if layout == "nk" else rand(K, N, scale=K ** -0.5)
                want = a @ (w.t() if layout == "nk" else w)
                got = triton_matmul(a, w, layout, Tiles(core=core))
                out.append(compare(f"core {core} {M}x{K}x{N} {layout}", got, want))
        return " ".join(out)

    if "fused" in comms and "basic" in groups:
        check("symmetric-memory self-test x24 (fresh buffers)", symm_stress, comms)
        check("Triton and Gluon GEMM alone vs cuBLAS (nk, kn)", gemm_alone, comms, fused=False)

    shapes = QUICK if quick else [s for g in ("basic", "large") if g in groups for s in GROUP_SHAPES[g]]
    for M, K, N in shapes:
        m, nl = M // W, N // W
        for layout in ("nk", "kn"):
            # all-gather + GEMM: a_shard [m, K] per rank, B = this rank's N/W columns.
            a = rand(m, K)
            w = rand(nl, K, scale=K ** -0.5) if layout == "nk" else rand(K, nl, scale=K ** -0.5)
            ref_g, ref_y = all_gather_matmul(a, w, comms["none"], layout)
            for mode in ("async_tp", "fused"):
                if mode not in comms:
                    continue

                def ag(mode=mode, a=a, w=w, ref_g=ref_g, ref_y=ref_y, layout=layout):
                    if mode == "fused":  # the default tiles, flattened loops with a two-piece epilogue, Gluon core
                        fused, results = comms[mode].fused, []
                        default = fused.tiles
                        try:
                            for tiles in (default, dataclasses.replace(default, stages=4, flat=1, epi=2),
                                          dataclasses.replace(default, core=1)):
                                fused.tiles = tiles
                                y, g = poisoned((M, nl), device), poisoned((M, K), device)
                                fused.all_gather_matmul(a, w, layout, out=y, gathered=g)
                                fused.check()
                                if not torch.equal(g, ref_g):
                                    raise AssertionError(f"gathered rows differ from NCCL's all-gather ({tiles})")
                                results.append(f"{tiles}: " + compare("all_gather_matmul", y, ref_y))
                        finally:
                            fused.tiles = default
                        return "; ".join(results)
                    else:
                        torch.empty(M * (nl + K) * 2, dtype=torch.bfloat16, device=device).fill_(float("nan"))
                        g, y = all_gather_matmul(a, w, comms[mode], layout)
                    if not torch.equal(g, ref_g):
                        raise AssertionError("gathered rows differ from NCCL's all-gather")
                    return compare("all_gather_matmul", y, ref_y)

                check(f"{mode} all_gather_matmul M={M} K={K} N={N} {layout}", ag, comms, fused=mode == "fused")
            # GEMM + reduce-scatter: a [M, N/W] per rank, B [N/W -> K]; output [m, K].
            a = rand(M, nl)
            w = rand(K, nl, scale=N ** -0.5) if layout == "nk" else rand(nl, K, scale=N ** -0.5)
            ref = matmul_reduce_scatter(a, w, comms["none"], layout)
            for mode in ("async_tp", "fused"):
                if mode not in comms:
                    continue

                def rs(mode=mode, a=a, w=w, ref=ref, layout=layout):
                    if mode == "fused":
                        out = poisoned((m, K), device)
                        comms[mode].fused.matmul_reduce_scatter(a, w, layout, out=out)
                        comms[mode].fused.check()
                    else:
                        torch.empty(M * K * 2, dtype=torch.bfloat16, device=device).fill_(float("nan"))
                        out = matmul_reduce_scatter(a, w, comms[mode], layout)
                    return compare("matmul_reduce_scatter", out, ref)

                check(f"{mode} matmul_reduce_scatter M={M} K={K} N={N} {layout}", rs, comms, fused=mode == "fused")
            del a, w, ref, ref_g, ref_y
            torch.cuda.empty_cache()

    if "fused" in comms and "basic" in groups:
        def back_to_back():
            """Calls queued without synchronizing (the double-buffered workspaces and cumulative counters)."""
            M, K, N = 4096, 2048, 5632
            m, nl = M // W, N // W
            jobs, outs = [], []
            for i in range(12):
                a, w = rand(m, K), rand(nl, K, scale=K ** -0.5)
                a2, w2 = rand(M, nl), rand(K, nl, scale=N ** -0.5)
                jobs.append((a, w, a2, w2))
                outs.append((comms["fused"].fused.all_gather_matmul(a, w)[1],
                             comms["fused"].fused.matmul_reduce_scatter(a2, w2)))
            comms["fused"].fused.check()
            errs = []
            for (a, w, a2, w2), (y, o) in zip(jobs, outs):
                errs.append(compare("ag", y, all_gather_matmul(a, w, comms["none"])[1]))
                errs.append(compare("rs", o, matmul_reduce_scatter(a2, w2, comms["none"])))
            return f"{len(errs)} results, worst {max(float(e.split()[1]) for e in errs):.1e}"

        check("fused back-to-back: 12 all-gather + 12 reduce-scatter calls queued", back_to_back, comms)

        def autograd():
            """ag_linear / linear_rs, forward and backward, fused against none."""
            M, K, N = 4096, 2048, 5632
            m, nl = M // W, N // W
            x, w1, w2 = rand(m, K), rand(nl, K, scale=K ** -0.5), rand(K, nl, scale=N ** -0.5)
            dy = rand(m, K)
            res = {}
            for mode in ("none", "fused"):
                xs, w1s, w2s = (t.clone().requires_grad_() for t in (x, w1, w2))
                y = linear_rs(torch.nn.functional.silu(ag_linear(xs, w1s, comms[mode])), w2s, comms[mode])
                y.backward(dy)
                res[mode] = (y, xs.grad, w1s.grad, w2s.grad)
            comms["fused"].fused.check()
            names = ("y", "dx", "dw1", "dw2")
            return " ".join(compare(n, a, b, 2e-2) for n, a, b in zip(names, res["fused"], res["none"]))

        check("fused autograd (column -> silu -> row, forward and backward)", autograd, comms)

    def model():
        """A small Llama with TP=2: loss and gradients of every tp_overlap mode against 'none'."""
        from torch.distributed.device_mesh import init_device_mesh

        from holotrain.model import ModelArgs, build
        from holotrain.parallel.tp import apply_tp

        args = ModelArgs(dim=1024, n_layers=2, n_heads=8, n_kv_heads=4, ffn_dim=2816, vocab_size=32000,
                         max_seq_len=1024)
        mesh = init_device_mesh("cuda", (W,), mesh_dim_names=("tp",))
        # 1025 tokens: inputs and targets of 1024, which splits over the ranks for sequence parallelism
        tokens = torch.randint(0, 32000, (4, 1025), device=device, generator=gen)
        dist.broadcast(tokens, 0)  # a tensor-parallel group shares its batch
        out, res = [], {}
        for mode in [m for m in ("none", "async_tp", "fused") if m in comms]:
            with torch.device("meta"):
                model = build(args)
            apply_tp(model, mesh, ParallelConfig(tp=W, tp_overlap=mode, tp_spin_limit=KNOBS["spin_limit"],
                                                 tp_barrier_ms=KNOBS["barrier_ms"], tp_piece_mb=KNOBS["piece_mb"]))
            model.to_empty(device=device)
            model.init_weights(seed=seed)
            model.to(torch.bfloat16)
            loss = model(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())
            loss.backward()
            if mode == "fused":
                fused = model.hooks.tp_comm.fused
                fused.check()
                got = (fused.spin_limit, fused.barrier_timeout_ms, fused.piece_bytes)
                want = (KNOBS["spin_limit"], KNOBS["barrier_ms"], int(KNOBS["piece_mb"] * 2**20))
                if got != want:
                    raise AssertionError(f"fused settings {got} are not the section's {want}")
            grads = {n: p.grad.to_local().float() for n, p in model.named_parameters()}
            res[mode] = (loss.detach().float(), grads)
            if mode != "none":
                ref_loss, ref_grads = res["none"]
                if abs(loss.item() - ref_loss.item()) > 2e-2 * abs(ref_loss.item()):
                    raise AssertionError(f"{mode}: loss {loss.item()} vs none {ref_loss.item()}")
                worst = max((ref_grads[n] - g).norm().item() / max(ref_grads[n].norm().item(), 1e-30)
                            for n, g in grads.items())
                if worst > 5e-2:
                    raise AssertionError(f"{mode}: a gradient differs from none's by {worst:.2e} (relative)")
                out.append(f"{mode}: loss {loss.item():.4f} (none {ref_loss.item():.4f}), worst grad rel {worst:.1e}")
        return "; ".join(out)

    if "model" in groups:
        check("TP=2 Llama, every tp_overlap mode against none", model, comms, fused=False)

    torch.cuda.synchronize()
    dist.barrier()
    faulthandler.cancel_dump_traceback_later()
    failed = torch.tensor([len(FAILED)], device=device)
    dist.all_reduce(failed, op=dist.ReduceOp.MAX)
    n = failed.item()
    log(f"GPU TP CHECKS: {'ALL PASSED' if n == 0 else f'{n} FAILED'} ({len(PASSED)} passed"
        f"{': failed ' + ', '.join(FAILED) if FAILED else ''})")
    dist.destroy_process_group()
    sys.exit(1 if n else 0)


if __name__ == "__main__":
    main()

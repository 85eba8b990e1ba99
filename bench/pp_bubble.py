"""The pipeline bubble measured on CPU ranks beside the bubble model: for each schedule, the share of a step the
ranks sit idle, as holotrain.parallel.pp_timeline records it, against the simulator of plan/pipeline.py fed with the
same run's measured per-action times, and against the textbook (p-1)/(m+p-1) for 1f1b.

Four gloo ranks, one thread each, each pinned to its own physical core where there are enough (two hyperthreads of
one core would make two stages slower than the others), pp=4 (or 2), a small Llama (8 blocks of dim 256, the head over a
256-token vocabulary a small part of a block, so the blocks carry the cost and the stages are near equal),
micro-batches of one row of 256 tokens: a block's forward and backward take some 10-30 ms on one core. Each case
trains --warmup steps (discarded) then --steps steps (gradients cleared in between, no optimizer: the weights do not
change the time). Per case:

  measured   per step 1 - (sum of the ranks' busy time) / (4 x the step), the step being the longest rank's, from a
             barrier to the end of its schedule.step; the median over the steps
  model      plan.pipeline.predicted_bubble_share: torch's order of the schedule simulated with each stage's mean
             forward / backward (input and weight halves for zb1p and zbv) times in the same step, sends free; the
             median over the steps (a step's own times: the ranks' speeds drift from step to step, and the slowest
             stage of a step sets its pace)
  +sends     the same with each transfer between ranks taking the one-way time of one activation, timed by a
             ping-pong between ranks 0 and 1 before the cases (gloo's latency: a share of the step that grows with
             the number of transfers, so with the micro-batches and with interleaving)
  +host      the model again with every action lengthened by its rank's host time between actions (the mean gap
             between consecutive actions shorter than a tenth of the rank's median action: the schedule posting
             and completing its sends and receives, which the model has nothing for), the busy time unchanged
  calib.     the model with one host time per action for every rank and case, the first case's (--cases: 1f1b
             at m=4 by default) mean gap: calibrated there, predicting the others
  textbook   the closed form with equal stages and F = B = W: (p-1)/(m+p-1) for 1f1b

Run on a machine with at least 4 idle cores (fewer make the ranks contend and distort the bubble), or at pp=2 with
--nproc_per_node 2 on 2:

  OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node 4 bench/pp_bubble.py --out pp_bubble.json

--cases picks the schedules and micro-batch counts (default 1f1b:4,1f1b:16,interleaved:16,zb1p:16,zbv:16);
--timeline-dir DIR also writes each case's last step as DIR/<schedule>-m<m>.json (pipeline_timeline.json's format).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import datetime
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from holotrain.model import Decoder, ModelArgs, build
from holotrain.parallel.launch import DistEnv, device_mesh  # noqa: E402
from holotrain.parallel.pp import (Pipeline, rank_stages, stage_bounds, stage_model,  # noqa: E402
                                   stages_per_rank, unit_costs)
from holotrain.parallel.pp_timeline import StageTimeline, bubble_figures, write  # noqa: E402
from holotrain.parallel.teardown import destroy_process_groups  # noqa: E402
from holotrain.plan.pipeline import schedule_order, simulate  # noqa: E402

PP = int(os.environ.get("WORLD_SIZE", "4"))  # the pipeline's ranks: the launch's (4; 2 fit a 2-core machine)
T = 256  # tokens per row; one row per micro-batch
ARGS = ModelArgs(dim=256, n_layers=8, n_heads=8, n_kv_heads=4, ffn_dim=768, vocab_size=256, max_seq_len=T)
DEFAULT_CASES = "1f1b:4,1f1b:16,interleaved:16,zb1p:16,zbv:16"


def parse_cases(text: str) -> list[tuple[str, int]]:
    out = []
    for item in text.split(","):
        schedule, _, m = item.strip().partition(":")
        out.append((schedule, int(m)))
    return out


def pin_to_core(rank: int, world: int) -> int | None:
    """Pins this thread (torch computes on it with one thread) to the first hardware thread of the rank-th physical
    core; None, unpinned, where this process may use fewer cores than there are ranks."""
    first_of_core: dict = {}
    for cpu in sorted(os.sched_getaffinity(0)):
        topology = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
        try:
            core = (topology / "physical_package_id").read_text().strip(), (topology / "core_id").read_text().strip()
        except OSError:
            core = cpu
        first_of_core.setdefault(core, cpu)
    cpus = sorted(first_of_core.values())
    if len(cpus) < world:
        return None
    os.sched_setaffinity(0, {cpus[rank]})
    return cpus[rank]


def one_way_send_s(rank: int, rounds: int = 30) -> float:
    """Seconds for one activation ([1, T, dim] fp32) to go from rank 0 to rank 1: half the median round trip."""
    x = torch.randn(1, T, ARGS.dim)
    times = []
    for _ in range(rounds + 3):
        dist.barrier()
        start = time.perf_counter()
        if rank == 0:
            dist.send(x, 1)
            dist.recv(x, 1)
        elif rank == 1:
            dist.recv(x, 0)
            dist.send(x, 0)
        times.append((time.perf_counter() - start) / 2)
    return statistics.median(times[3:])


def host_gaps(gathered: dict) -> list[float]:
    """Per stage, its rank's host time between consecutive actions: the mean of the gaps shorter than a tenth of the
    rank's median action (longer ones are waits for a peer)."""
    by_rank: dict[int, list[dict]] = {}
    for e in gathered["events"]:
        by_rank.setdefault(e["rank"], []).append(e)
    host = [0.0] * (gathered["pp"] * gathered["stages_per_rank"])
    for events in by_rank.values():
        typical = statistics.median(e["end"] - e["start"] for e in events)
        gaps = [b["start"] - a["end"] for a, b in zip(events, events[1:])]
        short = [g for g in gaps if 0 <= g < typical / 10]
        for s in {e["stage"] for e in events}:
            host[s] = statistics.mean(short) if short else 0.0
    return host


def with_host_time(gathered: dict, host_s: float | None = None) -> float | None:
    """The bubble share the model gives when each action also takes host time: its rank's own gaps in the same
    step, or `host_s` for every action (a constant calibrated on another case)."""
    order = schedule_order(gathered["schedule"], gathered["pp"], gathered["micro_batches"])
    host = host_gaps(gathered) if host_s is None else [host_s] * order.n_stages
    times = gathered["stage_times_s"]
    if any(t is None for v in times.values() for t in v):
        return None
    def grown(kind: str) -> list[float]:
        return [t + h for t, h in zip(times[kind], host)]

    if order.split:
        step_s = simulate(order, grown("F"), grown("I"), grown("W")).step_s
    else:
        step_s = simulate(order, grown("F"), grown("B"), 0.0).step_s
    busy = sum(r["busy_s"] for r in gathered["ranks"])
    return 1 - busy / (gathered["pp"] * step_s)


def run_case(base: Decoder, pp_mesh, schedule: str, m: int, warmup: int, steps: int, p2p_s: float,
             host_s: float | None = None) -> dict:
    """Trains `warmup` + `steps` steps of `schedule` with m micro-batches; on rank 0 the case's figures."""
    n_stages = PP * stages_per_rank(schedule)
    bounds = stage_bounds(unit_costs(ARGS, T), n_stages)
    stage_ids = rank_stages(pp_mesh.get_local_rank(), PP, schedule)
    models = [stage_model(copy.deepcopy(base), *bounds[s]) for s in stage_ids]
    pipe = Pipeline(models, stage_ids, n_stages, pp_mesh, schedule, m, torch.device("cpu"))
    timeline = StageTimeline(pipe, keep=steps, barrier=True).on()

    g = torch.Generator().manual_seed(1)  # the same batch on every rank, random rather than constant
    tokens = torch.randint(0, ARGS.vocab_size, (m, T), generator=g)
    targets = torch.randint(0, ARGS.vocab_size, (m, T), generator=g)
    shares, predicted, with_sends, with_host, calibrated, gaps, walls, last = [], [], [], [], [], [], [], None
    for step in range(warmup + steps):
        if step == warmup:
            timeline.clear()
        pipe.step(tokens, targets)
        for model in models:
            model.zero_grad(set_to_none=True)
        if step >= warmup:
            # Each step's figures from every rank (a small gather; the next step starts after a barrier anyway).
            last = timeline.gather()
            if last is not None:
                figures = bubble_figures(last)
                shares.append(figures["measured_bubble_share"])
                predicted.append(figures["predicted_bubble_share"])
                with_sends.append(bubble_figures(last, p2p_s=p2p_s)["predicted_bubble_share"])
                with_host.append(with_host_time(last))
                gaps.append(statistics.mean(host_gaps(last)))
                if host_s is not None:
                    calibrated.append(with_host_time(last, host_s))
                walls.append(figures["step_s"])
    timeline.off()
    if last is None:
        return {}
    textbook = bubble_figures(last)["textbook_bubble_share"]
    return {"schedule": schedule, "micro_batches": m, "pp": PP, "stages": bounds,
            "measured_bubble_share": statistics.median(shares), "measured_min": min(shares),
            "measured_max": max(shares), "step_s": statistics.median(walls),
            "predicted_bubble_share": statistics.median(predicted),
            "predicted_with_sends": statistics.median(with_sends),
            "predicted_with_host": statistics.median(x for x in with_host if x is not None),
            "host_gap_s": statistics.median(gaps),
            "predicted_calibrated": statistics.median(calibrated) if calibrated and None not in calibrated else None,
            "textbook_bubble_share": textbook, "stage_times_s": last["stage_times_s"], "timeline": last}


def print_table(results: list[dict]) -> None:
    head = f"{'schedule':<12}{'m':>4}{'step s':>9}{'measured':>10}{'model':>9}{'meas/model':>12}" \
           f"{'+sends':>8}{'+host':>8}{'calib.':>8}{'textbook':>10}{'meas/text':>11}   per-stage F / B (or I, W) ms, last step"
    print(head)
    print("-" * len(head))
    for r in results:
        pred, text = r["predicted_bubble_share"], r["textbook_bubble_share"]
        times = r["stage_times_s"]
        kinds = [k for k in ("F", "B", "I", "W") if k in times]
        per_stage = " | ".join("/".join(f"{times[k][s] * 1e3:.1f}" for k in kinds)
                               for s in range(len(times["F"])))
        print(f"{r['schedule']:<12}{r['micro_batches']:>4}{r['step_s']:>9.3f}{r['measured_bubble_share']:>10.1%}"
              f"{pred:>9.1%}{r['measured_bubble_share'] / pred if pred else float('nan'):>12.2f}"
              f"{r['predicted_with_sends']:>8.1%}{r['predicted_with_host']:>8.1%}"
              f"{r['predicted_calibrated'] if r['predicted_calibrated'] is not None else float('nan'):>8.1%}"
              f"{text if text is not None else float('nan'):>10.1%}"
              f"{r['measured_bubble_share'] / text if text else float('nan'):>11.2f}   {per_stage}")


def main() -> None:
    global ARGS
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=10, help="measured steps per case")
    parser.add_argument("--warmup", type=int, default=3, help="steps discarded before them")
    parser.add_argument("--cases", default=DEFAULT_CASES, help="schedule:micro_batches, comma-separated")
    parser.add_argument("--out", required=True, help="JSON results")
    parser.add_argument("--timeline-dir", help="also write each case's last step there")
    parser.add_argument("--no-pin", action="store_true", help="leave the ranks to the OS scheduler")
    parser.add_argument("--dim", type=int, default=ARGS.dim,
                        help="the model's width (ffn 3x): wider blocks make the host time per action a smaller share")
    opts = parser.parse_args()
    ARGS = dataclasses.replace(ARGS, dim=opts.dim, ffn_dim=3 * opts.dim)

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if world not in (2, 4):
        raise SystemExit(f"launch with torchrun --nproc_per_node 4 (or 2) (got {world} ranks)")
    core = None if opts.no_pin else pin_to_core(rank, world)
    env = DistEnv(rank=rank, world_size=world, local_rank=rank, device=torch.device("cpu"), local_world_size=world)
    mesh = device_mesh(env, pp=PP)
    torch.manual_seed(0)
    base = build(ARGS)
    base.init_weights(seed=7)

    p2p_s = one_way_send_s(rank)
    if rank == 0:
        print(f"one activation rank 0 -> 1: {p2p_s * 1e3:.3f} ms; rank 0 pinned to cpu {core}", flush=True)
    results = []
    host_s = None  # the first case's host time per action, which predicts the others ("calibrated")
    for schedule, m in parse_cases(opts.cases):
        result = run_case(base, mesh["pp"], schedule, m, opts.warmup, opts.steps, p2p_s, host_s)
        if rank == 0 and host_s is None:
            host_s = result["host_gap_s"]
            print(f"host time per action, calibrated on {schedule} m={m}: {host_s * 1e3:.3f} ms", flush=True)
        if rank == 0:
            print(f"{schedule} m={m}: measured {result['measured_bubble_share']:.1%}, model "
                  f"{result['predicted_bubble_share']:.1%}", flush=True)
            if opts.timeline_dir:
                Path(opts.timeline_dir).mkdir(parents=True, exist_ok=True)
                write(Path(opts.timeline_dir) / f"{schedule}-m{m}.json", result["timeline"])
            results.append({k: v for k, v in result.items() if k != "timeline"})
    if rank == 0:
        print()
        print_table(results)
        Path(opts.out).write_text(json.dumps({
            "date": datetime.date.today().isoformat(), "torch": torch.__version__, "cpus": os.cpu_count(),
            "ranks": world, "threads_per_rank": torch.get_num_threads(), "model": dataclasses.asdict(ARGS),
            "seq_len": T,
            "steps": opts.steps, "warmup": opts.warmup, "pinned": core is not None, "p2p_s": p2p_s,
            "command": f"torchrun --standalone --nproc_per_node {PP} bench/pp_bubble.py " + " ".join(sys.argv[1:]),
            "results": results}, indent=1) + "\n")
    destroy_process_groups()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()

"""Goodput under failures, on paper: disk checkpoints only, RAM snapshots only, and RAM snapshots with peer
replicas, from 8 to 16,384 GPUs, for a node MTBF and a share of failures that lose the node's RAM.

A model, not a run. It starts from what one H200 measured with the 1.4b (16.4 GB of state per rank; bench/RESULTS.md,
"Checkpoints that do not stop training") and scales each cost with the job:

- per interval: the save's blocking copy, plus a slowdown share of the training step while its background part
  (the disk write, or the replica's transfer) is in flight;
- per failure: the restart, the reload (from the node's RAM, from the peer's RAM over the link, or from shared
  storage) and the work lost since the newest state that could be recovered.

Each strategy takes its interval from Young/Daly (holotrain.plan.cluster.young_daly_interval_s) for the failures it
recovers from, bounded below by what it can do: a disk checkpoint cannot start before the previous one is written,
a RAM snapshot before its copy is done, a replica before its transfer is. The loss of each kind of recovery is
holotrain.plan.cluster.expected_loss_share; the kinds add up because each has its own interval and its own failures.

Failures: the job's MTBF is the node's over the nodes (8 GPUs a node). A share of them lose the node's RAM (the node
leaves the job and a spare takes its place); the rest are process failures on a node whose RAM survives.

- disk: every failure goes back to the newest disk checkpoint.
- ram: a process failure resumes from the snapshot in the node's RAM; a failure that lost a node's RAM goes back to
  disk, since the other ranks' snapshots are of no use without the lost node's part.
- ram+replica: as ram, but a lost node's ranks fetch their part from the peer node's replica (the same local rank on
  the next node, as holotrain/train/snapshots.py places it); only if the peer lost its RAM too within the window
  (its replica not yet rebuilt) does the job go back to disk. With one node the replica lives on the same node and
  protects nothing against losing it.

  python bench/failure_sim.py                     # markdown tables on stdout
  python bench/failure_sim.py --json OUT.json     # and every row as JSON
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from holotrain.plan.cluster import expected_loss_share, young_daly_interval_s
from holotrain.train.checkpointer import DISK_BYTES_S

STRATEGIES = ("disk", "ram", "ram+replica")
GPUS = (8, 64, 512, 2048, 16384)
MTBF_HOURS = (1000.0, 6335.0, 20000.0)
RAM_LOST_SHARES = (0.8, 0.5)
BYTES_PER_PARAM = 12  # a checkpoint's fp32 weights and two AdamW moments (train/checkpointer.py: save_blocking_s)

# Measured on one H200 with the 1.4b (bench/RESULTS.md, 2026-12-01 and 2026-12-04: copies behind the step).
MEASURED_STATE_GB = 16.4
MEASURED_DISK_BLOCK_S = 0.067  # 0.069 and 0.065 s for the saves at steps 100 and 200
# A snapshot's whole cost: at memory_every=50 the run made 0.994 of the tokens/s without (0.45 s more over steps
# 21-300 for 5 snapshots), of which 0.059-0.078 s a snapshot blocked; the rest is the copy's tail, waited for by
# the next update.
MEASURED_SNAPSHOT_BLOCK_S = 0.09
MEASURED_SNAPSHOT_LOAD_S = 4.7  # 3.5-4.7 s: the worst
MEASURED_WARM_RESTART_S = 26.0  # kill -9 to the first new step, snapshot load included: 18.9-26.0 s, the worst
MEASURED_COLD_RESTART_S = 45.0  # a fresh node, estimated: the cold first run's 38 s of start-up and the load
# 16,384 tokens a step at 61,159 tokens/s (the 300-step run without checkpoints, 2026-12-04).
MEASURED_STEP_S = 16384 / 61159
# Over steps 21-300 a save every 100 steps ran at 0.987 of the run without: 0.98 s more over 75 s, of which 0.13 s
# was the two saves' blocking; the rest, 0.85 s over the 29.3 s the two writes were in flight (and the copies'
# tails), is about 3%.
DERIVED_DISK_WRITE_SLOWDOWN = 0.03


@dataclass(frozen=True)
class Inputs:
    """Everything the model takes. The defaults are the measured figures above, or an assumption named in the
    --help text of its flag."""

    state_gb: float = MEASURED_STATE_GB  # per GPU
    model_params: float = 0.0  # > 0: a fixed model, its state (12 bytes a parameter) spread over the job's GPUs
    gpus_per_node: int = 8
    node_mtbf_hours: float = 6335.0  # Llama 3 (arXiv 2407.21783, section 3.3.4), as the cluster files say
    ram_lost_share: float = 0.8  # share of failures whose node leaves the job with its RAM
    step_s: float = MEASURED_STEP_S
    disk_block_s_per_gb: float = MEASURED_DISK_BLOCK_S / MEASURED_STATE_GB
    snapshot_block_s_per_gb: float = MEASURED_SNAPSHOT_BLOCK_S / MEASURED_STATE_GB
    snapshot_load_s_per_gb: float = MEASURED_SNAPSHOT_LOAD_S / MEASURED_STATE_GB
    disk_write_slowdown: float = DERIVED_DISK_WRITE_SLOWDOWN
    gpu_disk_gb_s: float = DISK_BYTES_S / 1e9  # one rank's rate into (and out of) storage, the planner's
    # The shared storage's aggregate rates: Llama 3's Tectonic sustained 2 TB/s for 16k GPUs (arXiv 2407.21783,
    # section 3.3.1; 7 TB/s at peak). Reading is assumed as fast as writing.
    storage_write_gb_s: float = 2000.0
    storage_read_gb_s: float = 2000.0
    warm_restart_s: float = MEASURED_WARM_RESTART_S - MEASURED_SNAPSHOT_LOAD_S  # the restart without the load
    cold_restart_s: float = MEASURED_COLD_RESTART_S - MEASURED_SNAPSHOT_LOAD_S
    rendezvous_s: float = 30.0  # assumed; more than one node: every restart re-forms the job's process groups
    replace_node_s: float = 120.0  # assumed; a node lost: finding a spare and bringing it into the job
    link_gbit_s: float = 400.0  # one NIC per GPU between nodes (configs/clusters/h200-*.toml)
    link_efficiency: float = 0.8  # assumed, as the cluster files do for collectives across nodes
    replica_slowdown: float = 0.05  # assumed: share of the step rate lost while a replica is in flight

    def gpu_state_gb(self, gpus: int) -> float:
        return self.model_params * BYTES_PER_PARAM / 1e9 / gpus if self.model_params else self.state_gb


@dataclass
class Recovery:
    """One way back after a failure, with the failures that take it (their own MTBF), the save that serves it (its
    cost per save and its interval, with the interval's floor), and per failure the restart, then the reload and
    the age of the newest state beyond the half interval (a save still in flight cannot be resumed from)."""

    mtbf_s: float
    save_s: float
    interval_s: float
    floor_s: float
    restart_s: float
    reload_s: float

    def loss(self) -> float:
        return expected_loss_share(self.save_s, self.interval_s, self.mtbf_s, self.restart_s + self.reload_s)


@dataclass
class Result:
    strategy: str
    gpus: int
    node_mtbf_hours: float
    ram_lost_share: float
    state_gb: float
    job_mtbf_s: float
    goodput: float
    loss_saves: float  # share of the wall clock in saves
    loss_failures: float  # share in restarts, reloads and work done again
    snapshot_every_s: float | None  # RAM snapshots (none for disk)
    disk_every_s: float  # disk checkpoints
    disk_floor_s: float  # the disk write at this scale: the disk interval's lower bound
    snapshot_floor_s: float | None
    disk_recovery_share: float  # share of failures that go back to disk
    wasted_per_failure_s: float  # mean restart + reload + lost work per failure
    restart_per_failure_s: float  # the restart's part of it
    used: str  # the layers in use: a strategy leaves off the ones that do not pay (see evaluate)


def _interval(save_s: float, mtbf_s: float, floor_s: float) -> float:
    """Young/Daly's interval, never under the strategy's floor."""
    return max(young_daly_interval_s(save_s, mtbf_s), floor_s)


def _mix(parts: list[tuple[float, float, float]]) -> tuple[float, float, float]:
    """Failure classes (rate, restart, reload) that share one way back, as one: their total rate and mean times."""
    rate = sum(r for r, _, _ in parts)
    if rate == 0:
        return 0.0, 0.0, 0.0
    return rate, sum(r * a for r, a, _ in parts) / rate, sum(r * b for r, _, b in parts) / rate


def _recovery(parts: list[tuple[float, float, float]], save_s: float, floor_s: float,
              interval_s: float | None = None) -> Recovery:
    rate, restart, reload = _mix(parts)
    mtbf_s = 1 / rate if rate > 0 else math.inf
    interval = interval_s if interval_s is not None else _interval(save_s, mtbf_s, floor_s)
    return Recovery(mtbf_s, save_s, interval, floor_s, restart, reload)


def evaluate(strategy: str, gpus: int, inp: Inputs = Inputs(), fallback: bool = True) -> Result:
    """The strategy's goodput on a job of `gpus` GPUs, to first order.

    Each strategy adds a layer to the one before (disk; RAM snapshots over disk checkpoints; replicas over the
    snapshots), and a job can always leave the new layer off. With `fallback` it does so where the layer costs more
    than it saves: a snapshot blocks about as long as a disk save, so where most failures lose the node and the job
    is small, snapshots that only serve the other failures do not pay for themselves. `used` says what was kept."""
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy {strategy!r}: one of {', '.join(STRATEGIES)}")
    own = _evaluate(strategy, gpus, inp)
    if fallback and strategy != "disk":
        simpler = evaluate(STRATEGIES[STRATEGIES.index(strategy) - 1], gpus, inp)
        if simpler.goodput > own.goodput:
            return dataclasses.replace(simpler, strategy=strategy)
    return own


def _evaluate(strategy: str, gpus: int, inp: Inputs) -> Result:
    nodes = max(1, math.ceil(gpus / inp.gpus_per_node))
    state = inp.gpu_state_gb(gpus)
    node_mtbf_s = inp.node_mtbf_hours * 3600
    rate = nodes / node_mtbf_s  # failures per second of the whole job
    lost_rate = rate * inp.ram_lost_share  # the node leaves the job with its RAM
    kept_rate = rate - lost_rate  # a process dies, the node and its RAM stay
    rendezvous = inp.rendezvous_s if nodes > 1 else 0.0
    # A node lost: the job waits for the spare (its cold start); a process failure: every node restarts warm.
    lost_restart = inp.cold_restart_s + inp.replace_node_s + rendezvous
    kept_restart = inp.warm_restart_s + rendezvous

    # Every rank writes to and reads from shared storage: each at its own rate, all of them at most at the
    # storage's aggregate rate, so a checkpoint of a large job takes longer to write and to read back.
    disk_write = max(state / inp.gpu_disk_gb_s, gpus * state / inp.storage_write_gb_s)
    disk_read = max(state / inp.gpu_disk_gb_s, gpus * state / inp.storage_read_gb_s)
    disk_save = state * inp.disk_block_s_per_gb + inp.disk_write_slowdown * disk_write
    disk_floor = max(disk_write, inp.step_s)  # one write at a time
    # The newest checkpoint is a write older than the last save's start: a failure mid-write resumes the one before.
    disk_reload = disk_read + disk_write

    block = state * inp.snapshot_block_s_per_gb
    load = state * inp.snapshot_load_s_per_gb
    transfer = state * 8 / (inp.link_gbit_s * inp.link_efficiency)  # seconds over the link per replica

    if strategy == "disk":
        disk = _recovery([(lost_rate, lost_restart, disk_reload), (kept_rate, kept_restart, disk_reload)],
                         disk_save, disk_floor)
        snapshot, disk_share = None, 1.0
    elif strategy == "ram":
        # The other ranks' snapshots are of no use without the lost node's part: those failures go to disk.
        snapshot = _recovery([(kept_rate, kept_restart, load + block)], block, max(block, inp.step_s))
        disk = _recovery([(lost_rate, lost_restart, disk_reload)], disk_save, disk_floor)
        disk_share = inp.ram_lost_share
    else:
        floor = max(block, transfer, inp.step_s)  # a snapshot's replica is sent before the next one starts
        snapshot_save = block + inp.replica_slowdown * transfer
        interval = _interval(snapshot_save, 1 / rate, floor)
        # The peer's replica is gone too if the peer lost its RAM while the lost node recovers, or shortly before,
        # while the replica slots it holds were not yet filled again (a restart, an interval and a transfer).
        # With one node the replica lives on the same node and goes with it.
        window = 2 * lost_restart + interval + transfer
        both = 1.0 if nodes == 1 else 1 - math.exp(-window * inp.ram_lost_share / node_mtbf_s)
        # A lost node's part comes back over the link; a replica can be resumed from only once it has arrived.
        from_peer = transfer + load + block + transfer
        snapshot = _recovery([(kept_rate, kept_restart, load + block),
                              (lost_rate * (1 - both), lost_restart, from_peer)], snapshot_save, floor, interval)
        disk = _recovery([(lost_rate * both, lost_restart, disk_reload)], disk_save, disk_floor)
        disk_share = inp.ram_lost_share * both

    recoveries = [r for r in (snapshot, disk) if r is not None and math.isfinite(r.mtbf_s)]
    loss = sum(r.loss() for r in recoveries)
    loss_saves = sum(r.save_s / r.interval_s for r in recoveries)
    wasted = sum((r.interval_s / 2 + r.restart_s + r.reload_s) / r.mtbf_s for r in recoveries) / rate
    restart = sum(r.restart_s / r.mtbf_s for r in recoveries) / rate
    return Result(
        strategy=strategy, gpus=gpus, node_mtbf_hours=inp.node_mtbf_hours, ram_lost_share=inp.ram_lost_share,
        state_gb=state, job_mtbf_s=1 / rate, goodput=max(0.0, 1 - loss), loss_saves=loss_saves,
        loss_failures=loss - loss_saves,
        snapshot_every_s=snapshot.interval_s if snapshot else None, disk_every_s=disk.interval_s,
        disk_floor_s=disk_write, snapshot_floor_s=snapshot.floor_s if snapshot else None,
        disk_recovery_share=disk_share, wasted_per_failure_s=wasted, restart_per_failure_s=restart, used=strategy)


# --------------------------------------------------------------------------------------------
# Tables


def _duration(s: float | None) -> str:
    if s is None:
        return "-"
    if not math.isfinite(s):
        return "never"
    if s < 10:
        return f"{s:.1f} s"
    if s < 120:
        return f"{s:.0f} s"
    if s < 2 * 3600:
        return f"{s / 60:.0f} min"
    return f"{s / 3600:.0f} h"


def _cell(r: Result) -> str:
    """Goodput and intervals; a strategy that left its layer off says which one it fell back to."""
    if r.used != r.strategy:
        return f"{r.goodput:.2%} (as {'RAM' if r.used == 'ram' else 'disk'})"
    if r.used == "disk":
        return f"{r.goodput:.2%} ({_duration(r.disk_every_s)})"
    if r.used == "ram":
        return f"{r.goodput:.2%} ({_duration(r.snapshot_every_s)} / {_duration(r.disk_every_s)})"
    return f"{r.goodput:.2%} ({_duration(r.snapshot_every_s)})"


def goodput_table(inp: Inputs, gpus: tuple[int, ...]) -> tuple[str, list[Result]]:
    """One markdown table: a row per job size, for each strategy its goodput and its intervals."""
    head = ("| GPUs | state/GPU | job MTBF | disk write | disk: goodput (every) | RAM: goodput (snapshot / disk every) "
            "| RAM + replica: goodput (snapshot every) | wasted per failure, disk / RAM / replica |")
    lines = [head, "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    rows = []
    for n in gpus:
        d, r, p = (evaluate(s, n, inp) for s in STRATEGIES)
        rows += [d, r, p]
        lines.append(
            f"| {n:,} | {d.state_gb:.1f} GB | {_duration(d.job_mtbf_s)} | {_duration(d.disk_floor_s)} "
            f"| {_cell(d)} | {_cell(r)} | {_cell(p)} "
            f"| {_duration(d.wasted_per_failure_s)} / {_duration(r.wasted_per_failure_s)} / "
            f"{_duration(p.wasted_per_failure_s)} |")
    return "\n".join(lines), rows


def summary_table(inp: Inputs, gpus: tuple[int, ...], mtbf_hours: tuple[float, ...]) -> str:
    """Goodput only: a row per job size, for each node MTBF disk / RAM / RAM + replica."""
    lines = ["| GPUs | " + " | ".join(f"node MTBF {h:,.0f} h: disk / RAM / replica" for h in mtbf_hours) + " |",
             "|---:|" + "---:|" * len(mtbf_hours)]
    for n in gpus:
        cells = []
        for h in mtbf_hours:
            case = dataclasses.replace(inp, node_mtbf_hours=h)
            cells.append(" / ".join(f"{evaluate(s, n, case).goodput:.2%}" for s in STRATEGIES))
        lines.append(f"| {n:,} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def sensitivity(inp: Inputs, gpus: int) -> tuple[str, list[dict]]:
    """The assumed inputs changed one at a time, at one job size."""
    cases = [
        ("as above", {}),
        ("replica link 25 Gb/s (gloo over TCP, not the NIC's rate)", {"link_gbit_s": 25.0}),
        ("replica slows the step by 25% while in flight", {"replica_slowdown": 0.25}),
        ("restart: rendezvous 300 s", {"rendezvous_s": 300.0}),
        ("no time to find a spare node", {"replace_node_s": 0.0}),
        ("storage 7 TB/s (Llama 3's peak)", {"storage_write_gb_s": 7000.0, "storage_read_gb_s": 7000.0}),
        ("storage 500 GB/s", {"storage_write_gb_s": 500.0, "storage_read_gb_s": 500.0}),
        ("disk write slows the step by 0%", {"disk_write_slowdown": 0.0}),
    ]
    lines = ["| change | disk | RAM | RAM + replica |", "|---|---:|---:|---:|"]
    out = []
    for name, change in cases:
        case = dataclasses.replace(inp, **change)
        g = [evaluate(s, gpus, case).goodput for s in STRATEGIES]
        lines.append(f"| {name} | {g[0]:.2%} | {g[1]:.2%} | {g[2]:.2%} |")
        out.append({"case": name, "change": change, **dict(zip(STRATEGIES, g))})
    return "\n".join(lines), out


def main(argv: list[str] | None = None) -> None:
    base = Inputs()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--gpus", type=int, nargs="+", default=list(GPUS))
    p.add_argument("--node-mtbf-h", type=float, nargs="+", default=list(MTBF_HOURS),
                   help="node MTBF in hours; 6335 is Llama 3's 419 interruptions in 54 days on 2,048 nodes")
    p.add_argument("--ram-lost-share", type=float, nargs="+", default=list(RAM_LOST_SHARES),
                   help="shares of failures that lose the node's RAM (Llama 3: 78%% of interruptions hardware)")
    p.add_argument("--state-gb", type=float, default=base.state_gb, help="training state per GPU (measured 1.4b)")
    p.add_argument("--model-params", type=float, default=0.0,
                   help="> 0: a fixed model instead, 12 bytes a parameter spread over the job (70.6e9 for a 70B)")
    p.add_argument("--step-s", type=float, default=base.step_s, help="a training step (the 1.4b's, measured)")
    p.add_argument("--gpu-disk-gb-s", type=float, default=base.gpu_disk_gb_s,
                   help="one rank's write and read rate to storage (the planner's DISK_BYTES_S)")
    p.add_argument("--storage-write-gb-s", type=float, default=base.storage_write_gb_s,
                   help="storage aggregate write rate (Llama 3's Tectonic: 2 TB/s sustained)")
    p.add_argument("--storage-read-gb-s", type=float, default=base.storage_read_gb_s,
                   help="storage aggregate read rate (assumed equal to the write rate)")
    p.add_argument("--disk-write-slowdown", type=float, default=base.disk_write_slowdown,
                   help="share of the step rate lost while a disk write is in flight (derived from measured totals)")
    p.add_argument("--rendezvous-s", type=float, default=base.rendezvous_s,
                   help="added to every restart of more than one node (assumed)")
    p.add_argument("--replace-node-s", type=float, default=base.replace_node_s,
                   help="added when a node is lost: a spare found and brought in (assumed)")
    p.add_argument("--link-gbit-s", type=float, default=base.link_gbit_s, help="per GPU between nodes (nominal)")
    p.add_argument("--link-efficiency", type=float, default=base.link_efficiency, help="of the link's rate (assumed)")
    p.add_argument("--replica-slowdown", type=float, default=base.replica_slowdown,
                   help="share of the step rate lost while a replica is in flight (assumed: not measured)")
    p.add_argument("--sensitivity-gpus", type=int, default=16384)
    p.add_argument("--sensitivity-mtbf-h", type=float, default=base.node_mtbf_hours)
    p.add_argument("--json", type=Path, help="write every row and the inputs here")
    a = p.parse_args(argv)

    inp = dataclasses.replace(
        base, state_gb=a.state_gb, model_params=a.model_params, step_s=a.step_s, gpu_disk_gb_s=a.gpu_disk_gb_s,
        storage_write_gb_s=a.storage_write_gb_s, storage_read_gb_s=a.storage_read_gb_s,
        disk_write_slowdown=a.disk_write_slowdown, rendezvous_s=a.rendezvous_s, replace_node_s=a.replace_node_s,
        link_gbit_s=a.link_gbit_s, link_efficiency=a.link_efficiency, replica_slowdown=a.replica_slowdown,
        node_mtbf_hours=a.sensitivity_mtbf_h, ram_lost_share=a.ram_lost_share[0])
    what = (f"a {a.model_params / 1e9:g}B-parameter model's state spread over the job" if a.model_params
            else f"{a.state_gb:g} GB of state per GPU at every size")
    for share in a.ram_lost_share:
        print(f"\n**Goodput, {share:.0%} of failures lose the node's RAM; {what}.**\n")
        print(summary_table(dataclasses.replace(inp, ram_lost_share=share), tuple(a.gpus), tuple(a.node_mtbf_h)))
    rows: list[Result] = []
    for share in a.ram_lost_share:
        for mtbf in a.node_mtbf_h:
            case = dataclasses.replace(inp, node_mtbf_hours=mtbf, ram_lost_share=share)
            table, got = goodput_table(case, tuple(a.gpus))
            rows += got
            print(f"\n**Node MTBF {mtbf:,.0f} h, {share:.0%} of failures lose the node's RAM; {what}.**\n")
            print(table)
    print(f"\n**Assumptions changed one at a time: {a.sensitivity_gpus:,} GPUs, node MTBF "
          f"{inp.node_mtbf_hours:,.0f} h, {inp.ram_lost_share:.0%} lose RAM.**\n")
    table, sens = sensitivity(inp, a.sensitivity_gpus)
    print(table)
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps({"inputs": dataclasses.asdict(inp), "rows": [dataclasses.asdict(r) for r in rows],
                                      "sensitivity": sens}, indent=1))


if __name__ == "__main__":
    main()

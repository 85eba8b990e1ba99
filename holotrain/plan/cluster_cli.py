"""`holotrain plan --cluster FILE | NAME`: a job planned for a cluster it is not running on. The job's config gives the
model, data.seq_len and training.batch_size (the global batch, in sequences); plan/cluster.py's plan_cluster predicts
every layout of it on the cluster file's GPUs; the best are printed, and the chosen one written as an overlay,
plan.toml, for `holotrain train --plan plan.toml` on that cluster, with every layout evaluated in plan.json.

Nothing runs here: no trial, no measurement of this machine. A cluster plan names its cluster, and `train --plan`
takes it only where the run is that cluster's (as many ranks, the same GPU): anywhere else it is refused in one line
(refuse_off_cluster)."""

from __future__ import annotations

import dataclasses
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

from holotrain.config import Config, ConfigError, parse_overrides
from holotrain.plan.cluster import (
    Cluster,
    ClusterCandidate,
    load_cluster,
    plan_cluster,
    young_daly_interval_s,
)
from holotrain.plan.moe import describe_moe
from holotrain.plan.planner import job_config, job_signature, read_overlay
from holotrain.train.resolve import model_args

# The step's phases (plan/cluster.py's) grouped as the table shows them: compute, exposed communication, the
# pipeline's bubble, and the checkpoint saves' blocking time spread over the steps between them.
SPLIT = {"compute": ("compute", "optimizer"), "comm": ("tp", "cp", "ep", "fsdp", "pp_p2p"), "bubble": ("bubble",),
         "save": ("checkpoint",)}


def shipped_clusters() -> dict[str, Path]:
    """The cluster files shipped inside the package (holotrain/configs/clusters/*.toml), by name."""
    from importlib.resources import files

    folder = files("holotrain") / "configs" / "clusters"
    return {Path(str(f)).stem: Path(str(f)) for f in folder.iterdir() if str(f).endswith(".toml")}


def find_cluster(name_or_path: str | Path) -> Path:
    """A cluster file: a path, or the name of a shipped one ("h200-64" or "h200-64.toml")."""
    path = Path(name_or_path)
    if path.is_file():
        return path
    shipped = shipped_clusters()
    if path.parent == Path(".") and path.name.removesuffix(".toml") in shipped:
        return shipped[path.name.removesuffix(".toml")]
    raise ConfigError(f"cluster file not found: {name_or_path} (shipped clusters, by name: "
                      f"{', '.join(sorted(shipped))})")


def overlay(c: ClusterCandidate) -> dict:
    """The config sections that set up a candidate's layout. dp is what the launch's ranks leave over tp x cp x pp."""
    lay = c.layout
    piped = lay.pp > 1
    out = {"parallel": {"tp": lay.tp, "cp": lay.cp, "pp": lay.pp, **({"ep": lay.ep} if c.moe else {}),
                        # Without a pipeline the schedule keys keep their defaults: the accumulation follows from
                        # training.micro_batch_size.
                        "pp_schedule": lay.schedule if piped else "auto",
                        "pp_microbatches": lay.micro_batches if piped else 0},
           # The prediction takes the blocks compiled, except under the zero-bubble schedules, which torch runs eager.
           "training": {"micro_batch_size": lay.micro, "compile": lay.compiled},
           # The prediction applies the checkpointing policy to every block.
           "memory": {"activation_checkpointing": lay.ac, "activation_checkpointing_blocks": 0}}
    if c.checkpoint_interval_steps:  # 0: the cluster file models no failures, and the job's own interval stays
        out["checkpoint"] = {"every": c.checkpoint_interval_steps}
    return out


def _flat(sections: dict) -> dict:
    return {f"{s}.{k}": v for s, kv in sections.items() for k, v in kv.items()}


def held_settings(cfg: Config, overrides: list[str]) -> dict:
    """The layout's settings the command line gives (`--parallel.tp=8`): the plan keeps them and chooses the rest.
    "auto" and 0 (the micro-batch, the pipeline's micro-batches) are left to the plan."""
    chosen = {"parallel.tp", "parallel.cp", "parallel.pp", "parallel.ep", "parallel.pp_schedule",
              "parallel.pp_microbatches",
              "training.micro_batch_size", "training.compile", "memory.activation_checkpointing"}
    held = {}
    for section, key, _ in parse_overrides(overrides):
        name, value = f"{section}.{key}", getattr(getattr(cfg, section), key, None)
        if name == "memory.activation_checkpointing" and isinstance(value, bool):
            value = "full" if value else "none"
        unset = value == "auto" or (name in ("training.micro_batch_size", "parallel.pp_microbatches") and value == 0)
        if name in chosen and not unset:
            held[name] = value
    return held


@dataclass
class ClusterPlan:
    cluster: Cluster
    cluster_file: Path
    signature: str  # the job, at the cluster's ranks (as `train --plan` checks it there)
    candidates: list[ClusterCandidate]  # the fitting ones, fastest first, then the rejected
    seconds: float

    @property
    def chosen(self) -> ClusterCandidate:
        return self.candidates[0]

    @property
    def launch(self) -> str:
        c = self.cluster
        return f"torchrun --nnodes {c.nodes} --nproc_per_node {c.gpus_per_node} -m holotrain.cli train"


def make_cluster_plan(config: str | None, overrides: list[str], cluster: str | Path, out_dir: Path
                      ) -> ClusterPlan:
    """Plans the job for the cluster (a file, or a shipped cluster's name) and writes out_dir/plan.toml and
    out_dir/plan.json."""
    t0 = time.perf_counter()
    cfg = job_config(config, overrides)
    path = find_cluster(cluster)
    cl = load_cluster(path)
    seq = cfg.data.seq_len
    evaluated = plan_cluster(model_args(cfg), cl, seq, cfg.training.batch_size * seq, include_rejected=True)
    held = held_settings(cfg, overrides)
    kept = [c for c in evaluated if all(_flat(overlay(c)).get(k, v) == v for k, v in held.items())]
    signature = job_signature(cfg, cl.gpus)
    if not kept:
        given = ", ".join(f"{k}={v}" for k, v in held.items())
        raise ConfigError(f"no layout of this job ({signature}) on the cluster {cl.name} ({cl.gpus} GPUs)"
                          + (f" keeps {given}" if held else ": training.batch_size does not split over them"))
    if not kept[0].fits:
        least = min(kept, key=lambda c: c.memory_bytes)
        raise ConfigError(f"nothing fits on the cluster {cl.name}: of {len(kept)} layouts of this job ({signature}), "
                          f"the smallest {least.why_not} ({least.layout.label}). Use more nodes, a smaller "
                          "training.batch_size or data.seq_len, or a smaller model")
    plan = ClusterPlan(cl, path, signature, kept, time.perf_counter() - t0)
    write_cluster_plan(plan, out_dir)
    return plan


def _split(c: ClusterCandidate) -> dict[str, float]:
    return {part: sum(c.phases.get(p, 0.0) for p in phases) for part, phases in SPLIT.items()}


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None


def candidate_dict(c: ClusterCandidate) -> dict:
    """One layout as plan.json holds it: "predicted" has the keys the report reads from a one-machine plan."""
    predicted = {"fits": c.fits, "why_not": c.why_not, "gpu_gb": c.memory_bytes / 1e9,
                 "memory_gb": {k: v / 1e9 for k, v in c.memory.items()}}
    if c.fits:
        predicted.update({"step_s": c.step_s, "tokens_per_s": c.tokens_per_s, "mfu": c.mfu,
                          "split_s": _split(c), "phases_s": dict(c.phases), "bubble_share": c.bubble_share,
                          "bubble_simulated": c.simulated})
    checkpoint = {"save_s": c.save_s, "write_s": c.write_s, "interval_s": _finite(c.checkpoint_interval_s),
                  "every": c.checkpoint_interval_steps, "goodput_loss": c.goodput_loss}
    return {"label": c.layout.label, "layout": dataclasses.asdict(c.layout), "predicted": predicted,
            "checkpoint": checkpoint if c.fits else None, "moe": c.moe.as_dict() if c.moe else None}


def _checkpoint_note(plan: ClusterPlan) -> str:
    c, cl = plan.chosen, plan.cluster
    if not c.checkpoint_interval_steps:
        return "no failures modelled (the cluster file gives no node_mtbf_hours): checkpoint.every is the job's"
    optimum = young_daly_interval_s(c.save_s, cl.job_mtbf_hours * 3600)
    # One background write at a time: a node's write of its ranks' state can outlast the optimum.
    bound = (f", no sooner than a node's background write ({c.write_s:.0f} s)"
             if c.checkpoint_interval_s > optimum else "")
    return (f"Young/Daly: {c.save_s:.2f} s per save, job MTBF {cl.job_mtbf_hours:.0f} h ({cl.node_mtbf_hours:g} h a "
            f"node over {cl.nodes}): every {c.checkpoint_interval_s / 60:.1f} min{bound} = "
            f"{c.checkpoint_interval_steps} steps, {c.goodput_loss:.2%} of the wall clock lost to saves and failures")


def write_cluster_plan(plan: ClusterPlan, out_dir: Path) -> None:
    import tomli_w

    out_dir.mkdir(parents=True, exist_ok=True)
    c, cl = plan.chosen, plan.cluster
    planned = {"machine": cl.machine.fingerprint, "job": plan.signature, "cluster": cl.name,
               "cluster_file": str(plan.cluster_file), "gpu": cl.machine.name, "nodes": cl.nodes,
               "gpus_per_node": cl.gpus_per_node,
               "layout": c.layout.label, "predicted_step_s": round(c.step_s, 4),
               "predicted_tokens_per_s": round(c.tokens_per_s, 1), "predicted_mfu": round(c.mfu or 0.0, 4),
               "checkpoint_interval": _checkpoint_note(plan)}
    header = (f"# holotrain plan for the cluster {cl.name} ({plan.cluster_file}): {cl.nodes} nodes x "
              f"{cl.gpus_per_node} {cl.machine.name}, {cl.gpus} ranks.\n"
              "# It is for that cluster, not for the machine that wrote it: apply it there, on every rank,\n"
              f"#   {plan.launch} --plan plan.toml\n")
    (out_dir / "plan.toml").write_text(header + tomli_w.dumps({"planned": planned, **overlay(c)}))
    rows = [{**candidate_dict(x), "chosen": x is c} for x in plan.candidates]
    (out_dir / "plan.json").write_text(json.dumps({
        "planned": planned, "overlay": overlay(c), "cluster": dataclasses.asdict(cl),
        "seconds": round(plan.seconds, 1), "candidates": rows}))  # thousands of layouts: no indentation


def print_cluster_table(plan: ClusterPlan, limit: int = 12) -> None:
    from rich.console import Console
    from rich.table import Table

    cl = plan.cluster
    fits = [c for c in plan.candidates if c.fits]
    table = Table(title=f"holotrain plan: {plan.signature} on the cluster {cl.name} ({cl.nodes} x {cl.gpus_per_node} "
                        f"{cl.machine.name})")
    for col in ("dp x tp x cp x pp", "schedule", "micro", "ac", "step s", "compute", "comm", "bubble", "save", "MFU",
                "GB/GPU", "ckpt every"):
        table.add_column(col, justify="left" if col in ("dp x tp x cp x pp", "schedule", "ac") else "right")
    for c in fits[:limit]:
        lay, split = c.layout, _split(c)
        table.add_row(("* " if c is plan.chosen else "  ") + f"{lay.dp} x {lay.tp} x {lay.cp} x {lay.pp}"
                      + (f" (ep {lay.ep})" if lay.ep > 1 else ""),
                      ("-" if lay.pp == 1 else lay.schedule) + ("" if lay.compiled else " (eager)"),
                      f"{lay.micro} x {lay.micro_batches}",
                      lay.ac, f"{c.step_s:.3f}", *(f"{split[k]:.3f}" for k in SPLIT), f"{c.mfu:.1%}",
                      f"{c.memory_bytes / 1e9:.0f}", str(c.checkpoint_interval_steps or "-"))
    console = Console()
    if not console.is_terminal:  # a log file: no wrapping
        console = Console(width=150)
    console.print(table)
    c = plan.chosen
    console.print(f"chosen: {c.layout.label}; {c.tokens_per_s:,.0f} tokens/s ({c.tokens_per_s_per_gpu:,.0f} a GPU)",
                  soft_wrap=True)
    if c.moe:
        console.print(describe_moe(c.moe), soft_wrap=True)
    console.print(f"checkpoint: {_checkpoint_note(plan)}", soft_wrap=True)
    console.print(f"{len(plan.candidates)} layouts, {len(fits)} fit (the others need more than "
                  f"{cl.machine.gpu_memory / 1e9:.0f} GB a GPU); planned in {plan.seconds:.1f} s", soft_wrap=True)
    console.print(f"for the cluster, not this machine: {plan.launch} --plan plan.toml", soft_wrap=True)


def refuse_off_cluster(path: Path, world_size: int, machine_fingerprint: str) -> None:
    """`train --plan`: a cluster plan is taken only by a run of its cluster's ranks on its GPU; elsewhere, one
    line saying where it belongs. Other plans pass (planner.plan_overrides checks them)."""
    planned, _ = read_overlay(path)
    if "cluster" not in planned:
        return
    nodes, per_node = int(planned.get("nodes", 1)), int(planned.get("gpus_per_node", 1))
    if world_size != nodes * per_node or machine_fingerprint != planned["machine"]:
        gpu = planned.get("gpu", planned["machine"])
        raise ConfigError(f"--plan {path} is for the cluster {planned['cluster']} ({nodes} nodes x {per_node} {gpu}), "
                          f"not this run ({world_size} rank(s) on {machine_fingerprint}): apply it there, torchrun "
                          f"--nnodes {nodes} --nproc_per_node {per_node} -m holotrain.cli train --plan {path.name}")

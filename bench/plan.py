"""The planner's cost model and its choice against measurement, through `holotrain train` (the real corpus, the
shipped config's clipping) in the same run.

  sweep       each point of a list (a shipped config and settings) predicted, then trained for --steps steps as a
              planner trial is; the prediction is taken twice: from the priors alone, and calibrated by the points
              of the same job measured before it (the planner's own rule, holotrain/plan/planner.py: calibrate).
              Peak memory (GPU; host RSS on a CPU) and step time, predicted against measured.
  exhaustive  `holotrain plan` on a job (timed, as a user runs it), then every candidate it found fitting trained
              for --steps steps: the planned setting's tokens/s against the best of them all. --where narrows the
              candidates by their settings (section.key=value, repeatable) where the whole space would take too long;
              --neighbours to those one change away from the planned setting.
              --repeats N measures each candidate N times, in rounds over all of them, and takes the median (the
              steps of one setting on a CPU vary by 10-15% from run to run).

Points: --points h200 (125m, 1.4b and the 7B offload config over activation checkpointing, micro-batches 1-16,
offload ratios 0 / 0.5 / 1 and FP8) or cpu (the embedded default job). Rows are appended to OUT/rows.jsonl as they
finish; the summary is printed and written to OUT/summary.json.

  python bench/plan.py sweep --points cpu --out /tmp/plan-sweep
  python bench/plan.py exhaustive --repeats 3 --out /tmp/plan-exhaustive    # the embedded default job
  python bench/plan.py exhaustive --config 1.4b --where training.compile=true --out /tmp/plan-14b
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from holotrain.config import batch_layout
from holotrain.plan.cost import Calibration, Machine, Prediction, predict, with_settings
from holotrain.plan.planner import PLANNED_KEYS, Candidate, calibrate, prediction_dict, prepare
from holotrain.plan.trials import Measured, as_override, run_trial

_AC_NONE = {"memory.activation_checkpointing": "none"}
_NO_OFFLOAD = {"memory.offload": False}
# (config, settings): each a run the memory and time models are checked on.
POINTS = {
    "h200": [
        ("125m", {"training.micro_batch_size": 8, **_AC_NONE}),
        ("125m", {"training.micro_batch_size": 32, **_AC_NONE}),
        ("125m", {"training.micro_batch_size": 16, "memory.activation_checkpointing": "full"}),
        ("1.4b", {"training.micro_batch_size": 8, **_AC_NONE}),
        ("1.4b", {"training.micro_batch_size": 1, **_AC_NONE}),
        ("1.4b", {"training.micro_batch_size": 4, **_AC_NONE}),
        ("1.4b", {"training.micro_batch_size": 8, "memory.activation_checkpointing": "selective"}),
        ("1.4b", {"training.micro_batch_size": 8, "memory.activation_checkpointing": "full"}),
        ("1.4b", {"training.batch_size": 16, "training.micro_batch_size": 16, **_AC_NONE,
                  "memory.loss_chunk_tokens": 8192}),
        ("1.4b", {"training.micro_batch_size": 8, **_AC_NONE, "training.fp8": "tensorwise"}),
        ("1.4b", {"training.micro_batch_size": 8, **_AC_NONE, "memory.offload": True, "memory.offload_ratio": 0.5}),
        ("1.4b", {"training.micro_batch_size": 8, **_AC_NONE, "memory.offload": True, "memory.offload_ratio": 1.0}),
        ("offload", {"training.micro_batch_size": 8, "memory.offload_ratio": 1.0}),
        ("offload", {"training.micro_batch_size": 8, "memory.offload_ratio": 0.5}),
        ("offload", {"training.micro_batch_size": 8, **_NO_OFFLOAD, "training.fp8": "tensorwise"}),
    ],
    "cpu": [
        (None, {"training.micro_batch_size": 16, **_AC_NONE}),
        (None, {"training.micro_batch_size": 4, **_AC_NONE}),
        (None, {"training.micro_batch_size": 1, **_AC_NONE}),
        (None, {"training.micro_batch_size": 8, "memory.activation_checkpointing": "selective"}),
        (None, {"training.micro_batch_size": 16, "memory.activation_checkpointing": "full"}),
        (None, {"training.micro_batch_size": 2, "memory.activation_checkpointing": "full"}),
    ],
}


def _candidate(cfg, settings: dict) -> Candidate:
    full = with_settings(cfg, settings)
    micro, accum = batch_layout(full, 1)
    # Completed from its config: labelled, predicted and calibrated as the planner's one-process candidate would be.
    complete = {k: getattr(getattr(full, k.split(".")[0]), k.split(".")[1]) for k in PLANNED_KEYS
                if not k.startswith("parallel.")}
    return Candidate({**complete, **settings}, micro, accum)


def _append(out: Path, row: dict) -> None:
    with open(out / "rows.jsonl", "a") as f:
        f.write(json.dumps(row) + "\n")


def _error(predicted: float | None, measured: float | None) -> float | None:
    return None if not predicted or not measured else predicted / measured - 1


class _Checker:
    """Predicts each point of a sweep from the priors and calibrated by the points of the same job measured before
    it, compares with its measurement, then calibrates with it (the planner's own rule)."""

    def __init__(self, overrides: list[str], machine: Machine | None = None, fp8_gains: dict | None = None):
        self.overrides, self.machine, self.fp8_gains = overrides, machine, fp8_gains or {}
        self.jobs: dict = {}  # config -> [cfg, model, machine, calibration, FP8's probed gain, points so far]
        self.rows: list[dict] = []

    def predict(self, config: str | None, settings: dict) -> tuple[Candidate, Prediction]:
        """The point as a candidate, predicted with the job's calibration so far, and its prior prediction."""
        if config not in self.jobs:
            cfg, model, machine, calib = prepare(config, self.overrides, self.machine,
                                                 # a replayed job without FP8 points needs no probe
                                                 self.fp8_gains.get(config, 1.0 if self.machine else None))
            self.jobs[config] = [cfg, model, machine, calib, calib.fp8_gain, 0]
        cfg, model, machine, calib, probed_gain, _ = self.jobs[config]
        c = _candidate(cfg, settings)
        prior = predict(model, with_settings(cfg, c.settings), machine, Calibration(fp8_gain=probed_gain), c.micro,
                        c.accum)
        c.predicted = self._repredict(config, c)
        return c, prior

    def _repredict(self, config: str | None, c: Candidate) -> Prediction:
        cfg, model, machine, calib, *_ = self.jobs[config]
        return predict(model, with_settings(cfg, c.settings), machine, calib, c.micro, c.accum)

    def check(self, config: str | None, settings: dict, c: Candidate, prior: Prediction, m: Measured) -> dict:
        _, _, machine, calib, probed_gain, measured_before = self.jobs[config]
        c.measured = m
        gb = c.predicted.gpu_bytes if machine.device == "cuda" else c.predicted.host_bytes
        row = {"config": config or "default", "label": c.label, "settings": settings,
               "measured_before": measured_before, "machine": dataclasses.asdict(machine), "fp8_gain": probed_gain,
               "prior": prediction_dict(prior), "calibrated": prediction_dict(c.predicted),
               "measured": dataclasses.asdict(m), "memory_error": _error(gb / 1e9, m.peak_gb),
               "host_error": _error(c.predicted.host_bytes / 1e9, m.host_gb),
               "step_error_prior": _error(prior.step_s, m.step_s),
               "step_error_calibrated": _error(c.predicted.step_s, m.step_s)}
        if not m.error:
            calibrate(calib, c, machine, lambda cand: self._repredict(config, cand))
            self.jobs[config][-1] += 1
        host = f"; host {c.predicted.host_bytes / 1e9:.1f} / {m.host_gb:.1f} GB" if m.host_gb else ""
        print(f"    memory {gb / 1e9:.1f} GB predicted / {m.peak_gb or 0:.1f} measured{host}; step "
              f"{prior.step_s:.3f} s prior / {c.predicted.step_s:.3f} calibrated / {m.step_s or 0:.3f} measured"
              f"{'  ' + m.error if m.error else ''}", flush=True)
        self.rows.append(row)
        return row

    def summary(self) -> dict:
        ok = [r for r in self.rows if not r["measured"]["error"]]
        memory = [abs(r["memory_error"]) for r in ok if r["memory_error"] is not None]
        # A job's first point has nothing measured before it: its calibrated prediction is the prior.
        later = [abs(r["step_error_calibrated"]) for r in ok if r["measured_before"]]
        return {"points": len(self.rows), "ran": len(ok), "device": ok[0]["machine"]["name"] if ok else None,
                "memory_within_10pct": f"{sum(e <= 0.10 for e in memory)} of {len(memory)}",
                "memory_worst": max(memory, default=None),
                "step_calibrated_within_10pct": f"{sum(e <= 0.10 for e in later)} of {len(later)}",
                "step_calibrated_worst": max(later, default=None),
                "step_prior_worst": max((abs(r["step_error_prior"]) for r in ok), default=None)}


def sweep(args) -> dict:
    checker = _Checker(args.overrides)
    points = [(c, s) for c, s in POINTS[args.points] if not args.configs or (c or "default") in args.configs]
    if args.only:
        points = [points[i - 1] for i in args.only]
    for i, (config, settings) in enumerate(points):
        c, prior = checker.predict(config, settings)
        print(f"[{i + 1}/{len(points)}] {config or 'default'}: {c.label}", flush=True)
        m = run_trial(config, args.overrides, settings, args.steps, args.out / "trial", args.timeout)
        _append(args.out, checker.check(config, settings, c, prior, m))
    return checker.summary()


def replay(args) -> dict:
    """The rows of earlier runs (sweep rows, or any rows with config, settings and measured), in the order given,
    predicted and calibrated by the cost model as it is now, on the machine they recorded (or --machine)."""
    recorded = [json.loads(line) for path in args.rows for line in path.read_text().splitlines() if line.strip()]
    machine = None
    if args.machine or "machine" in recorded[0]:
        machine = Machine(**(json.loads(args.machine.read_text()) if args.machine else recorded[0]["machine"]))
    gains = {k: float(v) for k, _, v in (g.partition("=") for g in args.fp8_gain)}
    for r in recorded:
        if r.get("fp8_gain"):
            gains.setdefault(r.get("config", args.config), r["fp8_gain"])
    checker = _Checker(args.overrides, machine, gains)
    for i, r in enumerate(recorded):
        config = r.get("config", args.config)
        config = None if config == "default" else config
        c, prior = checker.predict(config, r["settings"])
        print(f"[{i + 1}/{len(recorded)}] {config or 'default'}: {c.label}", flush=True)
        known = {f.name for f in dataclasses.fields(Measured)}
        _append(args.out, checker.check(config, r["settings"], c, prior,
                                        Measured(**{k: v for k, v in r["measured"].items() if k in known})))
    return checker.summary()


def _matches(settings: dict, where: list[str]) -> bool:
    """Whether settings meet every clause section.key=value; value may list alternatives: a|b."""
    for clause in where:
        key, _, values = clause.partition("=")
        if as_override(key, settings.get(key)) not in {f"--{key}={v}" for v in values.split("|")}:
            return False
    return True


def _changes(a: dict, b: dict) -> int:
    """How many keys two settings differ in; a ratio only counts between settings that offload."""
    keys = [k for k in a if k != "memory.offload_ratio" or (a.get("memory.offload") and b.get("memory.offload"))]
    return sum(a[k] != b.get(k) for k in keys)


def exhaustive(args) -> dict:
    if args.plan_json:  # a plan made earlier on this machine (an exhaustive check split over several calls)
        plan, plan_s = json.loads(args.plan_json.read_text()), None
    else:
        started = time.perf_counter()
        cmd = [sys.executable, "-m", "holotrain.cli", "plan", "--out", str(args.out / "plan")]
        cmd += (["--config", args.config] if args.config else []) + args.overrides
        proc = subprocess.run(cmd, capture_output=True, text=True)
        plan_s = time.perf_counter() - started
        (args.out / "plan.log").write_text(proc.stdout + proc.stderr)
        if proc.returncode:
            sys.exit(f"holotrain plan failed (exit {proc.returncode}); see {args.out / 'plan.log'}")
        plan = json.loads((args.out / "plan" / "plan.json").read_text())
    print(f"holotrain plan: {plan_s or 0:.0f} s; chosen {next(c['label'] for c in plan['candidates'] if c['chosen'])}",
          flush=True)
    fitting = [c for c in plan["candidates"] if c["predicted"]["fits"] and _matches(c["settings"], args.where)]
    chosen = next(c for c in plan["candidates"] if c["chosen"])
    if args.neighbours:
        # The settings one change away from the planned one: every other value of each key the plan chose.
        fitting = [c for c in fitting if _changes(c["settings"], chosen["settings"]) == 1]
    if chosen not in fitting and not args.plan_json:
        fitting.insert(0, chosen)  # the chosen one is always measured beside the others (in the call that plans)
    # Each candidate --repeats times, in rounds over all of them (a machine's drift reaches every candidate alike);
    # a candidate's figure is the median of its passes.
    passes: dict[int, list] = {i: [] for i in range(len(fitting))}
    for round_ in range(args.repeats):
        for i, c in enumerate(fitting):
            print(f"[pass {round_ + 1}/{args.repeats}, {i + 1}/{len(fitting)}] {c['label']}", flush=True)
            m = run_trial(args.config, args.overrides, c["settings"], args.steps, args.out / "trial", args.timeout)
            print(f"    {m.tokens_per_s or 0:,.0f} tokens/s measured ({c['predicted']['tokens_per_s']:,.0f} "
                  f"predicted){'  ' + m.error if m.error else ''}", flush=True)
            _append(args.out, {"label": c["label"], "settings": c["settings"], "chosen": c["chosen"], "pass": round_,
                               "predicted_tokens_per_s": c["predicted"]["tokens_per_s"],
                               "measured": dataclasses.asdict(m)})
            passes[i].append(m.tokens_per_s)
    rates = {i: statistics.median(ok) for i, runs in passes.items() if (ok := [r for r in runs if r])}
    best = max(rates, key=rates.get)
    planned = next((i for i, c in enumerate(fitting) if c["chosen"]), None)
    return {"plan_seconds": plan_s and round(plan_s, 1), "candidates_measured": len(rates), "repeats": args.repeats,
            "where": args.where, "neighbours": args.neighbours, "planned": chosen["label"],
            "planned_tokens_per_s": rates.get(planned),
            "best": fitting[best]["label"], "best_tokens_per_s": rates[best],
            "planned_over_best": rates[planned] / rates[best] if planned in rates else None,
            "spread_of_a_candidate": max((max(r) / min(r) - 1 for r in passes.values() if all(r) and len(r) > 1),
                                         default=None)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mode", choices=("sweep", "exhaustive", "replay"))
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--points", choices=sorted(POINTS), default="cpu", help="sweep: the list of points")
    parser.add_argument("--configs", type=lambda v: v.split(","), default=None,
                        help="sweep: only the points of these configs (comma-separated), e.g. to split it over calls")
    parser.add_argument("--only", type=lambda v: [int(i) for i in v.split(",")], default=None,
                        help="sweep: only these points (1-based, after --configs)")
    parser.add_argument("--config", default=None, help="exhaustive: the job's config (default: the embedded one)")
    parser.add_argument("--where", action="append", default=[],
                        help="exhaustive: section.key=value, or section.key=a|b for either")
    parser.add_argument("--plan-json", type=Path, help="exhaustive: measure the candidates of this plan.json "
                        "instead of planning")
    parser.add_argument("--steps", type=int, default=8, help="steps per point (the later half is timed)")
    parser.add_argument("--neighbours", action="store_true",
                        help="exhaustive: only the settings one change away from the planned one (every other value "
                             "of each key), where the whole space would take too long")
    parser.add_argument("--repeats", type=int, default=1, help="exhaustive: passes over the candidates (median)")
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--rows", type=Path, nargs="+", default=[], help="replay: rows.jsonl files, in order")
    parser.add_argument("--machine", type=Path, default=None,
                        help="replay: the machine (JSON of plan.cost.Machine) where the rows do not record it")
    parser.add_argument("--fp8-gain", action="append", default=[],
                        help="replay: CONFIG=GAIN, FP8's probed gain for a job whose rows do not record it")
    parser.add_argument("overrides", nargs="*", help="--section.key=value for every run")
    args, unknown = parser.parse_known_args()
    args.overrides = args.overrides + unknown
    args.out.mkdir(parents=True, exist_ok=True)
    summary = {"sweep": sweep, "exhaustive": exhaustive, "replay": replay}[args.mode](args)
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()

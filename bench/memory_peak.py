"""Where a training run's GPU memory peaks, and what is alive then.

Records the CUDA caching allocator's history (torch.cuda.memory._record_memory_history) through a short
`holotrain train` run in this process, replays the allocations and frees, and prints the peak, the stack of the
allocation that reached it, and the live memory at that moment grouped by the line of code that allocated it
(compiled code is named by its generated file and line, with the line's text). Writes OUT/peak.txt, and
OUT/snapshot.pickle for https://pytorch.org/memory_viz when --keep-snapshot is given.

Usage (GPU machine, repo root):
  python3 bench/memory_peak.py OUT_DIR [--keep-snapshot] -- --config 1.4b --training.batch_size=16 --training.steps=3

Long context: the memory plan and the time model against measurement at each sequence length, batch 1 (one GPU call):
  python3 bench/memory_peak.py OUT_DIR --seq-lens 8192,32768,131072
Each sequence length and checkpointing policy (--ac, default none,full; one the plan says does not fit is skipped) is
one `holotrain train` process (--config 1.4b unless the arguments after `--` name another, --steps 6 steps, micro-batch
1, the embedded corpus): its peak is torch.cuda.max_memory_allocated, its step time the mean of its later steps less
compilation (the planner's trial rule), and the document ids its micro-batches carried give the attention work the
prediction is made for (plan/attention.py: the share of micro-batches masked, and the share of the causal triangle
their block mask visits). Printed per run, and written to OUT_DIR/long.jsonl: the plan's peak GB against the measured,
the prior's and the calibrated step time against the measured (calibrated: by the runs before it, the planner's own
rule), and the predicted parts of each. If one call cannot hold all of them, give one length per call: --seq-lens 131072.
--docs long trains on one long document of random tokens instead: every micro-batch then takes the dense causal kernel
(attention over the whole causal triangle, the work a long-document corpus has).
"""

from __future__ import annotations

import argparse
import json
import linecache
import os
import pickle
import statistics
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _where(frames: list[dict]) -> str:
    """The innermost frame in holotrain or in generated (compiled) code, else the innermost Python frame."""
    chosen = None
    for f in frames:
        name = f.get("filename", "")
        if "holotrain/" in name or "torchinductor" in name:
            chosen = f
            break
    if chosen is None:
        chosen = next((f for f in frames if f.get("filename", "").endswith(".py")), frames[0] if frames else None)
    if chosen is None:
        return "(no stack)"
    text = linecache.getline(chosen["filename"], chosen["line"]).strip()[:90]
    return f"{os.path.basename(chosen['filename'])}:{chosen['line']} {chosen.get('name', '')} | {text}"


def peak_report(snapshot: dict, top: int = 25) -> str:
    """The replayed peak of allocated bytes, the stack that reached it, and the live bytes there by allocation site.
    Memory allocated before the recorded history began is not in the trace: it shows as a base under the peak."""
    events = [e for trace in snapshot["device_traces"] for e in trace]
    base = sum(b["size"] for seg in snapshot["segments"] for b in seg["blocks"] if b["state"] == "active_allocated")
    live: dict[int, int] = {}
    total = peak = 0
    peak_at = -1
    for i, e in enumerate(events):
        if e["action"] == "alloc":
            live[e["addr"]] = e["size"]
            total += e["size"]
            if total > peak:
                peak, peak_at = total, i
        elif e["action"] == "free_completed" and e["addr"] in live:
            total -= live.pop(e["addr"])
    sites: dict[str, int] = defaultdict(int)
    counts: dict[str, int] = defaultdict(int)
    alive: dict[int, dict] = {}
    for e in events[:peak_at + 1]:
        if e["action"] == "alloc":
            alive[e["addr"]] = e
        elif e["action"] == "free_completed":
            alive.pop(e["addr"], None)
    for e in alive.values():
        key = _where(e.get("frames", []))
        sites[key] += e["size"]
        counts[key] += 1
    lines = [(f"{len(events)} events; traced peak {peak / 1e9:.2f} GB at event {peak_at} (live at the end of the "
              f"trace: {total / 1e9:.2f} GB; allocated now: {base / 1e9:.2f} GB)")]
    if peak_at >= 0:
        lines.append("stack of the allocation that reached the peak (innermost first):")
        for f in events[peak_at].get("frames", [])[:25]:
            if f.get("filename", "").endswith(".py"):
                lines.append(f"  {f['filename']}:{f['line']} {f.get('name', '')}")
    lines.append(f"live at the peak, by allocation site (top {top}):")
    for key, size in sorted(sites.items(), key=lambda kv: -kv[1])[:top]:
        lines.append(f"  {size / 1e9:7.2f} GB  {counts[key]:5d} x  {key}")
    return "\n".join(lines)


def _record_attention(out: Path):
    """Wraps the model's forward to note each micro-batch's document mask (whether it had one, and the share of the
    causal triangle its block mask visits); the shares stay on the GPU until the run ends (no synchronization)."""
    from holotrain.model import Decoder, build
    from holotrain.plan.attention import block_density

    seen = {"plain": 0, "masked": []}
    forward = Decoder.forward

    def recording(self, tokens, targets=None, doc_ids=None):
        if doc_ids is None:
            seen["plain"] += 1
        else:
            seen["masked"].append(block_density(doc_ids))
        return forward(self, tokens, targets, doc_ids)

    Decoder.forward = recording

    def write(peak_bytes: int, code: int) -> None:
        masked = [float(d) for d in seen["masked"]]
        n = seen["plain"] + len(masked)
        (out / "child.json").write_text(json.dumps({
            "max_memory_allocated": peak_bytes, "exit": code, "micro_batches": n,
            "masked_share": len(masked) / n if n else 0.0,
            "density": sum(masked) / len(masked) if masked else 1.0}))

    return write


def _child(out: Path, train_args: list[str]) -> None:
    import torch

    from holotrain.cli import main as holotrain_main

    out.mkdir(parents=True, exist_ok=True)
    write = _record_attention(out)
    code = 1
    try:
        code = holotrain_main(["train", *train_args])
    finally:
        write(torch.cuda.max_memory_allocated() if torch.cuda.is_available() else 0, code)


def _long_documents(config: str, train_args: list[str], out: Path, seq_len: int, steps: int):
    """--docs long: a config that trains `config` on one document of random tokens (never the end-of-text), so that
    every row is one document's piece and every micro-batch takes the dense causal kernel (density 1), with the
    tokenizer the embedded corpus's jobs use. Returns its path, and the override that names that tokenizer."""
    import numpy as np

    from holotrain.data import corpus
    from holotrain.plan.planner import job_config

    cfg = job_config(config, train_args)
    d = cfg.data
    cache = corpus.cache_dir(d.cache_dir)
    tok, path = corpus.prepare_tokenizer(corpus.stdlib_sources(cache), d.tokenizer, d.vocab_size,
                                         d.tokenizer_sample_mb, cache)
    low = max(corpus.special_ids(tok, path)) + 1
    out.mkdir(parents=True, exist_ok=True)
    tokens = np.random.default_rng(0).integers(low, tok.get_vocab_size(), size=(steps + 8) * (seq_len + 1) * 2)
    np.save(out / "tokens.npy", tokens.astype(np.uint32))
    shipped = Path(__file__).resolve().parents[1] / "holotrain" / "configs" / f"{config}.toml"
    text = (shipped if shipped.is_file() else Path(config)).read_text()
    toml = out / "config.toml"
    toml.write_text(f"{text}\n[[data.sources]]\nname = \"long\"\npath = \"{out / 'tokens.npy'}\"\n")
    return str(toml), [f"--data.tokenizer={path}"]


def _long_context(args, train_args: list[str]) -> None:
    """Plan against measurement at each sequence length (see the module's docstring)."""
    import subprocess

    import torch

    from holotrain.config import batch_layout
    from holotrain.jsonl import read_jsonl
    from holotrain.plan import planner
    from holotrain.plan.cost import Calibration, describe, predict, with_settings
    from holotrain.plan.trials import Measured, steady_step_s, timed_rows

    config = "1.4b"
    if "--config" in train_args:
        i = train_args.index("--config")
        config, train_args = train_args[i + 1], train_args[:i] + train_args[i + 2:]
    args.out.mkdir(parents=True, exist_ok=True)
    if args.docs == "long":
        config, more = _long_documents(config, train_args, args.out / "long-docs",
                                       max(int(x) for x in args.seq_lens.split(",")), args.steps)
        train_args = [*train_args, *more]
    calib = None
    rows = []
    for seq in [int(x) for x in args.seq_lens.split(",")]:
        job = [f"--data.seq_len={seq}", "--training.batch_size=1", "--training.micro_batch_size=1", *train_args]
        cfg, model, machine, job_calib = planner.prepare(config, job, fp8_gain=None if "--training.fp8" in " ".join(
            train_args) else 1.0)
        if calib is None:
            calib = job_calib
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # the machine probe's memory back to the GPU, for the runs
        for ac in args.ac.split(","):
            settings = {"memory.activation_checkpointing": ac}
            full = with_settings(cfg, settings)
            micro, accum = batch_layout(full, 1)
            c = planner.Candidate({**{k: getattr(getattr(full, k.split(".")[0]), k.split(".")[1]) for k in planner.PLANNED_KEYS
                              if not k.startswith("parallel.")}, **settings}, micro, accum)
            ahead = predict(model, full, machine, calib, micro, accum)
            name = f"T={seq} ac={ac}"
            if not ahead.fits:
                print(f"{name}: skipped, the plan says it does not fit ({ahead.why_not})", flush=True)
                continue
            run = args.out / f"{seq}-{ac}"
            cmd = [sys.executable, __file__, str(run), "--child", "--", "--config", config, *job,
                   f"--memory.activation_checkpointing={ac}", f"--training.steps={args.steps}",
                   "--training.log_every=1", f"--job.run_dir={run / 'run'}", "--checkpoint.every=0",
                   "--checkpoint.save_final=false", "--checkpoint.memory_every=0", "--profile.report=false",
                   "--profile.tensorboard=false", "--profile.progress=false"]
            print(f"{name}: {' '.join(cmd[2:])}", flush=True)
            try:
                proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, check=False)
                failed = proc.returncode != 0
            except subprocess.TimeoutExpired:
                proc, failed = None, True
            child = json.loads((run / "child.json").read_text()) if (run / "child.json").is_file() else {}
            metrics = run / "run" / "metrics.jsonl"
            steps = read_jsonl(metrics) if metrics.is_file() else []
            if failed or not steps:
                tail = (proc.stderr + proc.stdout).strip().splitlines()[-3:] if proc else ["timed out"]
                print(f"    failed: {' | '.join(tail)}", flush=True)
                rows.append({"seq_len": seq, "ac": ac, "error": tail, "predicted": planner.prediction_dict(ahead)})
                continue
            step_s = steady_step_s(timed_rows(steps, args.steps))
            # On a CPU (a dry run of this script) the peak is the host's RSS, as the planner's trials take it.
            peak_gb = child.get("max_memory_allocated", 0) / 1e9 or max(
                r.get("mem.peak_gb") or r.get("mem.host_rss_gb") or 0 for r in steps)
            docs = {"masked_share": child.get("masked_share", 0.0), "attention_density": child.get("density", 1.0)}
            prior = predict(model, full, machine, Calibration(fp8_gain=job_calib.fp8_gain, **docs), micro, accum)
            calib.masked_share, calib.attention_density = docs["masked_share"], docs["attention_density"]
            calibrated = predict(model, full, machine, calib, micro, accum)
            planned = prior.gpu_bytes if prior.gpu_bytes is not None else prior.host_bytes
            row = {"seq_len": seq, "ac": ac, "measured": {"peak_gb": peak_gb, "step_s": step_s, **docs},
                   "prior": planner.prediction_dict(prior), "calibrated": planner.prediction_dict(calibrated),
                   "memory_error": planned / 1e9 / peak_gb - 1 if peak_gb else None,
                   "step_error_prior": prior.step_s / step_s - 1 if step_s else None,
                   "step_error_calibrated": calibrated.step_s / step_s - 1 if step_s else None}
            rows.append(row)
            with open(args.out / "long.jsonl", "a") as f:
                f.write(json.dumps(row) + "\n")
            print(f"    memory: plan {planned / 1e9:.2f} GB, measured {peak_gb:.2f} GB "
                  f"({row['memory_error']:+.1%}); step: prior {prior.step_s:.3f} s, calibrated "
                  f"{calibrated.step_s:.3f} s, measured {step_s:.3f} s ({row['step_error_prior']:+.1%}, "
                  f"{row['step_error_calibrated']:+.1%}); {docs['masked_share']:.0%} of micro-batches masked, "
                  f"density {docs['attention_density']:.3f}", flush=True)
            for line in describe(prior):
                print(f"    prior {line}", flush=True)
            c.predicted = calibrated
            wait = statistics.fmean([r.get("time.data_wait") or 0.0 for r in timed_rows(steps, args.steps)])
            c.measured = Measured(step_s, None, peak_gb, None, None, None, "", wait)

            def repredict(cand, cfg=cfg, model=model, machine=machine, calib=calib):
                return predict(model, with_settings(cfg, cand.settings), machine, calib, cand.micro, cand.accum)

            planner.calibrate(calib, c, machine, repredict)
    ok = [r for r in rows if "measured" in r]
    print(f"{len(ok)} of {len(rows)} ran; memory within 10%: {sum(abs(r['memory_error']) <= 0.1 for r in ok)}; "
          f"prior step time within 10%: {sum(abs(r['step_error_prior']) <= 0.1 for r in ok)}; calibrated: "
          f"{sum(abs(r['step_error_calibrated']) <= 0.1 for r in ok)}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--keep-snapshot", action="store_true")
    parser.add_argument("--max-entries", type=int, default=2_000_000)
    parser.add_argument("--seq-lens", help="long context: plan against measurement at these sequence lengths")
    parser.add_argument("--ac", default="none,full", help="with --seq-lens: the checkpointing policies to run")
    parser.add_argument("--steps", type=int, default=6, help="with --seq-lens: steps per run")
    parser.add_argument("--timeout", type=float, default=480, help="with --seq-lens: seconds per run at most")
    parser.add_argument("--docs", choices=("corpus", "long"), default="corpus", help="with --seq-lens: the embedded "
                        "corpus (packed documents, masked), or one long document of random tokens (the dense kernel)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    # The options before `--` are this script's, the arguments after it `holotrain train`'s.
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)
    args = parser.parse_args(argv[:cut])
    train_args = argv[cut + 1:]
    if args.child:
        return _child(args.out, train_args)
    if args.seq_lens:
        return _long_context(args, train_args)
    import torch

    from holotrain.cli import main as holotrain_main

    args.out.mkdir(parents=True, exist_ok=True)
    torch.cuda.memory._record_memory_history(max_entries=args.max_entries, stacks="python")
    try:
        code = holotrain_main(["train", *train_args])
    finally:
        snapshot = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
    if args.keep_snapshot:
        with open(args.out / "snapshot.pickle", "wb") as f:
            pickle.dump(snapshot, f)
    report = peak_report(snapshot)
    (args.out / "peak.txt").write_text(report + "\n")
    print(report)
    print(f"max_memory_allocated: {torch.cuda.max_memory_allocated() / 1e9:.2f} GB; holotrain exit {code}")


if __name__ == "__main__":
    main()

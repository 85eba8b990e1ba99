"""The memory plan and the time model (prior, from the recorded H200 probe) against the long-context runs of
bench/gpu_long_context.sh, whose metrics.jsonl files are kept in bench/data/long-context/. CPU only.

  python bench/long_context_model.py [--seeds N]

Predicted peak GPU memory (the plan's, for the checkpointing the run chose) against the run's
max_memory_allocated, and predicted step time against the median step time past the compiling interval.

The time model's attention work depends on the documents: a run on long documents (every row one document's piece)
is dense. The embedded corpus's packed rows are not, and their attention density was not recorded, so the rows of
each packed run are rebuilt here through holotrain's own data plane (the Data lever, as the trainer builds it, from
the run's resolved config, seed and tokenizer), and the timed steps' share of micro-batches with a document boundary
and block density (plan/attention.py) go to the time model (Calibration.masked_share, attention_density). The
corpus is this Python's standard library: where it is not the GPU machine's (the "as run" column compares the
data plane's tokens per source with the run's record), the rows are like the run's, not the run's. --seeds N adds
N - 1 other data seeds: the spread of the density over other rows of the corpus.

Two step-time predictions: the prior, and "calibrated": Calibration.attention_scale fitted on the dense long-32768
run alone (one number), applied to every run."""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import re
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from holotrain.config import batch_layout  # noqa: E402
from holotrain.data.client import with_boundary  # noqa: E402
from holotrain.data.corpus import cache_dir, prepare_tokenizer, stdlib_sources  # noqa: E402
from holotrain.data.lever import Layout  # noqa: E402
from holotrain.data.lever import build as build_data  # noqa: E402
from holotrain.model import Llama  # noqa: E402
from holotrain.parallel import DistEnv  # noqa: E402
from holotrain.plan.attention import block_density  # noqa: E402
from holotrain.plan.cost import Calibration, Machine, predict, with_settings  # noqa: E402
from holotrain.plan.planner import job_config  # noqa: E402
from holotrain.train.resolve import model_args  # noqa: E402

DATA = Path(__file__).resolve().parent / "data"
STEPS = 9  # the runs' training.steps (STEPS=9), logged every 3
COMPILING = 3  # steps 1-3, the first logged interval, compile: the timed steps are 4-9
# run file, preset, seq_len, batch, checkpointing the run chose, packed (rows of the embedded corpus, rebuilt here;
# else every row one document's piece: the long documents, and hl-8192, whose record has no micro-batch with a
# document boundary)
RUNS = [
    ("hl-8192", "1.4b", 8192, 1, ("none", 0), False),
    ("long-32768", "1.4b", 32768, 1, ("none", 0), False),
    ("hl-32768", "1.4b", 32768, 1, ("none", 0), True),
    ("hl-131072", "1.4b", 131072, 1, ("selective", 0), True),
    ("hl-262144", "1.4b", 262144, 1, ("full", 0), True),
    ("7b-32768", "7b", 32768, 1, ("full", 24), True),
]
CALIBRATE_ON = "long-32768"


def overrides(preset: str, seq: int, batch: int, seed: int = 0) -> list[str]:
    """The run's command line (bench/gpu_long_context.sh), less what the data plane does not read."""
    return [f"--model.preset={preset}", f"--data.seq_len={seq}", f"--training.batch_size={batch}",
            f"--training.steps={STEPS}", f"--job.seed={seed}"]


def rebuild(args: list[str]) -> tuple[list[tuple[int, bool, float]], dict[int, dict], str]:
    """The run's micro-batches, rebuilt through its data plane on the CPU: per micro-batch, its step, whether it has a
    document boundary (the GPU client's rule: without one it takes the dense causal kernel) and the share of the
    causal triangle's 128 x 128 blocks that flex_attention visits; the tokens per source after each step (the run
    logged them); the corpus's cache name (stdlib-<key>)."""
    cfg = job_config("1.4b", args)
    d = cfg.data
    root = cache_dir(d.cache_dir)
    # As train/resolve.py resolve_job: the embedded corpus and the run's tokenizer (cached after the first build).
    sources = stdlib_sources(root)
    tokenizer, tokenizer_path = prepare_tokenizer(sources, d.tokenizer, d.vocab_size, d.tokenizer_sample_mb, root)
    # As train/trainer.py: one process, the Data lever on a run directory that holds the tokenizer.
    micro, accum = batch_layout(cfg, 1)
    layout = Layout(cfg.training.batch_size, micro, accum, cfg.parallel.tp * cfg.parallel.cp, cfg.job.seed)
    micro_batches, tokens = [], {}
    with tempfile.TemporaryDirectory() as run_dir:
        (Path(run_dir) / "tokenizer.json").write_bytes(tokenizer_path.read_bytes())
        data = build_data(dataclasses.replace(d, sources=sources), DistEnv(0, 1, 0, torch.device("cpu")),
                          Path(run_dir), tokenizer, layout, None, 0)
        try:
            for step in range(1, STEPS + 1):
                batches, _ = data.next(step)
                for _, _, doc_ids in batches:  # [micro, T] each; the CPU client keeps every micro-batch's ids
                    masked = with_boundary(doc_ids.numpy()[None])[0]
                    micro_batches.append((step, masked, float(block_density(doc_ids)) if masked else 1.0))
                tokens[step] = data.metrics(step)["data.tokens_by_source"]
        finally:
            data.close()
    return micro_batches, tokens, Path(sources[0].path).parent.name


def documents(micro_batches: list[tuple[int, bool, float]]) -> Calibration:
    """The timed steps' documents as the time model takes them: the share of micro-batches with a boundary, and
    the masked ones' mean density (the model runs the others dense)."""
    timed = [(is_masked, density) for step, is_masked, density in micro_batches if step > COMPILING]
    masked = [density for is_masked, density in timed if is_masked]
    return Calibration(masked_share=len(masked) / len(timed),
                       attention_density=statistics.mean(masked) if masked else 1.0)


def recorded_masked(rows: list[dict]) -> float:
    """The run's own share of micro-batches with a boundary over the timed steps (data.doc_masked_share is over all
    steps so far; batch 1 on one process: a micro-batch per step)."""
    first, last = rows[0], rows[-1]
    return ((last["data.doc_masked_share"] * last["step"] - first["data.doc_masked_share"] * first["step"])
            / (last["step"] - first["step"]))


def fit_attention_scale(model, cfg, machine: Machine, calib: Calibration, batch: int, measured: float) -> float:
    """The Calibration.attention_scale at which the time model gives the measured step: Newton steps, the step being
    nearly linear in it (only the host's overlap, micro_time, is not)."""
    scale = 1.0
    for _ in range(4):
        p = predict(model, cfg, machine, dataclasses.replace(calib, attention_scale=scale), batch, 1)
        scale += (measured - p.step_s) / (p.attention_total_s / scale)
    return scale


def run_corpus(rows: list[dict]) -> str | None:
    """The cache name (stdlib-<key>) of the run's embedded corpus, where a skipped record's path logged it."""
    found = re.search(r"stdlib-[0-9a-f]{16}", " ".join(e for r in rows for e in r.get("data.skip_examples") or []))
    return found.group(0) if found else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=1,
                        help="data seeds to rebuild each packed run with: the run's (0), then 1..N-1")
    opts = parser.parse_args()
    machine = Machine(**json.loads((DATA / "plan-h200/machine.json").read_text()))
    runs = {}
    for name, preset, seq, batch, (ac, blocks), _ in RUNS:
        rows = [json.loads(line) for line in (DATA / "long-context" / f"{name}.jsonl").read_text().splitlines()]
        cfg = with_settings(job_config("1.4b", overrides(preset, seq, batch)),
                            {"memory.activation_checkpointing": ac, "memory.activation_checkpointing_blocks": blocks})
        with torch.device("meta"):
            model = Llama(model_args(cfg))
        runs[name] = (rows, cfg, model, statistics.median(r["step_s"] for r in rows[1:]))

    rows, cfg, model, step = runs[CALIBRATE_ON]
    scale = fit_attention_scale(model, cfg, machine, Calibration(), 1, step)
    print(f"calibrated: attention_scale {scale:.3f}, fitted on {CALIBRATE_ON} (an attention rate of "
          f"{machine.attention_rate * 1e-12 / scale:.0f} TFLOP/s for the prior's {machine.attention_rate * 1e-12:.0f})")
    print(f"{'run':12} {'AC':14} {'peak plan':>9} {'measured':>9} {'err':>6}  {'masked':>6} {'(run)':>5} "
          f"{'density':>7}  {'step prior':>10} {'calib.':>6} {'measured':>8} {'err prior':>9} {'calib.':>7}  as run")
    corpus, spread = None, {}
    for name, preset, seq, batch, (ac, blocks), packed in RUNS:
        rows, cfg, model, step = runs[name]
        docs, as_run = Calibration(), "dense"
        if packed:
            micro_batches, tokens, corpus = rebuild(overrides(preset, seq, batch))
            docs = documents(micro_batches)
            # The data plane's tokens per source after each logged step fingerprint the corpus and the tokenizer:
            # equal, the rows are the run's.
            as_run = "yes" if all(tokens[r["step"]] == r["data.tokens_by_source"] for r in rows) else "no (corpus)"
            spread[name] = [documents(rebuild(overrides(preset, seq, batch, seed))[0])
                            for seed in range(1, opts.seeds)]
        prior = predict(model, cfg, machine, docs, batch, 1)
        calibrated = predict(model, cfg, machine, dataclasses.replace(docs, attention_scale=scale), batch, 1)
        peak = max(r["mem.peak_gb"] for r in rows) * 1e9
        label = f"{ac}" + (f" {blocks}/{cfg.model.n_layers}" if blocks else "")
        print(f"{name:12} {label:14} {prior.gpu_bytes / 1e9:>9.1f} {peak / 1e9:>9.1f} "
              f"{prior.gpu_bytes / peak - 1:>+6.1%}  {docs.masked_share:>6.2f} {recorded_masked(rows):>5.2f} "
              f"{docs.attention_density:>7.3f}  {prior.step_s:>10.2f} {calibrated.step_s:>6.2f} {step:>8.2f} {prior.step_s / step - 1:>+9.1%} "
              f"{calibrated.step_s / step - 1:>+7.1%}  {as_run}", flush=True)
    print("masked: the timed steps' share of micro-batches with a document boundary, rebuilt ((run): the run's own, "
          "from data.doc_masked_share); density: the masked ones' share of the causal triangle's 128 x 128 blocks")
    theirs = next(filter(None, (run_corpus(runs[name][0]) for name in runs)), None)
    print(f"corpus: Python {platform.python_version()}'s standard library ({corpus}); the runs': {theirs}"
          + ("" if corpus == theirs else " (another: the rebuilt rows are like the runs', not theirs)"))
    if opts.seeds > 1:
        print("\nother data seeds, the same corpus: masked x density, calibrated step error")
        for name, seeds in spread.items():
            _, cfg, model, step = runs[name]
            cells = []
            for seed, docs in enumerate(seeds, 1):
                p = predict(model, cfg, machine, dataclasses.replace(docs, attention_scale=scale), 1, 1)
                cells.append(f"seed {seed}: {docs.masked_share:.2f} x {docs.attention_density:.3f} "
                             f"{p.step_s / step - 1:+.1%}")
            print(f"{name:12} " + ", ".join(cells))


if __name__ == "__main__":
    main()

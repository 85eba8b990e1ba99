"""`holotrain train` with pipeline stages (parallel.pp > 1) on gloo ranks: like one process, resumed bit-exactly
after kill -9, and its checkpoint resumed without stages and over more stages."""

import json
import shutil

import pytest

from tests.conftest import read_metrics, run_cli, tiny_args
from tests.test_distributed import torchrun


def _resume_from(src, dst, step: int) -> None:
    """A copy of run `src` whose newest checkpoint is the one of `step`."""
    shutil.copytree(src, dst)
    for ckpt in (dst / "checkpoints").iterdir():
        if ckpt.name.startswith("step-") and int(ckpt.name.removeprefix("step-")) > step:
            shutil.rmtree(ckpt)


@pytest.mark.slow
def test_pipeline_trains_like_one_process_resumes_exactly_and_at_other_degrees(tmp_path):
    """pp=2 (the zbv schedule, chosen by auto) over 2 ranks, 4 micro-batches a step: losses and gradient norms as
    one process's with the same accumulation. With activation checkpointing and RAM snapshots, killed while saving
    step 5, it resumes from its step-4 snapshot to the same losses, bit for bit. Its step-3 disk checkpoint,
    resumed in one process (pp=1), over 4 ranks (pp=4, 1f1b) and over 4 ranks as pp=2 x tp=2 (each stage split by
    tensor parallelism), gives step 4 the same loss. The pipelined run exports to one Hugging Face model file."""
    one, pp2, killed = tmp_path / "one", tmp_path / "pp2", tmp_path / "killed"
    common = {"training.steps": 6, "checkpoint.every": 2, "training.micro_batch_size": 2}
    run_cli("train", *tiny_args(one, **common), env={"OMP_NUM_THREADS": "1"})
    out = torchrun(2, "train", *tiny_args(pp2, **common), "--parallel.pp=2")
    assert "pipeline over 2 ranks, 4 stages (zbv, 4 micro-batches a step)" in out
    a, b = read_metrics(one), read_metrics(pp2)
    assert [r["step"] for r in a] == [r["step"] for r in b]
    for ra, rb in zip(a, b):
        assert rb["loss"] == pytest.approx(ra["loss"], abs=2e-4), (ra, rb)
        assert rb["grad_norm"] == pytest.approx(ra["grad_norm"], rel=1e-3), (ra, rb)
    assert b[-1]["loss"] < b[0]["loss"]
    # Validation at the end of the run, through the schedule forward only: the same held-out loss.
    assert b[-1]["eval.loss"] == pytest.approx(a[-1]["eval.loss"], abs=2e-4) and b[-1]["eval.tokens"] == a[-1][
        "eval.tokens"]
    # The bubble of each logged step, measured beside the model's; the last one drawn in the report.
    assert all(0 < r["pp.bubble_share"] < 1 and 0 < r["pp.bubble_share_model"] < 1 for r in b[1:]), b
    timeline = json.loads((pp2 / "pipeline_timeline.json").read_text())
    assert timeline["step"] == 6 and timeline["schedule"] == "zbv"
    assert {e["kind"] for e in timeline["events"]} == {"F", "I", "W"}
    assert "Pipeline schedule and bubble" in (pp2 / "report.html").read_text()

    # Every block recomputed in backward, a snapshot in RAM after every step, disk checkpoints at steps 3 and 6
    # written while training waits (so which state is newest when the kill comes does not depend on timing).
    recover = ("--parallel.pp=2", "--memory.activation_checkpointing=full", "--checkpoint.memory_every=1",
               "--checkpoint.every=3", "--checkpoint.async_save=false")
    torchrun(2, "train", *tiny_args(killed, **common), *recover, env={"HOLOTRAIN_KILL_DURING_SAVE": "5"}, ok=False)
    assert sorted(p.name for p in (killed / "checkpoints").iterdir() if p.name.startswith("step-")) == ["step-3"]
    at_pp1, at_pp4, at_tp2 = tmp_path / "at-pp1", tmp_path / "at-pp4", tmp_path / "at-pp2-tp2"
    for run in (at_pp1, at_pp4, at_tp2):
        _resume_from(killed, run, 3)
    out = torchrun(2, "train", *tiny_args(killed, **common), *recover)
    assert "resuming from the in-memory snapshot in " in out and "(step 4)" in out
    assert [r["loss"] for r in read_metrics(killed)] == [r["loss"] for r in b]

    short = {**common, "training.steps": 4}
    run_cli("train", *tiny_args(at_pp1, **short), "--checkpoint.resume=true", env={"OMP_NUM_THREADS": "1"})
    out = torchrun(4, "train", *tiny_args(at_pp4, **short), "--parallel.pp=4", "--checkpoint.resume=true")
    assert "pipeline over 4 ranks, 4 stages (1f1b, 4 micro-batches a step)" in out
    out = torchrun(4, "train", *tiny_args(at_tp2, **short), "--parallel.pp=2", "--parallel.tp=2",
                   "--parallel.pp_schedule=1f1b", "--checkpoint.resume=true")
    assert "pipeline over 2 ranks, 2 stages (1f1b, 4 micro-batches a step)" in out
    for run in (at_pp1, at_pp4, at_tp2):
        rows = read_metrics(run)
        assert [r["step"] for r in rows] == [1, 2, 3, 4]
        assert rows[3]["loss"] == pytest.approx(b[3]["loss"], abs=1e-5), (run.name, rows[3], b[3])
        # pp=1, pp=4 (1f1b) and pp=2 x tp=2 score the end-of-run eval alike.
        assert rows[3]["eval.loss"] == pytest.approx(read_metrics(at_pp1)[3]["eval.loss"], abs=2e-4), run.name

    run_cli("export", str(pp2), str(tmp_path / "hf-pp2"))
    run_cli("export", str(one), str(tmp_path / "hf-one"))
    from safetensors import safe_open

    with safe_open(tmp_path / "hf-pp2" / "model.safetensors", "pt") as f, \
            safe_open(tmp_path / "hf-one" / "model.safetensors", "pt") as g:
        assert sorted(f.keys()) == sorted(g.keys())
        for key in f.keys():
            assert f.get_tensor(key).shape == g.get_tensor(key).shape

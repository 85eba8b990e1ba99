"""End-to-end training through the CLI: metrics, checkpoints, exact resume after SIGKILL, crash during save, export."""

import json
import math
import os
import pickle
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from holotrain.train.checkpoint import SafeFileSystemReader, latest_checkpoint
from tests.conftest import REPO, read_metrics, run_cli, run_cli_here, sigkill_after, tiny_args


def losses(run_dir):
    return [(r["step"], r["loss"], r["grad_norm"]) for r in read_metrics(run_dir)]


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory):
    """An uninterrupted 40-step run that the interrupted ones must reproduce exactly."""
    run_dir = tmp_path_factory.mktemp("reference")
    proc = run_cli("train", *tiny_args(run_dir, **{"training.steps": 40, "checkpoint.every": 2}))
    (run_dir.parent / "reference-stdout.txt").write_text(proc.stdout)
    return run_dir


def test_run_dir_contents_and_metrics(reference_run):
    rows = read_metrics(reference_run)
    assert [r["step"] for r in rows] == list(range(1, 41))
    for key in ("loss", "lr", "grad_norm", "tokens_per_s", "tflops", "mfu", "step_s", "mem.peak_gb"):
        assert key in rows[0]
    assert rows[0]["mfu"] is None and rows[0]["mem.peak_gb"] is None  # CPU: no known peak, no GPU memory
    assert rows[-1]["loss"] < rows[0]["loss"] - 0.5
    assert (reference_run / "config.toml").is_file()
    assert latest_checkpoint(reference_run).name == "step-40"
    kept = sorted(p.name for p in (reference_run / "checkpoints").iterdir())
    assert kept == ["step-38", "step-40"]  # checkpoint.keep = 2


def test_resume_after_sigkill_is_bit_exact(reference_run, tmp_path):
    run_dir = tmp_path / "killed"
    args = ["train", *tiny_args(run_dir, **{"training.steps": 40, "checkpoint.every": 2})]
    kill_after = random.Random().randint(5, 30)
    killed_at = sigkill_after(args, run_dir, kill_after)
    assert killed_at < 40
    with (run_dir / "metrics.jsonl").open("a") as f:
        f.write('{"step": %d, "loss": 4.' % (killed_at + 1))  # the kill can land mid-row: the resume drops it
    run_cli(*args)
    assert losses(run_dir) == losses(reference_run), f"killed after step {killed_at}"


def test_crash_during_checkpoint_save_keeps_previous(reference_run, tmp_path):
    run_dir = tmp_path / "crash"
    args = ["train", *tiny_args(run_dir, **{"training.steps": 40, "checkpoint.every": 2})]
    proc = run_cli(*args, env={"HOLOTRAIN_KILL_DURING_SAVE": "12"}, check=False)
    assert proc.returncode == -signal.SIGKILL
    assert (run_dir / "checkpoints" / ".tmp-step-12").is_dir()  # the half-written one
    assert latest_checkpoint(run_dir).name == "step-10"
    run_cli(*args)
    assert losses(run_dir) == losses(reference_run)
    assert not list((run_dir / "checkpoints").glob(".tmp-*"))


def test_finished_run_is_not_retrained_and_fresh_start_refuses_existing(reference_run):
    proc = run_cli("train", *tiny_args(reference_run, **{"training.steps": 40}))
    assert "already trained" in proc.stdout
    proc = run_cli("train", *tiny_args(reference_run, **{"checkpoint.resume": False}), check=False)
    assert proc.returncode == 2 and "checkpoint.resume" in proc.stderr


def test_checkpoint_metadata_refuses_foreign_pickle(reference_run, tmp_path):
    """A tampered .metadata naming an arbitrary callable is refused, not executed."""
    import shutil

    ckpt = tmp_path / "evil"
    shutil.copytree(latest_checkpoint(reference_run), ckpt)

    class Evil:
        def __reduce__(self):
            return (os.system, ("touch " + str(tmp_path / "pwned"),))

    (ckpt / ".metadata").write_bytes(pickle.dumps(Evil()))
    with pytest.raises(pickle.UnpicklingError, match="not allowed"):
        SafeFileSystemReader(ckpt).read_metadata()
    assert not (tmp_path / "pwned").exists()


def test_gradient_accumulation_matches_full_batch(tmp_path):
    full, accum = tmp_path / "full", tmp_path / "accum"
    run_cli("train", *tiny_args(full, **{"training.steps": 6}))
    run_cli("train", *tiny_args(accum, **{"training.steps": 6, "training.micro_batch_size": 2}))
    for a, b in zip(read_metrics(full), read_metrics(accum)):
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-5)


def test_export_loads_in_transformers_with_same_logits(reference_run, tmp_path):
    transformers = pytest.importorskip("transformers")
    out = tmp_path / "hf"
    run_cli("export", str(reference_run), str(out))
    hf = transformers.LlamaForCausalLM.from_pretrained(out).eval()

    from holotrain.config import load_config
    from holotrain.model import build
    from holotrain.train import model_args
    from holotrain.train.checkpoint import load_model_weights

    ours = build(model_args(load_config(reference_run / "config.toml"))).eval()
    load_model_weights(latest_checkpoint(reference_run), ours)
    tokens = torch.randint(0, ours.args.vocab_size, (2, 32))
    with torch.no_grad():
        assert (ours(tokens) - hf(tokens).logits).abs().max().item() <= 1e-4
    config = json.loads((out / "config.json").read_text())
    assert config["num_hidden_layers"] == 2
    assert (out / "tokenizer.json").is_file()

    # The ids the run trained with: its BPE's end-of-text and padding, no begin-of-text; generation stops at the
    # end of text (no chat template, so no end-of-turn token), greedily.
    from tokenizers import Tokenizer

    bpe = Tokenizer.from_file(str(reference_run / "tokenizer.json"))
    eos, pad = bpe.token_to_id("<|endoftext|>"), bpe.token_to_id("<|pad|>")
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (None, eos, pad)
    assert max(eos, pad) < config["vocab_size"]
    generation = json.loads((out / "generation_config.json").read_text())
    assert (generation["eos_token_id"], generation["pad_token_id"], generation["do_sample"]) == (eos, pad, False)
    assert hf.generation_config.eos_token_id == eos
    # tokenizer_config.json, which the run's BPE never had: transformers loads it and encodes as training did.
    tok_config = json.loads((out / "tokenizer_config.json").read_text())
    assert tok_config["tokenizer_class"] == "PreTrainedTokenizerFast" and "chat_template" not in tok_config
    assert tok_config["model_max_length"] == config["max_position_embeddings"]
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    assert (tokenizer.eos_token_id, tokenizer.pad_token_id, tokenizer.bos_token_id) == (eos, pad, None)
    text = "def f(x):\n    return x + 1\n"
    assert tokenizer(text)["input_ids"] == bpe.encode(text).ids


def test_export_of_non_run_dir_is_a_clear_error(tmp_path):
    proc = run_cli_here("export", tmp_path, tmp_path / "out")
    assert proc.returncode == 2 and "config.toml" in proc.stderr and "Traceback" not in proc.stderr


def _tiny_step_setup(grad_clip=1.0):
    from holotrain.config import load_config, resolve
    from holotrain.parallel import DistEnv
    from holotrain.train.trainer import TrainStep, build_model, build_optimizer

    cfg = resolve(load_config(None, [
        "--model.dim=32", "--model.n_layers=1", "--model.n_heads=2", "--model.n_kv_heads=1", "--model.ffn_dim=64",
        "--data.seq_len=8", f"--training.grad_clip={grad_clip}",
    ]), tokenizer_vocab=64)
    env = DistEnv(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    model = build_model(cfg, env, torch.float32)
    opt = build_optimizer(model, cfg, env)
    batch = (torch.randint(0, 64, (2, 8)), torch.randint(0, 64, (2, 8)))
    return model, opt, TrainStep(model, opt, cfg, env, torch.float32), batch


def test_non_finite_gradients_skip_the_step():
    model, _, step, batch = _tiny_step_setup()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    model.output.weight.register_hook(lambda g: g * float("inf"))
    _, grad_norm = step(lambda m: batch, 1, 1e-2)
    assert not torch.isfinite(grad_norm)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_folded_clipping_equals_explicit_clipping():
    """The clip folded into fused AdamW updates the weights as clip_grad_norm_ + AdamW would."""
    model, opt, step, batch = _tiny_step_setup(grad_clip=0.05)
    reference = {k: v.clone() for k, v in model.state_dict().items()}
    twin, twin_opt, twin_step, _ = _tiny_step_setup(grad_clip=0.05)
    twin.load_state_dict(reference)
    twin_step.fold_clip = False
    _, n1 = step(lambda m: batch, 1, 1e-2)
    _, n2 = twin_step(lambda m: batch, 1, 1e-2)
    assert n1.item() > 0.05  # clipping really happened
    assert torch.allclose(n1, n2)
    for (k, a), b in zip(model.state_dict().items(), twin.state_dict().values()):
        assert torch.allclose(a, b, atol=1e-6), k


def test_phase_times_in_metrics(reference_run):
    for row in read_metrics(reference_run):
        phases = [row[f"time.{p}"] for p in ("forward", "backward", "optimizer")]
        assert all(p > 0 for p in phases)
        assert row["time.data_wait"] >= 0
        assert sum(phases) + row["time.data_wait"] <= row["step_s"] * 1.05


def test_phase_clock_cpu():
    import time as _time

    from holotrain.profile import PhaseClock

    clock = PhaseClock(torch.device("cpu"))
    for _ in range(2):
        with clock.phase("work"):
            _time.sleep(0.01)
    clock.add("wait", 0.5)
    out = clock.collect(steps=2)
    assert 0.009 < out["time.work"] < 0.05 and out["time.wait"] == 0.25
    assert clock.collect(steps=1) == {}


def test_diverging_run_skips_non_finite_steps_then_stops_with_exit_3(tmp_path):
    """lr = 1e6 sends the weights to inf at once: every later step has a non-finite gradient norm. Each is skipped
    and counted, and max_nonfinite_steps in a row stop the run with exit code 3 and one line, no traceback."""
    run_dir = tmp_path / "run"
    args = tiny_args(run_dir, **{"training.lr": 1e6, "training.warmup_steps": 0, "training.steps": 40,
                                 "training.max_nonfinite_steps": 5, "checkpoint.every": 0})
    proc = run_cli("train", *args, check=False)
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert "consecutive steps" in proc.stderr and "Traceback" not in proc.stderr
    assert "were skipped" in proc.stdout
    rows = read_metrics(run_dir)
    assert rows[-1]["step"] < 40 and rows[-1]["train.nonfinite_steps"] >= 5
    assert rows[-1]["grad_norm"] is None or not math.isfinite(rows[-1]["grad_norm"])  # NaN is logged as null


@pytest.mark.parametrize("how", ["truncated shard", "truncated metadata, no manifest"])
def test_damaged_newest_checkpoint_falls_back_to_the_previous(reference_run, tmp_path, how):
    """A truncated file in the newest checkpoint (caught by its manifest, or, in a checkpoint without one, when its
    metadata fails to load) is reported in one line and the previous checkpoint is used: the run still matches an
    uninterrupted one exactly."""
    run_dir = tmp_path / "damaged"
    args = ["train", *tiny_args(run_dir, **{"training.steps": 40, "checkpoint.every": 2})]
    sigkill_after(args, run_dir, 21)
    newest = latest_checkpoint(run_dir)
    if how == "truncated shard":
        victim = max(newest.glob("*.distcp"), key=lambda p: p.stat().st_size)
    else:
        (newest / "manifest.json").unlink()
        victim = newest / ".metadata"
    victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])
    proc = run_cli(*args)
    assert f"checkpoint {newest} is damaged" in proc.stdout and "Traceback" not in proc.stdout + proc.stderr
    assert losses(run_dir) == losses(reference_run)


def test_no_intact_checkpoint_is_one_clear_error(tmp_path):
    run_dir = tmp_path / "all-damaged"
    args = ["train", *tiny_args(run_dir, **{"training.steps": 4, "checkpoint.every": 2})]
    run_cli(*args)
    for ckpt in (run_dir / "checkpoints").iterdir():
        (ckpt / ".metadata").write_bytes(b"")
    proc = run_cli("train", *tiny_args(run_dir, **{"training.steps": 6, "checkpoint.every": 2}), check=False)
    assert proc.returncode == 2 and "no intact checkpoint" in proc.stderr and "Traceback" not in proc.stderr


def test_checkpoints_are_written_in_the_background_and_timed(reference_run, tmp_path):
    """The reference run saves every 2 steps in the background: its rows carry the blocking part (time.checkpoint)
    and the finished writes (checkpoint.write_s). A blocking run (checkpoint.async_save = false) trains the same."""
    rows = read_metrics(reference_run)
    assert any(r["time.checkpoint"] > 0 for r in rows)
    assert sum(r["checkpoint.write_s"] or 0 for r in rows) > 0
    run_dir = tmp_path / "blocking"
    run_cli("train", *tiny_args(run_dir, **{"training.steps": 40, "checkpoint.every": 2, "checkpoint.async_save": False}))
    assert losses(run_dir) == losses(reference_run)
    assert latest_checkpoint(run_dir).name == "step-40"


def test_sigterm_saves_the_step_and_the_run_resumes_exactly(reference_run, tmp_path):
    """SIGTERM (torchrun or a scheduler stopping the job) finishes the step under way, saves a checkpoint of it
    (waiting for the background write), and exits 143: nothing half-written is left, and the run resumes exactly."""
    run_dir = tmp_path / "terminated"
    args = ["train", *tiny_args(run_dir, **{"training.steps": 40, "checkpoint.every": 7})]
    stopped_at = sigkill_after(args, run_dir, random.Random().randint(6, 30), sig=signal.SIGTERM)
    assert stopped_at < 40
    assert latest_checkpoint(run_dir).name == f"step-{stopped_at}"
    assert not list((run_dir / "checkpoints").glob(".tmp-*"))
    run_cli(*args)
    assert losses(run_dir) == losses(reference_run), f"terminated after step {stopped_at}"


def test_ctrl_c_saves_the_step_and_a_second_process_is_refused(reference_run, tmp_path):
    """Ctrl-C (SIGINT to the whole process group: trainer, data plane, loaders) at step 12 of 40 with
    checkpoint.every = 20: exit 130, one line naming the checkpoint and the command that resumes, no traceback from
    any process, /dev/shm clean; the rerun continues with the uninterrupted run's losses. While it runs (held 1 s a
    step by the fault hook, so that it is still short of step 12 when the second process is done), a second process
    into its run directory is refused within 10 s in one line."""
    from holotrain.data.plane import shm_prefix

    run_dir = tmp_path / "ctrl-c"
    args = ["train", *tiny_args(run_dir, **{"training.steps": 40, "checkpoint.every": 20})]
    proc = subprocess.Popen([sys.executable, "-m", "holotrain.cli", *args], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env={**os.environ, "HOLOTRAIN_SLOW_RANK": "0:forward:1.0"})
    metrics = run_dir / "metrics.jsonl"

    def rows() -> int:
        return len(metrics.read_text().splitlines()) if metrics.is_file() else 0

    deadline = time.time() + 300
    while rows() < 1 and proc.poll() is None and time.time() < deadline:
        time.sleep(0.01)
    t0 = time.perf_counter()
    second = run_cli(*args, check=False)
    assert second.returncode == 2 and time.perf_counter() - t0 < 10, second.stderr
    assert f"is in use by pid {proc.pid} on" in second.stderr and len(second.stderr.strip().splitlines()) == 1
    assert rows() < 12
    while rows() < 12 and proc.poll() is None and time.time() < deadline:
        time.sleep(0.002)
    os.killpg(proc.pid, signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert "Traceback" not in out + err, err
    saved = latest_checkpoint(run_dir)
    assert saved.name in ("step-12", "step-13"), saved
    assert f"holotrain: SIGINT: stopped after step {saved.name[5:]}, saved {saved}; resume with: holotrain train" in err
    assert not list(Path("/dev/shm").glob(shm_prefix(run_dir) + "*"))
    run_cli(*args)
    assert losses(run_dir) == losses(reference_run)


def test_a_second_signal_exits_at_once():
    """After the first signal the loop is asked to stop at the end of its step; a second one exits there and then,
    with 128 + its number, whatever the process is doing."""
    script = ("import os, signal, time\n"
              "from holotrain.train.interrupts import StopSignals\n"
              "with StopSignals().installed() as stop:\n"
              "    stop.start_loop(1)\n"
              "    os.kill(os.getpid(), signal.SIGINT)\n"
              "    assert stop.requested() == signal.SIGINT\n"
              "    os.kill(os.getpid(), signal.SIGTERM)\n"
              "    time.sleep(30)\n")
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, proc.stderr
    assert proc.stderr.splitlines() == [
        "holotrain: SIGINT: finishing the step under way and saving a checkpoint (a second signal exits at once)",
        "holotrain: SIGTERM: a second signal, exiting at once"]


def test_sigusr1_prints_every_threads_stack_and_training_goes_on():
    """SIGUSR1 (a run that seems stuck): every thread's Python stack on stderr, and nothing stops."""
    script = ("import os, signal\n"
              "from holotrain.train.interrupts import StopSignals\n"
              "def waiting_here():\n"
              "    os.kill(os.getpid(), signal.SIGUSR1)\n"
              "with StopSignals().installed() as stop:\n"
              "    stop.start_loop(1)\n"
              "    waiting_here()\n"
              "    print('still training', stop.requested())\n")
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout == "still training 0\n", proc.stderr
    assert "waiting_here" in proc.stderr and "Current thread" in proc.stderr


def test_a_changed_schedule_on_resume_is_said_out_loud(reference_run, tmp_path):
    run_dir = tmp_path / "longer"
    shutil.copytree(reference_run, run_dir)
    proc = run_cli("train", *tiny_args(run_dir, **{"training.steps": 42, "checkpoint.every": 2}))
    line = next(x for x in proc.stdout.splitlines() if "schedule changed" in x)
    from holotrain.config import load_config
    from holotrain.train.step import lr_at

    old, new = load_config(reference_run / "config.toml"), load_config(run_dir / "config.toml")
    assert "training.steps 40 -> 42" in line
    assert f"at step 40 the learning rate is {lr_at(40, new):.3g} (it was {lr_at(40, old):.3g}" in line


def test_goodput_accounts_for_the_whole_process(reference_run):
    """goodput.json splits the process's wall time into start-up, recovery, training, checkpoint blocking, data
    waits and the rest; the parts add up to the wall time, and goodput is the run's tokens over it. The last
    metrics row carries the same account up to the last step; the report shows it."""
    g = json.loads((reference_run / "goodput.json").read_text())
    parts = [g[f"goodput.{k}_s"] for k in ("startup", "recovery", "train", "checkpoint", "data_wait", "other")]
    assert all(p >= 0 for p in parts) and g["goodput.train_s"] > 0 and g["goodput.startup_s"] > 0
    assert abs(sum(parts) - g["goodput.wall_s"]) < 1e-6 * max(1.0, g["goodput.wall_s"]) + 1e-6
    tokens = 40 * 8 * 32  # steps x batch x seq_len
    assert g["goodput"] == pytest.approx(tokens / g["goodput.wall_s"])
    last = read_metrics(reference_run)[-1]
    assert last["goodput"] > 0 and last["goodput.wall_s"] <= g["goodput.wall_s"]
    assert 'id="goodput"' in (reference_run / "report.html").read_text()
    # The first step's time is said as soon as it is known (a large model's can take minutes).
    assert re.search(r"^holotrain: step 1 took \d+\.\d s \(compilation and warm-up\)$",
                     (reference_run.parent / "reference-stdout.txt").read_text(), re.M)


def test_resume_from_an_in_memory_snapshot_after_sigkill(reference_run, tmp_path):
    """checkpoint.memory_every = 1 puts a snapshot in host RAM (/dev/shm) after every step; disk checkpoints come
    every 10. Killed mid-run, the same command resumes from the newer RAM snapshot (losing at most one step, not
    up to ten) and reproduces the uninterrupted run exactly. A finished run removes its snapshots; a run
    directory started afresh never picks up a stale one."""
    from holotrain.train.checkpoint import memory_root
    from holotrain.train.snapshots import local_steps

    run_dir = tmp_path / "in-memory"
    args = ["train", *tiny_args(run_dir, **{"training.steps": 40, "checkpoint.every": 10,
                                            "checkpoint.memory_every": 1})]
    killed_at = sigkill_after(args, run_dir, random.Random().randint(13, 19))
    in_ram = sorted(local_steps(run_dir, 0)[0])
    assert in_ram and in_ram[-1] > 10, (killed_at, in_ram)
    proc = run_cli(*args)
    assert f"resuming from the in-memory snapshot in {memory_root(run_dir)} (step {in_ram[-1]})" in proc.stdout
    assert losses(run_dir) == losses(reference_run), f"killed after step {killed_at}"
    assert not memory_root(run_dir).exists()

    # A stale snapshot of a deleted run directory is not resumed by a fresh run there.
    stale = tmp_path / "stale"
    stale_args = ["train", *tiny_args(stale, **{"training.steps": 40, "checkpoint.every": 0,
                                                "checkpoint.save_final": False, "checkpoint.memory_every": 1})]
    sigkill_after(stale_args, stale, 5)
    assert local_steps(stale, 0)[0]
    shutil.rmtree(stale)
    run_cli(*["train", *tiny_args(stale, **{"training.steps": 3, "checkpoint.memory_every": 1})])
    assert [r["step"] for r in read_metrics(stale)] == [1, 2, 3]
    assert not memory_root(stale).exists()


def test_in_memory_snapshots_over_their_ram_cap_are_one_clear_error(tmp_path):
    proc = run_cli("train", *tiny_args(tmp_path / "capped", **{"checkpoint.memory_every": 1,
                                                               "checkpoint.memory_gb": 1e-6}), check=False)
    assert proc.returncode == 2 and "checkpoint.memory_gb" in proc.stderr and "Traceback" not in proc.stderr


def test_no_thread_of_ours_outlives_training(tmp_path):
    """The offload worker, the checkpoint writer and the data prefetch thread are all joined before the process
    exits (the CLI warns about any still running): a run that saves in the background with offload leaves none."""
    proc = run_cli("train", *tiny_args(tmp_path / "threads", **{"training.steps": 6, "checkpoint.every": 2,
                                                                 "checkpoint.memory_every": 1,
                                                                 "memory.offload": True}))
    assert "threads still running" not in proc.stderr, proc.stderr
    assert "terminate called" not in proc.stderr


def test_a_checkpoint_the_disk_cannot_hold_is_refused_before_it_is_written(tmp_path, monkeypatch):
    """The disk's free space is checked against the state's bytes first. With too little room and no checkpoint but
    the newest intact one to remove (tests/test_full_disk.py removes older ones), nothing is written and the save is
    refused in one line (NotWritten, which the run reports before training goes on) naming the directory, the free
    and the needed space; the checkpoint already written stays as it was."""
    from collections import namedtuple

    from holotrain.train import checkpoint

    state = {"model": {"w": torch.ones(1000)}, "optim": {"step": torch.tensor(3.0)}}
    checkpoint.write_checkpoint(tmp_path, 2, state, {"step": 2}, keep=2)
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(checkpoint.shutil, "disk_usage", lambda path: usage(10**6, 10**6 - 4000, 4000))
    with pytest.raises(checkpoint.NotWritten, match=rf"^{tmp_path / 'checkpoints'} has 0\.00 MB free, a checkpoint of "
                                                    r"this run needs 0\.27 MB, and no older checkpoint is left to "
                                                    r"remove$"):
        checkpoint.write_checkpoint(tmp_path, 4, state, {"step": 4}, keep=2)
    assert latest_checkpoint(tmp_path).name == "step-2" and not list((tmp_path / "checkpoints").glob(".tmp-*"))
    monkeypatch.setattr(checkpoint.shutil, "disk_usage", lambda path: usage(10**7, 0, 10**6))
    assert checkpoint.write_checkpoint(tmp_path, 4, state, {"step": 4}, keep=2).name == "step-4"

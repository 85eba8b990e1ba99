"""Straggler detection: the rule on synthetic per-rank numbers, the fault hook, the report section, and one 2-rank gloo
run with a rank slowed in its forward phase, which must be named with its rank and phase."""

import math
import time
from types import SimpleNamespace

import pytest
import torch

from holotrain.config import ConfigError, load_config, resolve
from holotrain.profile.phases import PhaseClock, slow_rank_fault
from holotrain.profile.report.stragglers import stragglers_section
from holotrain.profile.stragglers import StragglerCheck, describe, find_stragglers
from tests.conftest import read_metrics, tiny_args
from tests.test_distributed import torchrun


def rank(step_s=0.3, began=None, **times):
    """One rank's record: phase times in seconds per step, and when each phase began (host clock, seconds)."""
    rec = {"step_s": step_s, **{f"time.{p}": t for p, t in times.items()}}
    rec.update({f"began.{p}": t for p, t in (began or {}).items()})
    return rec


def test_a_slow_rank_is_named_in_its_phase_not_where_the_others_wait():
    # Rank 2 is 100 ms slow in forward; the other three wait that long in backward (the median), and begin it
    # 100 ms before rank 2 does.
    fast = dict(forward=0.1, backward=0.3, optimizer=0.05)
    records = [rank(**{**fast, "backward": 0.4}, began={"forward": 0.0, "backward": 0.1}) for _ in range(4)]
    records[2] = rank(**{**fast, "forward": 0.2}, began={"forward": 0.0, "backward": 0.2})
    [s] = find_stragglers(records, margin=0.2)
    assert (s["rank"], s["phase"]) == (2, "time.forward")
    assert s["ratio"] == pytest.approx(2.0) and s["median_s"] == pytest.approx(0.1)


def test_with_two_ranks_the_one_that_waited_is_not_named():
    # Two ranks: the median is their mean, so both are over it somewhere. Rank 0 began backward 150 ms before rank 1
    # and waited for it there; rank 1 began forward with rank 0 and is slow on its own.
    records = [rank(forward=0.05, backward=0.20, began={"forward": 10.0, "backward": 10.05}),
               rank(forward=0.20, backward=0.05, began={"forward": 10.0, "backward": 10.20})]
    [s] = find_stragglers(records, margin=0.2)
    assert (s["rank"], s["phase"]) == (1, "time.forward")
    assert s["ratio"] == pytest.approx(0.20 / 0.125)


def test_noise_and_tiny_excesses_are_not_stragglers():
    # Within the margin, and (on tiny CPU steps) over the margin but under the floor.
    assert find_stragglers([rank(forward=0.100), rank(forward=0.110), rank(forward=0.095)], 0.2) == []
    assert find_stragglers([rank(step_s=0.02, forward=0.002), rank(step_s=0.02, forward=0.009)], 0.2) == []
    # Off, one rank, a phase only one rank timed, NaN and missing values: nothing, and no error.
    slow = [rank(forward=0.1), rank(forward=0.5)]
    assert find_stragglers(slow, 0.0) == [] and find_stragglers(slow[:1], 0.2) == []
    assert find_stragglers([rank(forward=0.1), rank(backward=0.5), rank(forward=math.nan), {}], 0.2) == []
    # A phase the median rank spends no time in (data wait): named, with no ratio to give.
    [s] = find_stragglers([rank(data_wait=0.0), rank(data_wait=0.0), rank(data_wait=0.05)], 0.2)
    assert (s["rank"], s["ratio"]) == (2, None) and "rank 2 is over the median in time.data_wait (50 ms" in describe(s)


def test_pipeline_stages_are_compared_within_their_stage():
    # Stage 1 (ranks 2, 3) does more work than stage 0: not a straggler. Rank 3 is slow within stage 1.
    records = [rank(pipeline=0.1), rank(pipeline=0.1), rank(pipeline=0.3), rank(pipeline=0.6)]
    assert [(s["rank"], s["phase"]) for s in find_stragglers(records, 0.2, stages=2)] == [(3, "time.pipeline")]
    assert find_stragglers(records[:2] + [rank(pipeline=0.3)] * 2, 0.2, stages=2) == []
    assert find_stragglers(records, 0.2, stages=4) == []  # one rank per stage: nothing to compare with


def test_clocks_are_reported_only_where_every_rank_measured_its_own():
    gpu = {"hw.sm_clock_mhz": 1980.0, "hw.power_w": 690.0, "hw.power_capped_frac": 0.1}
    records = [{**rank(forward=0.2), **gpu} for _ in range(3)]
    records[1] = {**rank(forward=0.3), "hw.sm_clock_mhz": 1410.0, "hw.power_w": 700.0, "hw.power_capped_frac": 0.72}
    [s] = find_stragglers(records, 0.2)
    line = describe(s)
    assert line.startswith("rank 1 is 1.50x the median in time.forward (300 ms vs 200 ms a step)")
    assert "SM clock 1410 MHz vs 1980 median" in line and "power-capped 72% of the time" in line
    records[0] = rank(forward=0.2)  # a rank without its own sampler: no clock for anyone
    [s] = find_stragglers(records, 0.2)
    assert "sm_clock_mhz" not in s and "MHz" not in describe(s)


def test_a_rank_is_named_after_two_logged_steps_in_a_row_and_when_it_recovers(capsys):
    check = StragglerCheck(0.2, SimpleNamespace(world_size=2, is_main=True, device=torch.device("cpu")))
    slow = {"rank": 1, "phase": "time.forward", "ratio": 1.6, "seconds": 0.2, "median_s": 0.125, "own_s": 0.07}
    assert check._confirm([slow]) == []  # once: could be a one-off stall
    assert check._confirm([]) == [] and check._confirm([slow]) == []  # not in a row
    assert check._confirm([slow]) == [slow]
    assert check._confirm([slow]) == [slow]
    assert check._confirm([]) == []
    lines = capsys.readouterr().out.splitlines()
    assert lines == ["holotrain: straggler: rank 1 is 1.60x the median in time.forward (200 ms vs 125 ms a step)",
                     "holotrain: straggler: rank 1 is back within the margin in time.forward"]


def test_slow_rank_fault_hook(monkeypatch):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("HOLOTRAIN_SLOW_RANK", "1:forward:0.05")
    assert slow_rank_fault() == ("forward", 0.05)
    clock = PhaseClock(torch.device("cpu"))
    t0 = time.time()
    for _ in range(2):
        with clock.phase("forward"):
            pass
        with clock.phase("backward"):
            pass
    times = clock.collect(steps=2)
    assert times["time.forward"] >= 0.05 and times["time.backward"] < 0.05  # inside the named phase only
    assert t0 <= clock.began["forward"] < clock.began["backward"] <= time.time()
    monkeypatch.setenv("HOLOTRAIN_SLOW_RANK", "0:forward:0.05")
    assert slow_rank_fault() is None  # another rank's
    monkeypatch.setenv("HOLOTRAIN_SLOW_RANK", "1:forward")
    with pytest.raises(ConfigError, match="HOLOTRAIN_SLOW_RANK must be rank:phase:seconds"):
        slow_rank_fault()


def test_straggler_margin_is_validated():
    assert resolve(load_config(), tokenizer_vocab=512).profile.straggler_margin == 0.2
    with pytest.raises(ConfigError, match="profile.straggler_margin must be >= 0"):
        resolve(load_config(None, ["--profile.straggler_margin=-0.1"]), tokenizer_vocab=512)


def test_report_section_lists_stragglers_and_draws_each_rank():
    named = {"rank": 1, "phase": "time.forward", "ratio": 1.7, "seconds": 0.2, "median_s": 0.12}
    rows = [{"step": s, "rank.step_s": [0.3, 0.3], "rank.time.forward": [0.05, 0.2], "rank.time.backward": [0.2, 0.05],
             "stragglers": [named] if s in (4, 6, 10) else []} for s in (2, 4, 6, 8, 10)]
    html = stragglers_section(rows, {"training": {"log_every": 2}, "profile": {"straggler_margin": 0.2}})
    assert "<td>time.forward</td><td>4-6, 10</td>" in html and "1.70x" in html
    assert 'id="chart-ranks"' in html and "rank 1 forward" in html
    clean = stragglers_section([{**r, "stragglers": []} for r in rows], {"profile": {"straggler_margin": 0.2}})
    assert "No rank was named" in clean
    assert stragglers_section([{"step": 1, "loss": 1.0}], {}) is None  # one rank: no section


@pytest.mark.slow
def test_a_rank_slowed_in_forward_is_named_within_two_log_intervals(tmp_path):
    """Rank 1 sleeps 150 ms at the end of each forward. Logged every 2 steps, the first interval (warm-up) is not
    compared, and the next two name rank 1 in time.forward: on the console and in metrics.jsonl and the report."""
    run = tmp_path / "slow"
    args = tiny_args(run, **{"training.steps": 6, "training.log_every": 2, "checkpoint.every": 0,
                             "checkpoint.save_final": False})
    out = torchrun(2, "train", *args, env={"HOLOTRAIN_SLOW_RANK": "1:forward:0.15"})
    named = [line for line in out.splitlines() if "straggler:" in line]
    assert len(named) == 1 and "rank 1 is" in named[0] and "in time.forward" in named[0], out
    rows = read_metrics(run)
    assert [r["step"] for r in rows] == [2, 4, 6]
    assert (rows[-1]["straggler.rank"], rows[-1]["straggler.phase"]) == (1, "time.forward")
    assert rows[-1]["straggler.ratio"] > 1.2 and len(rows[-1]["rank.step_s"]) == 2
    assert 'id="stragglers"' in (run / "report.html").read_text()

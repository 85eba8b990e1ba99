"""Traces of chosen steps, bounded in size; the run's closing report; phase and memory fields in metrics."""

import gzip
import json

from conftest import read_metrics, run_cli, tiny_args

from holotrain.profile.trace import _runs, bound_trace


def test_trace_runs_group_consecutive_steps():
    assert _runs([11, 3, 10, 3]) == [(3, 3), (10, 11)]


def test_bound_trace_keeps_longest_events_and_metadata():
    events = [{"ph": "M", "name": "process_name", "pid": 1}]
    events += [{"ph": "X", "name": f"op{i}", "dur": i, "ts": i, "pid": 1, "tid": 1} for i in range(2000)]
    trace = {"traceEvents": events}
    bounded = bound_trace(trace, 20_000)
    assert len(json.dumps(bounded)) <= 20_000
    kept = [e for e in bounded["traceEvents"] if e["ph"] == "X"]
    assert kept and min(e["dur"] for e in kept) > max(e["dur"] for e in events[1:] if e not in kept)
    assert bounded["traceEvents"][0]["ph"] == "M"
    assert bounded["holotrain"]["dropped_events"] == 2000 - len(kept)
    assert bound_trace({"traceEvents": events[:5]}, 20_000) == {"traceEvents": events[:5]}


def test_traced_steps_report_and_metrics(tmp_path):
    run = tmp_path / "run"
    run_cli("train", *tiny_args(run, **{"training.steps": 6, "profile.trace_steps": "3,4",
                                        "profile.trace_max_mb": 0.05, "checkpoint.every": 0}))
    traces = sorted((run / "traces").iterdir())
    assert [p.name for p in traces] == ["trace_step3-4_rank0.json.gz"]
    raw = gzip.open(traces[0], "rt").read()
    assert len(raw) <= 0.05 * 2**20
    trace = json.loads(raw)
    names = {e.get("name") for e in trace["traceEvents"]}
    assert any("aten::" in str(n) for n in names), "the trace holds the steps' operators"

    rows = read_metrics(run)
    assert len(rows) == 6
    for row in rows:
        assert row["time.forward"] > 0 and row["time.backward"] > 0 and row["time.optimizer"] > 0
        assert row["mem.host_rss_gb"] > 0
        assert row["host.gc_s"] >= 0 and row["host.gc_full"] >= 0
        assert row["energy.joules"] is None and row["hw.sm_clock_mhz"] is None  # no NVML on a CPU run
        assert row["wall_time"] > 1.7e9
    # After the first step's freeze the interpreter makes no full collection of its own.
    assert all(row["host.gc_full"] == 0 for row in rows[1:]), [row["host.gc_full"] for row in rows]
    assert (run / "report.html").is_file(), "every run ends with its report"


def test_nested_phases_are_reported_under_their_parent():
    import time

    import torch

    from holotrain.profile import PhaseClock
    from holotrain.profile.report import _top_level

    clock = PhaseClock(torch.device("cpu"))
    with clock.phase("forward"):
        with clock.phase("offload_wait"):
            time.sleep(0.01)
    with clock.phase("offload_wait"):
        time.sleep(0.01)
    times = clock.collect(1)
    assert set(times) == {"time.forward", "time.forward.offload_wait", "time.offload_wait"}
    assert times["time.forward"] >= times["time.forward.offload_wait"] >= 0.01
    assert _top_level(sorted(times)) == ["time.forward", "time.offload_wait"]


def test_gc_clock_times_collections_and_the_freeze_is_undone():
    import gc

    from holotrain.profile.gc_clock import GcClock, freeze_long_lived, stop_full_collections, thaw

    clock = GcClock()
    gc.disable()  # no automatic collection between the calls below
    try:
        cycle = []
        cycle.append(cycle)
        del cycle
        gc.collect()
        out = clock.collect(2)
        assert out["host.gc_full"] == 1 and out["host.gc_s"] > 0
        assert clock.collect(1) == {"host.gc_s": 0.0, "host.gc_full": 0}
        before = gc.get_threshold()
        freeze_long_lived()
        saved = stop_full_collections()
        assert gc.get_freeze_count() > 0 and saved == before
        assert gc.get_threshold()[2] > 10**9  # no full collection of the interpreter's own
        thaw(saved)
        assert gc.get_freeze_count() == 0 and gc.get_threshold() == before
    finally:
        gc.enable()
        clock.close()
    assert clock._on_gc not in gc.callbacks


def test_compile_clock_times_compilations_and_trials_leave_them_out():
    """host.compile_s counts torch.compile's time in the interval it happened (a new shape compiles again); a
    planner trial's step time leaves that time out, since the run pays it once."""
    import torch

    from holotrain.plan.trials import steady_step_s
    from holotrain.profile.compile_clock import CompileClock
    from torch._dynamo.callback import callback_handler

    torch._dynamo.reset()
    clock = CompileClock()
    try:
        f = torch.compile(lambda x: (x * 2).sin(), backend="eager", dynamic=False)
        f(torch.ones(3))
        first = clock.collect(1)["host.compile_s"]
        f(torch.ones(3))
        assert first > 0 and clock.collect(1) == {"host.compile_s": 0.0}
        f(torch.ones(2, 3))  # another rank: compiled again
        assert clock.collect(2)["host.compile_s"] > 0
    finally:
        clock.close()
        torch._dynamo.reset()
    assert clock._on_start not in callback_handler.start_callbacks and clock._on_end not in callback_handler.end_callbacks
    rows = [{"step": 5, "step_s": 1.75}, {"step": 6, "step_s": 26.2, "host.compile_s": 24.4},
            {"step": 7, "step_s": 1.8, "host.compile_s": 0.0}, {"step": 8, "step_s": 1.85}]
    assert abs(steady_step_s(rows) - 1.8) < 1e-9

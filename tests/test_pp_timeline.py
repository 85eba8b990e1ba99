"""Bubble accounting: parallel/pp_timeline.py's recorder on real pipelines of one rank (every schedule runs with
pp = 1: its stages on one process), the model's prediction from measured times (plan/pipeline.py), and the report's
drawing of a gathered step."""

from __future__ import annotations

import copy
import json
import re
import time

import pytest
import torch
import torch.distributed as dist

from holotrain.model import Decoder, ModelArgs, build
from holotrain.parallel.pp import SCHEDULES, ZERO_BUBBLE, Pipeline, rank_stages, stage_bounds, stage_model, \
    stages_per_rank, unit_costs
from holotrain.parallel.pp_timeline import StageTimeline, bubble_figures, write
from holotrain.plan.pipeline import bubble_share_formula, predicted_bubble_share, schedule_order, simulate
from holotrain.profile.report.pipeline import pipeline_section, timeline_chart

T, M = 16, 4  # tokens per row, micro-batches (one row each)
ARGS = ModelArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, vocab_size=64, max_seq_len=T)
METHODS = ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk")


@pytest.fixture(scope="module")
def pp_mesh(tmp_path_factory):
    """A "pp" mesh of one gloo rank in this process."""
    from torch.distributed.device_mesh import init_device_mesh

    own = not dist.is_initialized()
    if own:
        store = tmp_path_factory.mktemp("store") / "init"
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    elif dist.get_world_size() != 1:
        pytest.skip("a process group of several ranks is already up in this process")
    yield init_device_mesh("cpu", (1,), mesh_dim_names=("pp",))["pp"]
    if own:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def base():
    torch.manual_seed(0)
    model = build(ARGS)
    model.init_weights(seed=3)
    return model


def pipeline(base: Decoder, mesh, schedule: str) -> Pipeline:
    n = stages_per_rank(schedule)
    bounds = stage_bounds(unit_costs(ARGS, T), n)
    ids = rank_stages(0, 1, schedule)
    return Pipeline([stage_model(copy.deepcopy(base), *bounds[s]) for s in ids], ids, n, mesh, schedule, M, "cpu")


def batch():
    g = torch.Generator().manual_seed(5)
    return torch.randint(0, 64, (M, T), generator=g), torch.randint(0, 64, (M, T), generator=g)


def grads(pipe: Pipeline) -> dict:
    return {n: p.grad.clone() for m in pipe.models for n, p in m.named_parameters()}


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_records_every_action_and_changes_nothing(pp_mesh, base, schedule):
    tokens, targets = batch()
    plain = pipeline(base, pp_mesh, schedule)
    want_loss, want = plain.step(tokens, targets), grads(plain)

    pipe = pipeline(base, pp_mesh, schedule)
    timeline = StageTimeline(pipe).on()
    loss = pipe.step(tokens, targets)
    assert torch.equal(loss, want_loss)
    got = grads(pipe)
    assert all(torch.equal(got[n], want[n]) for n in want)

    events = timeline.events()
    stages = pipe.stage_ids
    count = {k: sum(e["kind"] == k for e in events) for k in "FBIW"}
    if schedule in ZERO_BUBBLE:
        assert count == {"F": M * len(stages), "B": 0, "I": M * len(stages), "W": M * len(stages)}
    else:
        assert count == {"F": M * len(stages), "B": M * len(stages), "I": 0, "W": 0}
    for s in stages:
        assert sorted(e["micro"] for e in events if e["stage"] == s and e["kind"] == "F") == list(range(M))
    # one rank runs one action at a time, in the order recorded, inside its step
    for a, b in zip(events, events[1:]):
        assert a["start"] <= a["end"] <= b["start"]
    assert 0 <= events[0]["start"] and events[-1]["end"] <= timeline.wall_s()
    assert 0 < timeline.busy_s() <= timeline.wall_s()
    assert 0 <= timeline.bubble_share() < 1
    json.dumps(events)


def test_the_loss_counts_in_the_last_stage_forward(pp_mesh, base):
    pipe = pipeline(base, pp_mesh, "1f1b")
    loss_fn = pipe.schedule._loss_fn

    def slow_loss(*args, **kwargs):
        time.sleep(0.02)
        return loss_fn(*args, **kwargs)

    pipe.schedule._loss_fn = slow_loss
    timeline = StageTimeline(pipe).on()
    pipe.step(*batch())
    forwards = [e["end"] - e["start"] for e in timeline.events() if e["kind"] == "F"]
    assert len(forwards) == M and min(forwards) >= 0.02


def test_off_removes_the_wrappers(pp_mesh, base):
    pipe = pipeline(base, pp_mesh, "zbv")
    stages = pipe.schedule._stages
    timeline = StageTimeline(pipe)
    assert not timeline.enabled  # built, never switched on: nothing wrapped
    assert not any(m in vars(s) for s in stages for m in METHODS) and "step" not in vars(pipe.schedule)

    timeline.on()
    assert all(m in vars(s) for s in stages for m in METHODS) and "step" in vars(pipe.schedule)
    with pytest.raises(RuntimeError, match="already wrapped"):
        StageTimeline(pipe).on()
    pipe.step(*batch())
    assert len(timeline) == 1

    timeline.off()
    assert not any(m in vars(s) for s in stages for m in METHODS)
    assert not {"step", "_compute_loss"} & set(vars(pipe.schedule))
    pipe.step(*batch())
    assert len(timeline) == 1  # an off timeline records nothing


def test_gather_and_write(pp_mesh, base, tmp_path):
    pipe = pipeline(base, pp_mesh, "interleaved")
    timeline = StageTimeline(pipe, keep=2).on()
    for _ in range(3):
        pipe.step(*batch())
    assert len(timeline) == 2
    gathered = timeline.gather()
    assert gathered["schedule"] == "interleaved" and gathered["pp"] == 1 and gathered["micro_batches"] == M
    assert [r["rank"] for r in gathered["ranks"]] == [0] and gathered["ranks"][0]["stages"] == [0, 1]
    assert len(gathered["events"]) == 2 * 2 * M
    assert sorted(gathered["stage_times_s"]) == ["B", "F"] and len(gathered["stage_times_s"]["F"]) == 2

    doc = write(tmp_path / "pipeline_timeline.json", gathered, step=7)
    on_disk = json.loads((tmp_path / "pipeline_timeline.json").read_text())
    assert on_disk == json.loads(json.dumps(doc)) and on_disk["step"] == 7 and on_disk["version"] == 1
    assert on_disk["measured_bubble_share"] == pytest.approx(timeline.bubble_share())
    assert on_disk["predicted_bubble_share"] == pytest.approx(0.0)  # one rank: nothing to wait for
    assert on_disk["textbook_bubble_share"] == 0.0
    section = pipeline_section(tmp_path)
    assert section is not None and "<svg" in section and "interleaved" in section


@pytest.mark.parametrize("schedule,m", [("1f1b", 4), ("1f1b", 16), ("interleaved", 8)])
def test_prediction_from_equal_times_is_the_textbook(schedule, m):
    p, n = 4, 4 * stages_per_rank(schedule)
    got = predicted_bubble_share(schedule, p, m, [1.0] * n, [2.0] * n)
    assert got == pytest.approx(bubble_share_formula(schedule, p, m))
    if schedule == "1f1b":
        assert got == pytest.approx((p - 1) / (m + p - 1))


def test_prediction_of_split_schedules_and_uneven_stages():
    assert predicted_bubble_share("zb1p", 4, 8, [1.0] * 8, [1.0] * 8, [1.0] * 8) == \
        pytest.approx(bubble_share_formula("zb1p", 4, 8))
    even = predicted_bubble_share("1f1b", 4, 8, [1.0] * 4, [2.0] * 4)
    heavy_head = predicted_bubble_share("1f1b", 4, 8, [1.0, 1.0, 1.0, 1.5], [2.0, 2.0, 2.0, 3.0])
    assert heavy_head > even  # the other ranks wait for the costlier last stage
    with pytest.raises(ValueError, match="whole"):
        predicted_bubble_share("1f1b", 4, 8, [1.0] * 4, [1.0] * 4, [1.0] * 4)


def synthetic(schedule: str, pp: int, m: int) -> dict:
    """gather()'s dict for a step the simulator runs with F = 1 ms, backward 2 ms (split 1 + 1)."""
    order = schedule_order(schedule, pp, m)
    f, b, w = 1e-3, (1e-3 if order.split else 2e-3), (1e-3 if order.split else 0.0)
    timeline = simulate(order, f, b, w)
    events = []
    for rank, ops in enumerate(order.ops):
        for s, kind, i in ops:
            end = timeline.end[(s, kind, i)]
            took = f if kind == "F" else w if kind == "W" else b
            events.append({"rank": rank, "stage": s, "kind": kind, "micro": i, "start": end - took, "end": end})
    times = {"F": [f] * order.n_stages, **({"I": [b] * order.n_stages, "W": [w] * order.n_stages}
                                            if order.split else {"B": [b] * order.n_stages})}
    return {"schedule": schedule, "pp": pp, "micro_batches": m, "stages_per_rank": order.virtual, "clock": "host",
            "ranks": [{"rank": r, "stages": sorted({s for s, _, _ in order.ops[r]}), "wall_s": timeline.step_s,
                       "busy_s": timeline.busy_s[r]} for r in range(pp)],
            "events": events, "stage_times_s": times}


def test_figures_of_a_simulated_step():
    fig = bubble_figures(synthetic("1f1b", 4, 4))
    assert fig["measured_bubble_share"] == pytest.approx(3 / 7)
    assert fig["predicted_bubble_share"] == pytest.approx(3 / 7) == fig["textbook_bubble_share"]
    zbv = bubble_figures(synthetic("zbv", 4, 8))
    assert zbv["measured_bubble_share"] == pytest.approx(zbv["predicted_bubble_share"])
    assert zbv["measured_bubble_share"] < bubble_figures(synthetic("1f1b", 4, 8))["measured_bubble_share"]


def test_report_draws_a_lane_per_rank(tmp_path):
    gathered = synthetic("zb1p", 4, 8)
    svg = timeline_chart(gathered["events"], step_s=gathered["ranks"][0]["wall_s"], measured=0.25, predicted=0.2,
                         textbook=0.1)
    assert svg.startswith("<svg") and svg.endswith("</svg>")
    assert re.findall(r">rank (\d+)</text>", svg) == ["0", "1", "2", "3"]
    assert svg.count('class="lane"') == 4
    assert svg.count('class="mark"') == len(gathered["events"]) == 4 * 2 * 8 * 3
    assert "measured 25.0%" in svg and "model 20.0%" in svg and "textbook 10.0%" in svg
    for color in ("#1f77b4", "#17becf", "#9467bd"):  # F, I, W
        assert f'fill="{color}"' in svg
    assert timeline_chart([]) == "" and timeline_chart([{"rank": 0, "start": "x"}]) == ""

    # the report includes the section when the run directory holds the file
    from holotrain.profile.report import write_report

    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 2.0, "step_s": 0.1}) + "\n")
    assert pipeline_section(tmp_path) is None
    assert 'id="pipeline"' not in write_report(tmp_path).read_text()
    write(tmp_path / "pipeline_timeline.json", gathered, step=1)
    page = write_report(tmp_path).read_text()
    assert 'id="pipeline"' in page and 'id="chart-pipeline"' in page

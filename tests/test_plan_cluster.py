"""The bubble model of pipeline schedules (plan/pipeline.py) and the planner across many nodes (plan/cluster.py)."""

import dataclasses
import math
import random
from pathlib import Path

import pytest

from holotrain.errors import ConfigError
from holotrain.model.llama import LlamaArgs
from holotrain.plan.cluster import (
    Layout,
    _cut,
    _shape,
    evaluate,
    expected_loss_share,
    load_cluster,
    plan_cluster,
    young_daly_interval_s,
)
from holotrain.plan.pipeline import (
    bubble_formula,
    bubble_share_formula,
    memory_order,
    peak_in_flight,
    pipeline_step,
    schedule_order,
    simulate,
)

CLUSTERS = Path(__file__).resolve().parents[1] / "holotrain" / "configs" / "clusters"
LLAMA3_8B = LlamaArgs(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336, vocab_size=128256)
LLAMA3_70B = LlamaArgs(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim=28672, vocab_size=128256)
SEQ = 8192
# Small menus keep the planner's tests fast; the bench tries them all.
FEW = {"micro_choices": (1, 2), "ac_policies": ("none", "full"), "refine": 8}


@pytest.mark.parametrize("m", [4, 16])
def test_1f1b_bubble_is_the_textbook_share(m):
    p = 4
    step = pipeline_step("1f1b", p, m, 1.0, 1.0, 1.0)
    assert step.bubble_share == pytest.approx((p - 1) / (m + p - 1), abs=1e-9)
    assert step.step_s == pytest.approx((m + p - 1) * 3.0, abs=1e-9)
    assert step.peak_micro_batches == [4, 3, 2, 1]  # p - s on stage s


@pytest.mark.parametrize("p,m", [(4, 8), (4, 16), (8, 16), (8, 32)])
def test_zero_bubble_schedules_below_1f1b_and_interleaved_as_narayanan(p, m):
    one = pipeline_step("1f1b", p, m, 1.0, 1.0, 1.0).bubble_share
    inter = pipeline_step("interleaved", p, m, 1.0, 1.0, 1.0).bubble_share
    assert inter == pytest.approx((p - 1) / (2 * m + p - 1), abs=1e-9)
    for sched in ("zb1p", "zbv"):
        zb = pipeline_step(sched, p, m, 1.0, 1.0, 1.0)
        assert zb.bubble_share < inter < one
        assert zb.bubble_share == pytest.approx(bubble_share_formula(sched, p, m), abs=1e-9)
        assert max(zb.peak_micro_batches) <= p + 1e-9  # no more activation memory than 1f1b's first stage


def test_zb1p_formula_holds_for_unequal_passes():
    rng = random.Random(0)
    for _ in range(40):
        p, m, v = rng.choice((2, 4, 8)), 0, rng.choice((1, 2))
        m = p * rng.choice((1, 2, 4))
        F, B, W = (rng.uniform(0.2, 2.0) for _ in range(3))
        order = schedule_order("zb1p", p, m, v)
        t = simulate(order, F / v, B / v, W / v)
        assert t.step_s - m * (F + B + W) == pytest.approx(bubble_formula("zb1p", p, m, F, B, W, v), abs=1e-9)


def test_unequal_stages_and_sends_lengthen_the_step():
    order = schedule_order("1f1b", 4, 8)
    equal = simulate(order, 1.0, 1.0, 1.0)
    heavy = simulate(order, [1, 1, 1, 1.5], [1, 1, 1, 1.5], [1, 1, 1, 1.5])  # the head on the last stage
    sent = simulate(order, 1.0, 1.0, 1.0, p2p_s=0.1)
    assert heavy.step_s > equal.step_s + 8 * 1.5 - 1e-9  # the heavy stage's extra work is on the critical path
    assert heavy.bubble_share > equal.bubble_share
    # At least a send per hop down and up; in 1f1b's steady state a stage's next forward waits on the send of the
    # backward before it, so sends recur on the critical path.
    assert equal.step_s + 2 * 3 * 0.1 - 1e-9 <= sent.step_s <= equal.step_s + (2 * 3 + 2 * 8) * 0.1 + 1e-9
    assert bubble_formula("zbv", 4, 8, 1.0, 1.5, 0.5) is None  # no closed form: the simulator's case


def test_orders_are_torchs_and_memory_orders_agree():
    order = schedule_order("zbv", 4, 8)
    assert order.rank_of == (0, 1, 2, 3, 3, 2, 1, 0)  # the V
    assert order.split and sum(len(r) for r in order.ops) == 8 * 8 * 3
    assert schedule_order("interleaved", 4, 8).rank_of[4] == 0  # looped
    for sched, v in (("1f1b", 1), ("interleaved", 2), ("zb1p", 2), ("zbv", 2)):
        sizes = [1.0 + s for s in range(4 * v)]
        assert peak_in_flight(memory_order(sched, 4, 64, v), sizes) == peak_in_flight(
            schedule_order(sched, 4, 64, v), sizes)


def test_young_daly():
    assert young_daly_interval_s(2.0, 3600.0) == pytest.approx(math.sqrt(2 * 2.0 * 3600.0))
    assert young_daly_interval_s(2.0, math.inf) == math.inf
    tau = young_daly_interval_s(2.0, 3600.0)
    best = expected_loss_share(2.0, tau, 3600.0, 0.0)
    assert best == pytest.approx(math.sqrt(2 * 2.0 / 3600.0))  # the optimum's loss, to first order
    assert expected_loss_share(2.0, tau / 2, 3600.0, 0.0) > best < expected_loss_share(2.0, tau * 2, 3600.0, 0.0)


def test_stages_are_cut_as_the_trainer_cuts_them():
    cut = _cut(_shape(LLAMA3_8B), 32, SEQ, 8)
    assert sum(n for n, _, _ in cut) == 32 and cut[0][1] and cut[-1][2]
    assert cut[-1][0] < max(n for n, _, _ in cut)  # the head's stage takes fewer blocks
    assert [n for n, _, _ in _cut(_shape(LLAMA3_8B), 32, SEQ, 1)] == [32]


def test_cluster_files_load():
    for name, nodes in (("h200-8", 1), ("h200-64", 8), ("h200-512", 64)):
        c = load_cluster(CLUSTERS / f"{name}.toml")
        assert (c.nodes, c.gpus_per_node, c.gpus) == (nodes, 8, nodes * 8)
        assert c.machine.name == "NVIDIA H200" and c.machine.peak_flops == 989e12
        assert c.inter_node_bytes_s == 50e9 and c.job_mtbf_hours == pytest.approx(6335 / nodes)


def test_a_bad_cluster_file_is_one_error(tmp_path):
    bad = tmp_path / "c.toml"
    bad.write_text('nodes = 2\ngpus_per_node = 8\n[links]\nintra_node_busbw_gb_s = 200\ninter_node_gbit_s = 400\n')
    with pytest.raises(ConfigError, match=r"\[gpu\]"):
        load_cluster(bad)


@pytest.fixture(scope="module")
def one_node():
    return load_cluster(CLUSTERS / "h200-8.toml")


def test_8b_on_8_gpus_fsdp_without_pp(one_node):
    plan = plan_cluster(LLAMA3_8B, one_node, SEQ, 16 * SEQ, **FEW)
    best = plan[0]
    assert best.layout.pp == 1  # one node: the bubble and the gathered stages buy nothing
    assert best.layout.gpus == 8 and best.fits and 0.3 < best.mfu < 0.7
    assert [c.step_s for c in plan] == sorted(c.step_s for c in plan)
    assert all(c.memory_bytes <= one_node.machine.gpu_memory for c in plan)


def test_tp_stays_within_a_node(one_node):
    four = dataclasses.replace(one_node, gpus_per_node=4, nodes=4)
    plan = plan_cluster(LLAMA3_8B, four, SEQ, 32 * SEQ, **FEW)
    assert plan and all(c.layout.tp <= 4 and c.layout.tp * c.layout.cp <= 4 for c in plan)


def test_layouts_that_do_not_fit_are_rejected(one_node):
    plan = plan_cluster(LLAMA3_70B, CLUSTERS / "h200-8.toml", SEQ, 64 * SEQ, include_rejected=True, **FEW)
    assert plan and not any(c.fits for c in plan)  # 70B's 16 bytes a parameter alone fill 8 H200s
    assert all("GB a GPU" in c.why_not and c.memory_bytes > one_node.machine.gpu_memory for c in plan)
    no_ac = evaluate(LLAMA3_8B, one_node, SEQ, Layout(8, 1, 1, 1, "none", 1, 16, 1, "none"))
    assert not no_ac.fits  # 16 sequences of 8192 at once, nothing recomputed


def test_70b_on_512_gpus_pipeline_layouts(one_node):
    big = one_node.with_nodes(64)
    plan = plan_cluster(LLAMA3_70B, big, SEQ, 512 * SEQ, schedules=(("1f1b", 1), ("interleaved", 2), ("zbv", 2)),
                        micro_choices=(1,), ac_policies=("none", "pointwise"), refine=6)
    piped = [c for c in plan if c.layout.pp > 1]
    assert piped and all(c.fits for c in plan)
    best_pp = piped[0]
    assert best_pp.simulated and 0 < best_pp.phases["bubble"] < 0.2 * best_pp.step_s
    # Without pipelining every FSDP gather of 70B's blocks crosses the nodes each micro-batch; the best pipelined
    # layout is within a few percent of the best at worst.
    assert best_pp.step_s <= 1.05 * plan[0].step_s
    assert best_pp.checkpoint_interval_steps >= 1 and 0 < best_pp.goodput_loss < 0.05

"""The bubble model of pipeline schedules (plan/pipeline.py) and the planner across many nodes (plan/cluster.py)."""

import dataclasses
import math
import random
from pathlib import Path

import pytest

from holotrain.errors import ConfigError
from holotrain.model import ModelArgs
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
LLAMA3_8B = ModelArgs(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336, vocab_size=128256)
LLAMA3_70B = ModelArgs(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim=28672, vocab_size=128256)
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


# --------------------------------------------------------------------------------------------
# holotrain plan --cluster, and train --plan with what it writes

EIGHT_B = """[job]
name = "8b"
run_dir = "{run_dir}"
[model]
dim = 4096
n_layers = 32
n_heads = 32
n_kv_heads = 8
ffn_dim = 14336
vocab_size = 128256
[data]
seq_len = 8192
[training]
batch_size = 128
"""


@pytest.fixture(scope="module")
def planned_64(tmp_path_factory):
    """The 8B-like job planned by the command line for the shipped h200-64: (config file, out dir)."""
    from holotrain.cli import main

    root = tmp_path_factory.mktemp("cluster-plan")
    config = root / "8b.toml"
    config.write_text(EIGHT_B.format(run_dir=root / "run"))
    assert main(["plan", "--config", str(config), "--cluster", "h200-64", "--out", str(root / "plan")]) == 0
    return config, root / "plan"


def test_plan_cluster_cli_writes_an_overlay_for_the_cluster(planned_64):
    import json

    from holotrain.config import load_config, resolve
    from holotrain.plan.planner import read_overlay
    from holotrain.plan.trials import as_override

    config, out = planned_64
    text = (out / "plan.toml").read_text()
    assert text.startswith("# holotrain plan for the cluster h200-64 (") and "h200-64.toml" in text.splitlines()[0]
    assert "not for the machine that wrote it" in text
    planned, sections = read_overlay(out / "plan.toml")
    assert planned["cluster"] == "h200-64" and planned["job"].endswith(", 64 ranks")
    # The overlay's keys load as any config's do, and the job with them resolves.
    overrides = [as_override(f"{s}.{k}", v) for s, kv in sections.items() for k, v in kv.items()]
    cfg = resolve(load_config(config, overrides))
    p = cfg.parallel
    plan = json.loads((out / "plan.json").read_text())
    chosen = [c for c in plan["candidates"] if c["chosen"]]
    assert len(chosen) == 1 and chosen[0] is plan["candidates"][0]
    lay = chosen[0]["layout"]
    assert (p.tp, p.cp, p.pp, cfg.training.micro_batch_size) == (lay["tp"], lay["cp"], lay["pp"], lay["micro"])
    assert cfg.memory.activation_checkpointing == lay["ac"]
    assert lay["dp"] * lay["tp"] * lay["cp"] * lay["pp"] == 64  # the cluster's GPUs
    assert lay["dp"] * lay["micro"] * lay["micro_batches"] == cfg.training.batch_size
    # Every layout is in plan.json, the ones that do not fit too.
    assert any(not c["predicted"]["fits"] for c in plan["candidates"]) and len(plan["candidates"]) > 100
    # checkpoint.every: the Young/Daly interval (no shorter than a node's background write) over the step before saves.
    pred, ck = chosen[0]["predicted"], chosen[0]["checkpoint"]
    cluster = load_cluster(CLUSTERS / "h200-64.toml")
    interval = max(young_daly_interval_s(ck["save_s"], cluster.job_mtbf_hours * 3600), ck["write_s"])
    assert ck["interval_s"] == pytest.approx(interval)
    assert cfg.checkpoint.every == max(1, round(interval / (pred["step_s"] - pred["phases_s"]["checkpoint"]))) > 1
    split = pred["split_s"]
    assert sum(split.values()) == pytest.approx(pred["step_s"]) and split["compute"] > split["comm"] > 0


def test_train_refuses_a_cluster_plan_off_its_cluster(planned_64, monkeypatch, capsys):
    from holotrain.cli import main

    config, out = planned_64
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert main(["train", "--config", str(config), "--plan", str(out / "plan.toml")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "is for the cluster h200-64 (8 nodes x 8 NVIDIA H200)" in err
    assert "torchrun --nnodes 8 --nproc_per_node 8" in err


def test_train_takes_a_cluster_plan_on_its_cluster(planned_64, monkeypatch):
    import json

    import holotrain.plan.machine
    from holotrain.cli import _planned

    config, out = planned_64
    cluster = load_cluster(CLUSTERS / "h200-64.toml")
    monkeypatch.setenv("WORLD_SIZE", "64")  # one rank of the 64-rank launch, on an H200
    monkeypatch.setattr(holotrain.plan.machine, "machine_fingerprint", lambda *_: cluster.machine.fingerprint)
    overrides = _planned(str(config), [], str(out / "plan.toml"))
    layout = json.loads((out / "plan.json").read_text())["candidates"][0]["layout"]
    assert f"--parallel.tp={layout['tp']}" in overrides and "--training.compile=true" in overrides
    assert (config.parent / "run" / "plan.json").is_file()  # beside the run, for the report


def test_plan_cluster_keeps_what_the_command_line_sets(tmp_path):
    from holotrain.plan.cluster_cli import make_cluster_plan

    config = tmp_path / "8b.toml"
    config.write_text(EIGHT_B.format(run_dir=tmp_path / "run"))
    plan = make_cluster_plan(str(config), ["--parallel.tp=8", "--memory.activation_checkpointing=full"],
                             "h200-64", tmp_path / "plan")
    assert all(c.layout.tp == 8 and c.layout.ac == "full" for c in plan.candidates)
    assert "tp = 8" in (tmp_path / "plan" / "plan.toml").read_text()


def test_an_unknown_cluster_is_one_error_naming_it(tmp_path, capsys):
    from holotrain.cli import main
    from holotrain.plan.cluster_cli import find_cluster

    with pytest.raises(ConfigError, match=r"cluster file not found: h200-6 \(shipped clusters, by name: .*h200-64"):
        find_cluster("h200-6")
    assert find_cluster("h200-64.toml") == find_cluster("h200-64")
    assert main(["plan", "--cluster", "h200-6", "--out", str(tmp_path)]) == 2
    assert "cluster file not found: h200-6 " in capsys.readouterr().err

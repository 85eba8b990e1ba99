"""Routing made visible (holotrain/train/routing.py): a tiny mixture-of-experts model trained through the real
trainer writes the moe.* fields (metrics.jsonl, TensorBoard) and the report's heat map; the sigmoid router's bias
moves by the update computed by hand from the logged loads (summed over the step's micro-batches) and survives a
resume. Plus the bookkeeping itself on a model in this process: only the training step's forwards count."""

import dataclasses
import math

import pytest
import torch
import torch.distributed.checkpoint as dcp

from holotrain.config import load_config
from holotrain.model import ModelArgs, build
from holotrain.parallel import DistEnv
from holotrain.parallel.dims import ParallelDims
from holotrain.train.checkpoint import SafeFileSystemReader
from holotrain.train.routing import Routing
from tests.conftest import read_metrics, tiny_args

E, K, RATE = 4, 2, 0.01
MOE = {"model.family": "qwen3_moe", "model.n_experts": E, "model.n_active_experts": K, "model.moe_ffn_dim": 32,
       "model.head_dim": 16}


def _train(run_dir, steps: int, **extra):
    from holotrain.train import train

    # batch 8 in micro-batches of 4: two forwards a step, whose loads the step sums
    return train(load_config(None, tiny_args(run_dir, **{
        **MOE, "model.router": "sigmoid", "model.router_bias_rate": RATE, "training.steps": steps,
        "training.micro_batch_size": 4, "checkpoint.every": 2, **extra})))


def _bias_by_hand(rows) -> torch.Tensor:
    """bias += rate * sign(mean - load) after every step, from each step's logged load (as MoE.update_bias does)."""
    bias = torch.zeros(len(rows[0]["moe.layers"]), E)
    for row in rows:
        for layer, load in enumerate(torch.tensor(row["moe.tokens_per_expert"], dtype=torch.float64).float()):
            bias[layer] += RATE * torch.sign(load.mean() - load)
    return bias


def _saved_bias(checkpoint, layers) -> torch.Tensor:
    state = {"model": {f"layers.{i}.feed_forward.expert_bias": torch.full((E,), math.nan) for i in layers}}
    dcp.load(state, checkpoint_id=checkpoint, storage_reader=SafeFileSystemReader(checkpoint))
    return torch.stack([state["model"][f"layers.{i}.feed_forward.expert_bias"] for i in layers])


def _tiny_model_and_routing(**extra) -> tuple[torch.nn.Module, Routing]:
    """A two-block Qwen3-MoE of E experts, top K, built in this process, with its Routing (one process)."""
    from holotrain.model.registry import fix_switches, preset

    args = dataclasses.replace(preset("qwen3_moe", "tiny"), family="qwen3_moe", dim=32, n_layers=2, n_heads=2,
                               n_kv_heads=1, head_dim=16, ffn_dim=32, moe_ffn_dim=16, n_experts=E, vocab_size=64,
                               max_seq_len=16, n_active_experts=K, **extra)
    fix_switches("qwen3_moe", args)
    torch.manual_seed(0)
    model = build(args)
    env = DistEnv(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    return model, Routing(model, RATE, env, ParallelDims(world=1))


@pytest.fixture(scope="module")
def sigmoid_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("moe-routing")
    _train(run_dir, 4, **{"profile.tensorboard": True})
    return run_dir


def test_rows_carry_the_routing_of_each_step(sigmoid_run):
    rows = read_metrics(sigmoid_run)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    tokens = 8 * 32 * K  # the step's whole batch (both micro-batches, not an eval's) as token copies
    for row in rows:
        assert row["moe.layers"] == [0, 1]
        loads = row["moe.tokens_per_expert"]
        assert [sum(load) for load in loads] == [tokens, tokens], row["step"]
        ratios = [max(load) / (tokens / E) for load in loads]
        assert row["moe.load_max_over_mean"] == pytest.approx(ratios)
        assert row["moe.max_load"] == pytest.approx(max(ratios))
        assert all(0 < h <= math.log(E) + 1e-6 for h in row["moe.router_entropy_by_layer"])
        assert row["moe.router_entropy"] == pytest.approx(sum(row["moe.router_entropy_by_layer"]) / 2)
        assert all(b > 0.9 for b in row["moe.balance_loss_by_layer"]) and row["moe.z_loss"] > 0
        assert all(1 / K <= g <= 1 for g in row["moe.top_gate_by_layer"])
        assert row["moe.top_gate"] == pytest.approx(sum(row["moe.top_gate_by_layer"]) / 2)
    # |bias| grows by at most the rate a step
    assert 0 < rows[-1]["moe.expert_bias_max_abs"] <= 4 * RATE + 1e-6


def test_sigmoid_bias_is_the_update_of_the_summed_loads_and_survives_resume(sigmoid_run):
    rows = read_metrics(sigmoid_run)
    saved = _saved_bias(sigmoid_run / "checkpoints" / "step-4", [0, 1])
    assert torch.equal(saved, _bias_by_hand(rows))
    assert saved.abs().max().item() == pytest.approx(rows[-1]["moe.expert_bias_max_abs"])
    # Resumed from step 4's checkpoint: the bias goes on from the saved one (from zero it would differ).
    _train(sigmoid_run, 5)
    rows = read_metrics(sigmoid_run)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    assert torch.equal(_saved_bias(sigmoid_run / "checkpoints" / "step-5", [0, 1]), _bias_by_hand(rows))


def test_report_and_tensorboard_show_the_routing(sigmoid_run):
    page = (sigmoid_run / "report.html").read_text()
    assert '<section id="moe">' in page
    assert 'id="chart-moe-load"' in page and 'id="chart-moe-max-load"' in page
    heat = page.split('id="chart-moe-load"')[1].split("</svg>")[0]
    assert heat.count('<rect class="mark"') == 2 * E  # a cell per block and expert
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tags = EventAccumulator(str(sigmoid_run / "tb")).Reload().Tags()["scalars"]
    for tag in ("moe/max_load", "moe/balance_loss", "moe/load_max_over_mean/layer_0", "moe/router_entropy/layer_1",
                "moe/balance_loss/layer_0", "moe/expert_bias_max_abs/layer_1"):
        assert tag in tags, tags


def test_only_the_training_steps_forwards_count():
    """Two micro-batches' loads are summed; an eval's forward (in grad mode too) between steps is not; a softmax
    router logs no bias; a dense model gives no fields."""
    model, routing = _tiny_model_and_routing()
    batches = [torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(s)) for s in range(3)]
    routing.begin_step()
    expected = 0
    for tokens in batches[:2]:
        model(tokens, tokens).backward()
        expected = expected + model.expert_load()
    routing.end_step()
    model(batches[2], batches[2])  # an eval's forward
    row = routing.metrics()
    assert row["moe.tokens_per_expert"] == expected.tolist()
    assert "moe.expert_bias_max_abs" not in row
    routing.close()
    dense = build(dataclasses.replace(model.args, n_experts=0, n_active_experts=0, moe_ffn_dim=0))
    assert Routing(dense, RATE, DistEnv(rank=0, world_size=1, local_rank=0, device=torch.device("cpu")), ParallelDims(world=1)).metrics() == {}


@pytest.mark.slow
def test_expert_parallel_training_run_equals_one_process(sigmoid_run, tmp_path):
    """`holotrain train` under torchrun with parallel.ep = 2 (the config, the lever, the trainer, the routing
    metrics and the bias update together): the same losses, loads and saved bias as the one-process run."""
    from tests.test_distributed import torchrun

    args = {**MOE, "model.router": "sigmoid", "model.router_bias_rate": RATE, "training.steps": 4,
            "training.micro_batch_size": 4, "checkpoint.every": 2, "profile.tensorboard": True}
    out = torchrun(2, "train", *tiny_args(tmp_path, **args), "--parallel.ep=2")
    assert "world size 2" in out, out
    one, two = read_metrics(sigmoid_run)[:4], read_metrics(tmp_path)  # (another test resumes the first to step 5)
    assert [r["step"] for r in two] == [1, 2, 3, 4]
    for a, b in zip(one, two):
        assert b["loss"] == pytest.approx(a["loss"], abs=1e-5), (a["step"], a["loss"], b["loss"])
        assert b["moe.tokens_per_expert"] == a["moe.tokens_per_expert"]
    assert torch.equal(_saved_bias(tmp_path / "checkpoints" / "step-4", [0, 1]), _bias_by_hand(one))


def test_solved_bias_balances_scores_that_differ_little_between_tokens():
    """balancing_bias: scores with a shared part 0.1 across experts and 0.01 between tokens (top-k of the plain scores:
    every token the same experts) balanced to within 2%, whatever the rows' order."""
    from holotrain.model.moe import balancing_bias

    n, generator = 2048, torch.Generator().manual_seed(0)
    shared = 0.1 * torch.randn(8 * E, generator=generator)
    scores = (shared + 0.01 * torch.randn(n, 8 * E, generator=generator)).sigmoid()

    def max_over_mean(bias):
        load = torch.zeros(8 * E).scatter_add_(0, (scores + bias).topk(K).indices.flatten(), torch.ones(n * K))
        return (load.max() / load.mean()).item()

    bias = balancing_bias(scores, torch.zeros(8 * E), K)
    assert max_over_mean(torch.zeros(8 * E)) > 4 and max_over_mean(bias) < 1.02
    shuffled = scores[torch.randperm(n, generator=generator)]
    assert torch.equal(balancing_bias(shuffled, torch.zeros(8 * E), K), bias)


def test_solve_sets_the_bias_from_the_steps_scores():
    """router_bias_update = "solve": after the step, each block's bias is balancing_bias over both micro-batches'
    scores, from the bias it had."""
    from holotrain.model.moe import balancing_bias

    model, routing = _tiny_model_and_routing(router="sigmoid", router_bias_update="solve")
    moes = list(model.moe_modules().values())
    start = torch.tensor([0.3, -0.1, 0.0, -0.2])
    for moe in moes:
        moe.expert_bias.copy_(start)
    seen = [[] for _ in moes]
    routing.begin_step()
    for s in range(2):
        tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(s))
        model(tokens, tokens).backward()
        for kept, moe in zip(seen, moes):
            kept.append(moe.last_scores)
    routing.end_step()
    for kept, moe in zip(seen, moes):
        assert torch.equal(moe.expert_bias, balancing_bias(torch.cat(kept), start, K))
        assert not torch.equal(moe.expert_bias, start)
    routing.close()


def test_batch_bias_balances_each_training_forward_of_a_softmax_router():
    """router_bias_update = "batch" on a softmax router with a balancing bias (model.router_bias): a training
    forward's tokens, which all prefer the same experts, are spread evenly by a bias solved on them; its
    recomputation (activation checkpointing) routes the same; evaluation (no grad) routes with the kept bias."""
    from holotrain.model.moe import MoE
    from holotrain.model.registry import preset

    experts = 16
    args = dataclasses.replace(preset("qwen3_moe", "tiny"), family="qwen3_moe", dim=32, n_experts=experts,
                               n_active_experts=2, moe_ffn_dim=8, router_bias=True, router_bias_update="batch")
    torch.manual_seed(0)
    moe = MoE(args)
    for w in (moe.router.weight, moe.w1, moe.w3, moe.w2):
        torch.nn.init.normal_(w, std=0.1)
    moe.reset_buffers()
    x = torch.randn(32) + 0.3 * torch.randn(512, 32)  # a shared part: every token wants the same few experts

    def max_over_mean() -> float:
        load = moe.last_load.float()
        return (load.max() / load.mean()).item()

    with torch.no_grad():
        moe(x)
    assert max_over_mean() > 3
    plain = x.clone().requires_grad_()
    moe(plain).square().sum().backward()
    assert max_over_mean() < 1.1
    assert not torch.equal(moe.last_bias, moe.expert_bias)
    grads = [plain.grad, moe.router.weight.grad.clone()]
    moe.zero_grad()
    again = x.clone().requires_grad_()
    torch.utils.checkpoint.checkpoint(moe, again, use_reentrant=False).square().sum().backward()
    assert torch.equal(again.grad, grads[0]) and torch.equal(moe.router.weight.grad, grads[1])
    with torch.no_grad():
        moe(x)
    assert max_over_mean() > 3  # the bias is the trainer's to keep (Routing.end_step)
    moe.balancing.fill_(False)  # between steps (an evaluation runs in grad mode too): the kept bias
    moe(x)
    assert max_over_mean() > 3


def test_biased_weights_weight_the_balanced_choice():
    """model.router_bias_weights: the experts the balancing bias chose are weighted by the softmax of the biased
    logits (over the k, with norm_topk_prob), so an expert the bias sent a token to counts in its output as the
    choice says; moe.top_gate (a token's largest weight over its k weights' sum) shows the difference. Only the
    softmax router with its bias takes the switch (one line otherwise)."""
    from holotrain.model.moe import MoE, moe_problem
    from holotrain.model.registry import preset

    args = dataclasses.replace(preset("qwen3_moe", "tiny"), family="qwen3_moe", dim=32, n_experts=16,
                               n_active_experts=4, moe_ffn_dim=8, router_bias=True, router_bias_update="batch")
    assert args.norm_topk_prob
    x = torch.randn(32) + 0.3 * torch.randn(512, 32)  # every token wants the same few experts
    gates = {}
    for biased in (False, True):
        torch.manual_seed(0)
        moe = MoE(dataclasses.replace(args, router_bias_weights=biased))
        for w in (moe.router.weight, moe.w1, moe.w3, moe.w2):
            torch.nn.init.normal_(w, std=0.1)
        moe.reset_buffers()
        weights, experts, logits, _ = moe.route(x)
        if biased:
            want = (logits.float() + moe.last_bias).softmax(-1).gather(-1, experts)
            torch.testing.assert_close(weights, want / want.sum(-1, keepdim=True))
        moe(x.clone().requires_grad_())
        gates[biased] = moe.last_top_gate.item()
    assert 0.25 <= gates[True] < gates[False] - 0.05  # the forced experts count once weighted by the biased logits
    assert "model.router_bias_weights" in moe_problem(dataclasses.replace(args, router="sigmoid",
                                                                          router_bias_weights=True))


def test_batch_bias_is_kept_after_the_step_for_evaluation():
    """After a step, each block's bias is its last training forward's solution, and evaluation (in grad mode, as
    training's forwards) then routes with it; the logged row has the bias's spread."""
    model, routing = _tiny_model_and_routing(router_bias=True, router_bias_update="batch")
    moes = list(model.moe_modules().values())
    routing.begin_step()
    for s in range(2):
        tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(s))
        model(tokens, tokens).backward()
    solved = [moe.last_bias.clone() for moe in moes]
    assert all(moe.balancing for moe in moes)
    routing.end_step()
    for moe, bias in zip(moes, solved):
        assert torch.equal(moe.expert_bias, bias) and bias.abs().max() > 0
        assert not moe.balancing  # an evaluation before the next step routes with expert_bias
    assert "moe.expert_bias_max_abs" in routing.metrics()
    routing.close()


def test_a_fine_tune_may_change_how_the_load_is_balanced(tmp_path):
    """model.init_from: the balancing settings may differ from the source's (a fine-tune's choice: "batch", a bias
    on the softmax router and its biased weights where the source saved "solve" and none), while a dimension that
    differs is refused.
    (A bias the source lacked starts at zero: tests/test_moe.py, from a Hugging Face directory.)"""
    from holotrain.config import ModelConfig
    from holotrain.errors import ConfigError
    from holotrain.model.pretrained import Pretrained, apply_fields

    source = Pretrained("run", tmp_path, {"family": "qwen3_moe", "dim": 64, "router_bias": False,
                                          "router_bias_update": "solve", "router_bias_weights": False},
                        tmp_path / "tokenizer.json")
    section = ModelConfig(router_bias=True, router_bias_update="batch", router_bias_weights=True)
    apply_fields(section, source)
    assert (section.family, section.dim, section.router_bias, section.router_bias_update,
            section.router_bias_weights) == ("qwen3_moe", 64, True, "batch", True)
    with pytest.raises(ConfigError, match="model.dim = 32 differs from model.init_from's 64"):
        apply_fields(ModelConfig(dim=32), source)

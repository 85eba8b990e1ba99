"""The memory plan and the cost model of a mixture of experts: the saved tensors of model/moe.py's feed-forward against
model/costs.py's count, total and active parameters, expert parallelism's all-to-all bytes and its place in both
planners (plan/moe.py)."""

import dataclasses
import itertools
import json
from pathlib import Path

import pytest
import torch
from torch import nn

from holotrain.model import ModelArgs, build
from holotrain.model.costs import (block_params, block_saved_values, expert_flops_per_token, expert_params,
                                   flops_per_token, model_params, moe_saved_bytes)
from holotrain.model.moe import MoE
from holotrain.model.parts import Attention, Block
from holotrain.parallel.cost import EP_IMBALANCE, ep_bytes_per_step, fsdp_bytes_per_step, fsdp_ep_bytes_per_step
from holotrain.plan.moe import EP_SYNC_S, GROUPED_PEAK, grouped_efficiency, moe_terms

CLUSTERS = Path(__file__).resolve().parents[1] / "holotrain" / "configs" / "clusters"
TINY = dict(dim=64, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=96, vocab_size=100, n_experts=8, n_active_experts=2,
            moe_ffn_dim=48, max_seq_len=64)


def _saved_bytes(fn, module: nn.Module) -> int:
    """Bytes of the tensors autograd saves while fn() runs, each storage once, the module's parameters and buffers
    aside (the memory plan counts weights apart)."""
    own = {t.untyped_storage().data_ptr() for t in itertools.chain(module.parameters(), module.buffers())}
    seen = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in own:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())


def _moe(args: ModelArgs, dtype: torch.dtype) -> MoE:
    torch.manual_seed(0)
    moe = MoE(args).to(dtype)
    for p in moe.parameters():
        nn.init.normal_(p, std=0.02)
    return moe


@pytest.mark.parametrize("router,norm,shared,aux,z", [
    ("softmax", True, 0, 0.0, 0.0), ("softmax", False, 40, 0.0, 1e-3), ("sigmoid", True, 0, 1e-2, 0.0),
    ("sigmoid", False, 40, 0.0, 1e-3)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_moe_saved_bytes_are_what_autograd_saves(router, norm, shared, aux, z, dtype):
    """model/costs.py's moe_saved_bytes against the saved tensors of model/moe.py's feed-forward (eager, the CPU's
    reference experts), each router and its options."""
    args = ModelArgs(**TINY, router=router, norm_topk_prob=norm, shared_ffn_dim=shared, moe_aux_loss_coef=aux,
                     router_z_loss_coef=z)
    moe, n = _moe(args, dtype), 512
    x = torch.randn(n, args.dim, dtype=dtype, requires_grad=True)
    measured = _saved_bytes(lambda: moe(x), moe) / n
    assert measured == pytest.approx(moe_saved_bytes(args, x.element_size()), rel=0.01)


def test_a_moe_blocks_feed_forward_keeps_what_the_plan_counts():
    """A whole block: what a MoE block saves beyond the same block without a feed-forward is moe_saved_bytes (the
    rest, attention and norms, is block_saved_values' share, fitted to measured peaks)."""
    args = ModelArgs(**{**TINY, "n_active_experts": 3}, norm_topk_prob=True)

    class Nothing(nn.Module):
        def forward(self, x):
            return x * 0

    T, dtype = 64, torch.bfloat16
    cos, sin = torch.ones(T, args.head_dim), torch.zeros(T, args.head_dim)
    moe = _moe(args, dtype)
    blocks = [Block(args, Attention(args), ffn).to(dtype) for ffn in (moe, Nothing())]
    blocks[1].load_state_dict(blocks[0].state_dict(), strict=False)
    x = torch.randn(4, T, args.dim, dtype=dtype, requires_grad=True)
    with_moe, without = (_saved_bytes(lambda b=b: b(x, cos, sin), b) for b in blocks)
    assert (with_moe - without) / (4 * T) == pytest.approx(moe_saved_bytes(args, 2), rel=0.02)
    # block_saved_values counts the attention part of a MoE block, not its feed-forward.
    dense = dataclasses.replace(args, n_experts=0)
    assert block_saved_values(dense) - block_saved_values(args) == 2 * args.ffn_dim


@pytest.mark.slow
def test_compiled_moe_saves_what_the_compiled_count_says():
    """Compiled (inductor on the CPU, the grouped GEMMs as on a GPU): silu(gate), the copies in token order and the
    renormalization are recomputed in backward."""
    args = ModelArgs(**{**TINY, "dim": 128, "moe_ffn_dim": 64}, norm_topk_prob=True, shared_ffn_dim=96)
    moe, n = _moe(args, torch.bfloat16), 1024
    moe.grouped = True
    compiled = torch.compile(moe)
    x = torch.randn(n, args.dim, dtype=torch.bfloat16, requires_grad=True)
    compiled(x).sum().backward()
    measured = _saved_bytes(lambda: compiled(x), moe) / n
    assert measured == pytest.approx(moe_saved_bytes(args, 2, compiled=True), rel=0.01)
    assert moe_saved_bytes(args, 2, compiled=True) < moe_saved_bytes(args, 2)


def _qwen3_30b_a3b(**changes) -> ModelArgs:
    from holotrain.model.registry import family_of

    family = family_of("qwen3_moe")
    return dataclasses.replace(family.presets["30b-a3b"], family="qwen3_moe", max_seq_len=4096,
                               **{**family.fixed, **changes})


def test_30b_a3b_total_and_active_parameters():
    """Qwen publishes Qwen3-30B-A3B as 30.5 B parameters, 3.3 B activated (3.35 B: the embedding row and the head
    counted, the 8 of 128 experts a token goes through): the memory plan holds every parameter, the time model the
    active ones."""
    from holotrain.memory.plan import plan_memory
    from holotrain.plan.planner import job_config

    args = _qwen3_30b_a3b()
    total, active = model_params(args), model_params(args, active=True)
    assert round(total / 1e9, 1) == 30.5 and 3.3e9 <= active < 3.4e9
    assert expert_params(args) == 48 * 3 * 128 * 2048 * 768  # 29.0 B of the 30.5 B
    # The experts' grouped GEMMs are 6 FLOPs per active expert weight of flops_per_token's linear count.
    assert expert_flops_per_token(args) == 6 * 48 * 3 * 2048 * 768 * 8
    assert flops_per_token(args, 0) == 6 * (active - 2048 * 151936 - 48 * (2 * 2048 + 2 * 128) - 2048)
    cfg = job_config(None, ["--model.family=qwen3_moe", "--model.preset=30b-a3b", "--data.seq_len=4096"])
    with torch.device("meta"):
        model = build(args)
    plan = plan_memory(model, cfg, 8, torch.device("cuda"), 1, 1, gpu_capacity=1e12, host_capacity=1e12)
    assert plan.n_params == total
    assert plan.gpu["fp32 weights and AdamW moments kept on the GPU"] == pytest.approx(12 * total / 8)


def test_the_memory_plan_of_a_moe_model_per_checkpointing_mode_and_ep():
    """Activations: a MoE block keeps its attention part (fitted bytes per value) and moe_saved_bytes; recomputed
    blocks keep their input only; under expert parallelism the experts' rows of the busiest rank (EP_IMBALANCE), and
    FSDP2 gathers a block's ep-th of the experts."""
    from holotrain.memory.plan import SAVED_BYTES, activations, plan_memory
    from holotrain.plan.cost import with_settings
    from holotrain.plan.planner import job_config

    overrides = ["--model.family=qwen3_moe", "--model.preset=30b-a3b", "--model.n_layers=4", "--data.seq_len=4096",
                 "--training.compile=true", "--training.dtype=bf16", "--training.batch_size=8"]
    cfg = job_config(None, overrides)
    args = _qwen3_30b_a3b(n_layers=4)
    tokens = 4096

    def saved(**settings):
        return activations(with_settings(cfg, settings), 1, 2, 0).saved

    per_block = tokens * (2 * SAVED_BYTES * block_saved_values(args) + moe_saved_bytes(args, 2, compiled=True))
    lse = tokens * 32 * 4
    assert saved(**{"memory.activation_checkpointing": "none"}) == pytest.approx(4 * (per_block + lse))
    assert saved(**{"memory.activation_checkpointing": "full"}) == pytest.approx(4 * tokens * 2 * 2048)
    ep = saved(**{"memory.activation_checkpointing": "none", "parallel.ep": 8}) - saved(
        **{"memory.activation_checkpointing": "none"})
    assert ep == pytest.approx(4 * tokens * 8 * (EP_IMBALANCE - 1) * (2048 + 3 * 768) * 2)
    # "pointwise" keeps the router's logits and the experts' grouped GEMM outputs (kept ops), not their pointwise
    # products.
    assert saved(**{"memory.activation_checkpointing": "pointwise"}) < 0.7 * saved(**{"memory.activation_checkpointing":
                                                                                      "none"})
    with torch.device("meta"):
        model = build(args)
    gathered = {ep: plan_memory(model, with_settings(cfg, {"parallel.ep": ep}), 8, torch.device("cuda"), 1, 1,
                                gpu_capacity=1e12, host_capacity=1e12).gpu["gathered blocks (FSDP2)"] for ep in (1, 8)}
    # Two bf16 blocks: 623 M parameters each; under ep = 8 a block's 604 M of experts an eighth, and the largest unit
    # gathered the head with the final norm (311 M).
    block, experts, head = block_params(args), expert_params(args, 0), 2048 * 151936 + 2048
    assert gathered[1] == 2 * 2 * block
    assert gathered[8] == 2 * 2 * max(block - experts * 7 / 8, head) == 2 * 2 * head


def test_the_memory_plan_of_the_4_layer_30b_a3b_against_its_h200_peaks():
    """The Qwen3-30B-A3B shape at 4 layers (micro-batch 4 x 8, bf16, no recomputation) peaked at 58.7 GB on an H200
    with the experts on bf16 copies made once a step, 63.5 GB with their weights cast at each micro-batch
    (bench/RESULTS.md, 2026-12-06): the plan within 3% of each; the copies keep no cast per block."""
    from holotrain.config import batch_layout
    from holotrain.memory.plan import plan_memory
    from holotrain.plan.cost import with_settings
    from holotrain.plan.planner import job_config
    from holotrain.train.resolve import model_args

    for copies, measured in ((True, 58.7), (False, 63.5)):
        cfg = with_settings(job_config("qwen3-30b-a3b", ["--model.n_layers=4"]),
                            {"training.fp8": "none", "memory.activation_checkpointing": "none",
                             "training.expert_weight_copies": copies})
        with torch.device("meta"):
            model = build(model_args(cfg))
        micro, accum = batch_layout(cfg, 1)
        plan = plan_memory(model, cfg, 1, torch.device("cuda"), micro, accum, gpu_capacity=140e9,
                           host_capacity=120e9)
        assert (micro, accum) == (4, 8) and plan.gpu_need / 1e9 == pytest.approx(measured, rel=0.03), copies


def test_all_to_all_bytes_and_time():
    """Dispatch and combine, forward and backward, each tokens x k x dim x bytes x (ep - 1) / ep; the time at the
    link's rate on the busiest rank (EP_IMBALANCE), with the host's waits for the counts."""
    tokens, dim, k, layers = 4096, 2048, 8, 48
    each = tokens * k * dim * 2 * 7 / 8
    assert ep_bytes_per_step(tokens, dim, k, layers, 8, 2) == pytest.approx(4 * each * layers * 2)
    assert ep_bytes_per_step(tokens, dim, k, layers, 1, 2) == 0.0
    # Full recomputation runs the forward's two again.
    assert ep_bytes_per_step(tokens, dim, k, layers, 8, 2, recomputed=1.0) == pytest.approx(6 * each * layers * 2)
    # FSDP2 under ep: the experts gathered as a rank's ep-th over the dp / ep ranks that share it.
    assert fsdp_ep_bytes_per_step(30_000, 24_000, 16, 4, 4) == pytest.approx(
        fsdp_bytes_per_step(6_000, 16, 1) + fsdp_bytes_per_step(6_000, 4, 1))
    assert fsdp_ep_bytes_per_step(30_000, 24_000, 8, 8, 1) == fsdp_bytes_per_step(6_000, 8, 1)
    args = _qwen3_30b_a3b()
    link = 200e9
    t = moe_terms(args, tokens, 2, 8, 2, 600e12, link)
    assert t.total_params == model_params(args) and t.active_params == model_params(args, active=True)
    assert t.all_to_all_bytes == pytest.approx(4 * each * layers * 2)
    assert t.all_to_all_s == pytest.approx(t.all_to_all_bytes * EP_IMBALANCE / link + EP_SYNC_S * layers * 2)
    assert t.exposed_s == t.all_to_all_s - t.hidden_s and 0 <= t.hidden_s <= t.expert_s
    # A rank's experts take the copies of ep ranks' tokens: 4096 x 8 x 8 / 128 rows an expert, at the curve's rate.
    assert t.rows_per_expert == 2048 and t.grouped_efficiency == grouped_efficiency(2048)
    assert t.expert_s == pytest.approx(expert_flops_per_token(args) * tokens * 2 / (600e12 * t.grouped_efficiency)
                                       * EP_IMBALANCE)
    alone = moe_terms(args, tokens, 2, 1, 2, 600e12, link)
    assert alone.all_to_all_bytes == alone.all_to_all_s == 0 and alone.rows_per_expert == 256
    assert moe_terms(dataclasses.replace(args, n_experts=0), tokens, 2, 1, 2, 600e12, link) is None


def test_grouped_gemms_run_below_the_dense_rate_the_fewer_rows_an_expert_gets():
    rates = [grouped_efficiency(r) for r in (8, 64, 256, 1024, 8192)]
    assert rates == sorted(rates) and 0 < rates[0] < 0.2 and rates[-1] <= GROUPED_PEAK


BIG_EXPERTS = ModelArgs(family="mixtral", dim=4096, n_layers=8, n_heads=32, n_kv_heads=8, ffn_dim=4096,
                        vocab_size=32000, n_experts=64, n_active_experts=2, moe_ffn_dim=4096)
FEW = {"micro_choices": (1, 2), "ac_policies": ("none", "full"), "refine": 4}


def test_the_cluster_planner_splits_the_experts_when_memory_needs_it():
    """8 GPUs of 62 GB: the 26 B-parameter model's shards (16 bytes a parameter over 8 ranks: 53 GB) leave no room for
    FSDP2's two gathered blocks of 3.3 B parameters (13 GB) unless the experts are split over ep ranks; a dense model
    keeps ep = 1."""
    from holotrain.plan.cluster import load_cluster, plan_cluster

    node = load_cluster(CLUSTERS / "h200-8.toml")
    small = dataclasses.replace(node, machine=dataclasses.replace(node.machine, gpu_memory=62e9))
    plan = plan_cluster(BIG_EXPERTS, small, 4096, 64 * 4096, include_rejected=True, **FEW)
    fits = [c for c in plan if c.fits]
    assert all(c.layout.pp == c.layout.tp == c.layout.cp == 1 and 8 % c.layout.ep == 0 for c in plan
               if c.layout.ep > 1)
    # Without ep only a pipeline of 8 stages (no FSDP) fits, slower.
    assert all(c.layout.ep > 1 or c.layout.pp == 8 for c in fits)
    rejected = [c for c in plan if not c.fits and c.layout.ep == 1 and c.layout.pp == 1]
    assert rejected and all(c.memory["two gathered blocks (FSDP2)"] > 12e9 for c in rejected)
    best = fits[0]
    assert best.layout.ep > 1
    assert best.phases["ep"] > 0 and best.moe.ep == best.layout.ep and best.moe.all_to_all_bytes > 0
    assert best.moe.total_params == model_params(BIG_EXPERTS) > 5 * best.moe.active_params
    dense = plan_cluster(dataclasses.replace(BIG_EXPERTS, n_experts=0, family="llama"), node, 4096, 64 * 4096, **FEW)
    assert dense and all(c.layout.ep == 1 and c.moe is None and c.phases["ep"] == 0 for c in dense)


def test_a_cluster_plan_of_a_moe_model_sets_parallel_ep_and_reports_the_exchange(tmp_path):
    from holotrain.plan.cluster_cli import make_cluster_plan

    config = tmp_path / "moe.toml"
    config.write_text('[model]\nfamily = "mixtral"\ndim = 4096\nn_layers = 8\nn_heads = 32\nn_kv_heads = 8\n'
                      'ffn_dim = 4096\nvocab_size = 32000\nn_experts = 64\nn_active_experts = 2\nmoe_ffn_dim = 4096\n'
                      '[data]\nseq_len = 4096\n[training]\nbatch_size = 64\n')
    plan = make_cluster_plan(str(config), [], "h200-8", tmp_path / "plan")
    written = json.loads((tmp_path / "plan" / "plan.json").read_text())
    chosen = next(c for c in written["candidates"] if c["chosen"])
    assert written["overlay"]["parallel"]["ep"] == plan.chosen.layout.ep == chosen["layout"]["ep"] > 1
    moe = chosen["moe"]
    assert moe["total_params"] == model_params(BIG_EXPERTS) and moe["active_params"] < moe["total_params"]
    assert moe["all_to_all_bytes"] > 0 and moe["all_to_all_s"] > 0 and moe["hidden_s"] >= 0
    assert "64 experts top-2" in plan.signature


def _cpu():
    from holotrain.plan.cost import Machine

    return Machine("cpu", "test", None, None, 64e9, 50e9, None, 1e8, 5e9, None, False)


def test_the_planner_on_several_ranks_tries_expert_parallelism_for_a_moe_model_only():
    """`holotrain plan --nproc 4`: a MoE job's candidates add ep = 2 and 4 (no tensor parallelism, which does not
    split experts yet), predicted with their all-to-all; a dense job's have no parallel.ep."""
    from holotrain.model import build as build_model
    from holotrain.plan.cost import Calibration, describe, predict, with_settings
    from holotrain.plan.planner import enumerate_candidates, job_config, prediction_dict
    from holotrain.train.resolve import model_args

    moe = job_config(None, ["--model.family=qwen3_moe", "--model.preset=tiny", "--training.batch_size=8",
                            "--data.seq_len=256"])
    candidates = enumerate_candidates(moe, _cpu(), ranks=4)
    assert {(c.settings["parallel.tp"], c.settings["parallel.ep"]) for c in candidates} == {(1, 1), (1, 2), (1, 4)}
    assert "x ep 4" in next(c for c in candidates if c.settings["parallel.ep"] == 4).label
    dense = job_config(None, ["--training.batch_size=8", "--data.seq_len=256"])
    assert all("parallel.ep" not in c.settings for c in enumerate_candidates(dense, _cpu(), ranks=4))

    with torch.device("meta"):
        model = build_model(model_args(moe))
    chosen = next(c for c in candidates if c.settings["parallel.ep"] == 4 and c.micro == 1)
    p = predict(model, with_settings(moe, chosen.settings), _cpu(), Calibration(), chosen.micro, chosen.accum,
                chosen.ranks)
    args = model_args(moe)
    assert p.phases["ep"] > 0 and p.routing_s > 0 and p.moe.ep == 4
    assert p.moe.all_to_all_bytes == pytest.approx(ep_bytes_per_step(256, args.dim, args.n_active_experts,
                                                                     args.moe_layers, 4, chosen.accum, 4))
    assert sum(p.parts.values()) == pytest.approx(p.step_s)
    row = prediction_dict(p)
    assert row["moe"]["all_to_all_bytes"] == p.moe.all_to_all_bytes and row["moe"]["active_params"] < row["moe"][
        "total_params"]
    assert "all-to-all" in describe(p)[-1] and "active" in describe(p)[-1]

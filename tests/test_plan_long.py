"""Long context (32k-128k tokens a sequence): the memory plan's and the time model's terms that grow with the sequence
length, attention's work with packed documents, and context parallelism in the plan. On meta models and the H200's
recorded probe (bench/data/plan-h200/machine.json): no GPU, a few seconds."""

import json

import pytest
import torch

from tests.conftest import REPO

H200 = json.loads((REPO / "bench/data/plan-h200/machine.json").read_text())


def _job(seq_len: int, batch: int = 1, config: str = "1.4b", **settings):
    from holotrain.model import build
    from holotrain.plan.cost import with_settings
    from holotrain.plan.planner import job_config
    from holotrain.train.resolve import model_args

    cfg = with_settings(job_config(config, [f"--data.seq_len={seq_len}", f"--training.batch_size={batch}"]), settings)
    with torch.device("meta"):
        model = build(model_args(cfg))
    return cfg, model


def _machine():
    from holotrain.plan.cost import Machine

    return Machine(**H200)


def _plan(cfg, model, micro: int = 1, accum: int = 1, ranks: int = 1):
    from holotrain.memory.plan import plan_memory

    return plan_memory(model, cfg, ranks, torch.device("cuda"), micro, accum, gpu_capacity=141e9,
                       host_capacity=120e9, local_ranks=ranks)


def test_at_128k_the_plan_needs_checkpointing_and_counts_what_grows_with_the_sequence():
    """The 1.4b at T = 131072, batch 1: without checkpointing its activations (24 blocks of ~8.7 GB) overflow a 141 GB
    GPU; with every block recomputed it fits, its peak the block inputs, the recomputed block and the shared tensors.
    The rotary tables (2 x max_seq_len x head_dim fp32), the cos/sin gathered per token, the block mask and the
    chunked loss's per-token tensors are in it."""
    from holotrain.memory.plan import MASK_TENSORS, activations

    none = _plan(*_job(131072, **{"memory.activation_checkpointing": "none"}))
    cfg, model = _job(131072, **{"memory.activation_checkpointing": "full"})
    full = _plan(cfg, model)
    assert none.gpu_need > 141e9 and not none.gpu_fits
    assert full.gpu_fits and 30e9 < full.gpu_need < 60e9
    assert full.gpu["rotary tables"] == 2 * 131072 * 128 * 4
    inputs = 24 * 131072 * 2048 * 2  # the checkpoints keep each block's input, bf16
    assert full.activations["saved by the blocks"] == inputs
    assert full.activations["cos/sin and document mask"] == 131072 * 128 * 8 + MASK_TENSORS * 4 * 1024 ** 2
    assert full.activations["recomputed block and attention buffers"] > 8e9
    # The chunked loss (8192-token pieces under checkpointing, the final norm in them) keeps, besides one piece, per
    # token the gradient of the hidden states only.
    acts = activations(cfg, 1, 2, 0)
    piece = 8192 * 32000 * 7
    assert acts.loss == pytest.approx(piece + 131072 * 2048 * 2)
    # Twice the sequence, twice the activations (no term grows faster on a GPU at one sequence a micro-batch, but for
    # the block mask).
    half = activations(_job(65536, **{"memory.activation_checkpointing": "full"})[0], 1, 2, 0)
    assert acts.saved == 2 * half.saved and acts.recompute == pytest.approx(2 * half.recompute, rel=1e-6)
    assert acts.held > 2 * half.held


def test_attention_takes_a_growing_share_of_the_predicted_step():
    """Attention's T x T work per token grows with T and the GEMMs' does not: its predicted share of the step rises
    from 2k to 128k; the step's parts add up to it; MFU's FLOPs keep the full-square convention (flops_per_token)."""
    from holotrain.model.costs import flops_per_token
    from holotrain.model.costs import attention_flops_per_token
    from holotrain.plan.cost import Calibration, predict
    from holotrain.train.resolve import model_args

    shares = []
    for seq in (2048, 8192, 32768, 131072):
        cfg, model = _job(seq, **{"memory.activation_checkpointing": "full"})
        p = predict(model, cfg, _machine(), Calibration(), 1, 1)
        args = model_args(cfg)
        assert p.flops_per_step == flops_per_token(args, seq) * seq
        assert sum(p.parts.values()) == pytest.approx(p.step_s)
        assert p.attention_s == pytest.approx(attention_flops_per_token(args, seq) * seq / _machine().attention_rate)
        shares.append(p.attention_total_s / p.step_s)
    assert shares == sorted(shares) and shares[0] < 0.1 and shares[-1] > 0.7
    # The kernels' causal work is 7/12 of MFU's full square.
    args = model_args(cfg)
    assert attention_flops_per_token(args, 4096) == pytest.approx(7 / 12 * 12 * 24 * 2048 * 4096)


def test_packed_short_documents_lower_the_attention_work():
    """A row of many short documents does far less attention work than one document: the block mask's share of the
    causal triangle (doc_density, from lengths; block_density, from document ids on the device) and the predicted
    attention time, at flex_attention's rate."""
    from holotrain.plan.attention import block_density, doc_density, flex_cost
    from holotrain.plan.cost import Calibration, predict

    T = 131072
    assert doc_density([T], T) == 1.0
    short = doc_density([2048] * 64, T)
    assert doc_density([2048] * 64, T, block=0) == pytest.approx(1 / 64)
    assert 1 / 64 < short < 1.1 / 64  # the blocks on the diagonal make it a little more than the exact share
    rng = torch.Generator().manual_seed(0)
    rows = []
    for _ in range(3):
        cuts = torch.sort(torch.randperm(4095, generator=rng)[:20] + 1).values.tolist()
        lengths = [b - a for a, b in zip([0, *cuts], [*cuts, 4096])]
        rows.append(torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths)))
        assert float(block_density(rows[-1][None])) == pytest.approx(doc_density(lengths, 4096))
    assert float(block_density(torch.stack(rows))) == pytest.approx(
        sum(float(block_density(r[None])) for r in rows) / 3)

    cfg, model = _job(T, **{"memory.activation_checkpointing": "full"})
    dense = predict(model, cfg, _machine(), Calibration(), 1, 1)
    packed = predict(model, cfg, _machine(), Calibration(masked_share=1.0, attention_density=short), 1, 1)
    assert packed.attention_s == pytest.approx(dense.attention_s * flex_cost(short, T))
    # Short documents cost more per visited block: the rows of query blocks weigh more against fewer blocks.
    assert flex_cost(doc_density([512] * 256, T), T) / doc_density([512] * 256, T) > 1.5 * flex_cost(short, T) / short
    assert packed.step_s < dense.step_s / 4 and packed.linear_s == dense.linear_s


def test_context_parallelism_halves_the_activations_a_rank_holds():
    """cp = 2: each rank keeps half the tokens of each sequence, so half of what the blocks save and of the per-token
    shared tensors; its attention has its mode's buffers in flight (the ring's K/V and fp32 dK/dV, and with packed
    documents a block pair's dense mask; the all-to-all's head-sharded copies)."""
    from holotrain.memory.plan import activations, cp_buffers, cp_mode

    cfg, _ = _job(131072, **{"memory.activation_checkpointing": "none"})
    one = activations(cfg, 1, 2, 0)
    for mode in ("ring", "alltoall"):
        two_cfg, _ = _job(131072, **{"memory.activation_checkpointing": "none", "parallel.cp": 2,
                                     "parallel.cp_mode": mode})
        two = activations(two_cfg, 1, 2, 0)
        assert cp_mode(two_cfg) == mode
        assert two.saved == pytest.approx(one.saved / 2, rel=1e-9)
        assert two.recompute == pytest.approx((one.recompute + 2 * cp_buffers(two_cfg, 1, 2)) / 2, rel=1e-9)
    ring = cp_buffers(_job(131072, **{"parallel.cp": 2, "parallel.cp_mode": "ring"})[0], 1, 2)
    alltoall = cp_buffers(_job(131072, **{"parallel.cp": 2, "parallel.cp_mode": "alltoall"})[0], 1, 2)
    assert ring > 32768 ** 2 * 3 > alltoall > 0  # the ring's [c, c] mask and bias, c = T / 4
    auto, _ = _job(131072, **{"parallel.cp": 2})
    assert cp_mode(auto) == "alltoall"  # 16 heads divide by 2


def test_the_planner_at_two_ranks_and_128k_plans_context_parallelism():
    """Two ranks, T = 131072, batch 1 (no data parallelism possible): the candidates include cp = 2 with the ring and
    with the all-to-all beside tp = 2; at T = 2048 cp stays 1. A cp = 2 candidate fits without checkpointing where one
    rank could not, and its prediction has its communication: the ring's hops hide behind the attention of a block at
    128k but not at 8k."""
    from holotrain.plan.attention import LINK_LATENCY_S, cp_exposed_seconds
    from holotrain.plan.cost import LINK_BYTES_S, Calibration, predict, with_settings
    from holotrain.plan.planner import enumerate_candidates
    from holotrain.train.resolve import model_args

    cfg, model = _job(131072)
    cands = enumerate_candidates(cfg, _machine(), ranks=2)
    layouts = {(c.settings["parallel.tp"], c.settings["parallel.cp"], c.settings["parallel.cp_mode"]) for c in cands}
    assert {(1, 2, "ring"), (1, 2, "alltoall"), (2, 1, "auto")} <= layouts
    assert all(c.accum == 1 and c.micro == 1 for c in cands)
    short, _ = _job(2048, batch=8)
    assert {c.settings["parallel.cp"] for c in enumerate_candidates(short, _machine(), ranks=2)} == {1}

    pick = next(c for c in cands if c.settings["parallel.cp"] == 2 and c.settings["parallel.cp_mode"] == "alltoall"
                and c.settings["memory.activation_checkpointing"] == "full" and c.settings["training.compile"]
                and c.settings["training.fp8"] == "none")
    p = predict(model, with_settings(cfg, pick.settings), _machine(), Calibration(), 1, 1, ranks=2)
    assert p.fits and p.phases["cp"] > 0 and p.parts["communication"] >= p.phases["cp"]
    alone = predict(model, with_settings(cfg, {**pick.settings, "parallel.cp": 1}), _machine(), Calibration(), 1, 1)
    assert p.gpu_bytes < alone.gpu_bytes and p.attention_s == pytest.approx(alone.attention_s / 2)

    args, link = model_args(cfg), LINK_BYTES_S["cuda"]
    last_dkv = LINK_LATENCY_S + 2 * 65536 * 16 * 128 * 4 / link  # the fp32 dK/dV back to its owner, per layer
    long_ring = cp_exposed_seconds(args, "ring", 2, 1, 1, 131072, 1, 2, 10.0, 0.0, link)
    assert long_ring == pytest.approx(24 * last_dkv)  # every hop hidden
    short_ring = cp_exposed_seconds(args, "ring", 2, 1, 1, 8192, 1, 2, 0.001, 0.0, link)
    assert short_ring > 24 * (LINK_LATENCY_S + 2 * 4096 * 16 * 128 * 4 / link)
    # The all-to-all is exposed whatever attention takes, and recomputed blocks run their forward's again.
    a2a = cp_exposed_seconds(args, "alltoall", 2, 1, 1, 131072, 1, 2, 10.0, 0.0, link)
    assert cp_exposed_seconds(args, "alltoall", 2, 1, 1, 131072, 1, 2, 1.0, 0.0, link) == a2a
    assert cp_exposed_seconds(args, "alltoall", 2, 1, 1, 131072, 1, 2, 10.0, 1.0, link) == pytest.approx(1.5 * a2a)


def test_one_h200_at_128k_gets_a_setting_that_fits_and_at_2k_its_setting_as_before():
    """The 1.4b at T = 131072, batch 1, on the H200's probe: the best predicted bf16 setting fits its memory with
    checkpointing or activation offload (no setting that keeps every block's activations on the GPU fits); at
    T = 2048, batch 8, the best predicted setting is still micro-batch 8, no checkpointing, FP8, compiled."""
    from holotrain.plan.cost import Calibration, predict, with_settings
    from holotrain.plan.planner import enumerate_candidates

    machine, calib = _machine(), Calibration(fp8_gain=1.18)
    cfg, model = _job(131072)
    cands = [c for c in enumerate_candidates(cfg, machine) if c.settings["training.fp8"] == "none"
             and c.settings["training.compile"] and not c.settings["memory.offload"]]
    for c in cands:
        c.predicted = predict(model, with_settings(cfg, c.settings), machine, calib, c.micro, c.accum)
    fitting = [c for c in cands if c.predicted.fits]
    best = max(fitting, key=lambda c: c.predicted.tokens_per_s)
    assert best.predicted.gpu_bytes < machine.gpu_memory
    s = best.settings
    assert s["memory.activation_checkpointing"] != "none" or s["memory.activation_offload_blocks"]
    assert not any(c.settings["memory.activation_checkpointing"] == "none"
                   and not c.settings["memory.activation_offload_blocks"] for c in fitting)

    cfg, model = _job(2048, batch=8)
    cands = [c for c in enumerate_candidates(cfg, machine) if c.settings["training.compile"]
             and not c.settings["memory.offload"] and not c.settings["memory.activation_offload_blocks"]
             and c.settings["memory.activation_checkpointing"] in ("none", "full")]
    for c in cands:
        c.predicted = predict(model, with_settings(cfg, c.settings), machine, calib, c.micro, c.accum)
    best = max((c for c in cands if c.predicted.fits), key=lambda c: c.predicted.tokens_per_s)
    assert best.label == "micro 8x1, ac none, fp8, compiled"


def test_an_attention_bound_trial_calibrates_the_attention_rate():
    """A trial at 128k whose attention ran 1.5x the predicted time: the planner's calibration scales attention (the
    GEMM efficiency stays), and the setting is then predicted at what it measured; a GEMM-bound trial at 2k leaves
    attention's rate alone."""
    from holotrain.plan.cost import Calibration, predict, with_settings
    from holotrain.plan.planner import Candidate, calibrate
    from holotrain.plan.trials import Measured

    machine = _machine()
    for seq, attention_bound in ((131072, True), (2048, False)):
        cfg, model = _job(seq, **{"memory.activation_checkpointing": "full"})
        calib = Calibration()

        def repredict(c, cfg=cfg, model=model, calib=calib):
            return predict(model, with_settings(cfg, c.settings), machine, calib, c.micro, c.accum)

        c = Candidate({"memory.activation_checkpointing": "full", "training.compile": True}, 1, 1)
        c.predicted = repredict(c)
        slow = c.predicted.step_s + 0.5 * c.predicted.attention_total_s
        c.measured = Measured(slow, None, None, None, None, None, "")
        calibrate(calib, c, machine, repredict)
        if attention_bound:
            assert calib.attention_scale == pytest.approx(1.5, rel=0.01) and not calib.efficiency
            assert repredict(c).step_s == pytest.approx(slow, rel=0.01)
        else:
            assert calib.attention_scale is None and calib.efficiency


def test_the_machine_probe_leaves_attention_to_its_prior_on_a_cpu():
    from holotrain.plan.attention import ATTENTION_SHARE
    from holotrain.plan.cost import Machine
    from holotrain.plan.machine import _attention_rate

    assert _attention_rate(torch.device("cpu")) == 0.0
    cpu = Machine("cpu", "test", None, None, 16e9, 50e9, None, 1e8, 5e9, None, False)
    assert cpu.attention_rate == ATTENTION_SHARE["cpu"] * 50e9
    assert _machine().attention_rate == pytest.approx(0.62 * H200["gemm_flops"])


def test_one_h200_at_1m_gets_tiles_and_offloaded_inputs():
    """The 1.4b at T = 1,048,576 on the H200's probe: only "full" with block inputs on the host or recompute segments
    (with the feed-forwards tiled) fits (the plan's long-sequence levers, which run on expandable segments), and the
    planner's best fitting setting has block inputs on the host."""
    from holotrain.plan.cost import Calibration, predict, with_settings
    from holotrain.plan.planner import enumerate_candidates

    machine = _machine()
    cfg, model = _job(1048576)
    cands = [c for c in enumerate_candidates(cfg, machine) if c.settings["training.fp8"] == "none"
             and c.settings["training.compile"] and not c.settings["memory.offload"]]
    for c in cands:
        c.predicted = predict(model, with_settings(cfg, c.settings), machine, Calibration(), c.micro, c.accum)
    fitting = [c for c in cands if c.predicted.fits]
    assert fitting and all(c.settings["memory.activation_offload_blocks"]
                           or c.settings["memory.activation_checkpointing_segment"] == 4 for c in fitting)
    segmented = [c for c in fitting if c.settings["memory.activation_checkpointing_segment"] == 4]
    assert segmented and all(c.settings["memory.ffn_tiles"] == 64 for c in segmented)
    best = max(fitting, key=lambda c: c.predicted.tokens_per_s)
    assert "blocks on the host" in best.label
    # Recompute segments (one more forward of every block) are slower than any setting with inputs on the host, and
    # among the tiled ones fewer blocks on the host cost nothing more (their copies hide under the backward).
    offloaded = [c for c in fitting if c.settings["memory.activation_offload_blocks"]]
    assert max(c.predicted.tokens_per_s for c in segmented) < min(c.predicted.tokens_per_s for c in offloaded)
    tiled = [c for c in offloaded if c.settings["memory.ffn_tiles"] == 64]
    fewest = min(tiled, key=lambda c: c.settings["memory.activation_offload_blocks"])
    assert fewest.predicted.tokens_per_s == max(c.predicted.tokens_per_s for c in tiled)


def test_late_in_backward_the_fetched_inputs_are_counted():
    """With block inputs on the host, the end of backward holds, beside the recomputed block, the inputs fetched ahead
    of it: as many as the blocks the GPU kept (the offload's fetch rule), at least the block's own. The 1.4b at 1M
    with all 24 inputs on the host ran out of memory on an 80 GB H100 where the plan without them said 73.7 GB."""
    from holotrain.memory.plan import activations

    one_input = 1048576 * 2048 * 2
    for on_host, late in ((24, 1), (21, 3), (12, 12), (0, 1)):
        cfg, _ = _job(1048576, **{"memory.activation_checkpointing": "full", "memory.ffn_tiles": 64,
                                  "memory.activation_offload_blocks": on_host})
        assert activations(cfg, 1, 2, 0).late_inputs == late * one_input, on_host
    cfg, model = _job(1048576, **{"memory.activation_checkpointing": "full", "memory.ffn_tiles": 64,
                                  "memory.activation_offload_blocks": 24})
    plan = _plan(cfg, model)
    assert plan.activations["block inputs late in backward"] == one_input
    assert plan.gpu_need > 83.6e9  # what the H100 run needed at least

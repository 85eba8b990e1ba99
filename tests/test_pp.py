"""Pipeline parallelism (holotrain/parallel/pp.py): the cost-balanced cut, the stages each rank holds, the pruned
stage models, and every schedule trained against one process (tests/pp_worker.py)."""

import copy
import itertools
import random

import pytest
import torch

from holotrain.errors import ConfigError
from holotrain.model import ModelArgs, build
from holotrain.model.costs import flops_per_token
from holotrain.model.families.llama import PRESETS
from holotrain.parallel.pp import (
    SCHEDULES,
    rank_stages,
    stage_bounds,
    stage_model,
    stages_per_rank,
    unit_costs,
)
from tests.conftest import run_worker


@pytest.mark.slow
def test_every_schedule_at_pp4_and_pp2_beside_dp_tp_or_cp_trains_as_one_process():
    """One torchrun launch of 4 gloo ranks: 1f1b, interleaved, zb1p and zbv at pp=4 and at pp=2 x dp=2 with FSDP2
    (8 steps each), at pp=2 x tp=2 and at pp=2 x cp=2 (ring) (5 steps each), on packed documents with masked
    targets: losses, gradient norms, gradients and weights equal one process's with gradient accumulation over the
    same micro-batches (fp32)."""
    out = run_worker("pp_worker.py", 4, "PP WORKER OK")
    assert out.count("weights equal one process's") == 4 * len(SCHEDULES), out


def _largest(costs, bounds):
    return max(sum(costs[a:b + 1]) for a, b in bounds)


def _best_largest(costs, n_stages):
    """By brute force: the least largest-stage cost over every contiguous cut."""
    n = len(costs)
    best = float("inf")
    for cuts in itertools.combinations(range(1, n), n_stages - 1):
        edges = (0,) + cuts + (n,)
        best = min(best, max(sum(costs[a:b]) for a, b in itertools.pairwise(edges)))
    return best


def test_stage_bounds_are_contiguous_non_empty_and_minimise_the_largest_stage():
    rng = random.Random(5)
    for _ in range(60):
        n = rng.randint(2, 11)
        k = rng.randint(1, n)
        costs = [rng.uniform(0.1, 10) for _ in range(n)]
        bounds = stage_bounds(costs, k)
        assert len(bounds) == k and bounds[0][0] == 0 and bounds[-1][1] == n - 1
        assert all(a <= b for a, b in bounds) and all(b + 1 == a for (_, b), (a, _) in itertools.pairwise(bounds))
        assert _largest(costs, bounds) == pytest.approx(_best_largest(costs, k))
    # Equal costs split evenly.
    assert stage_bounds([1.0] * 8, 4) == [(0, 1), (2, 3), (4, 5), (6, 7)]
    with pytest.raises(ConfigError, match="5 pipeline stages need at least as many units"):
        stage_bounds([1.0] * 4, 5)


def test_an_expensive_head_moves_blocks_off_the_last_stage():
    """Balanced by cost, not block count: with the head as costly as 3 blocks, the last stage holds fewer blocks
    than the others, and the largest stage costs less than in the split by count."""
    costs = [0.5] + [10.0] * 8 + [30.0]  # embedding, 8 blocks, head
    bounds = stage_bounds(costs, 4)
    blocks = [sum(1 for u in range(a, b + 1) if 1 <= u <= 8) for a, b in bounds]
    assert blocks[-1] < min(blocks[:-1]), (bounds, blocks)
    by_count = [(0, 2), (3, 4), (5, 6), (7, 9)]  # 2 blocks a stage
    assert _largest(costs, bounds) < _largest(costs, by_count)


def test_unit_costs_count_the_model_flops_and_take_measured_costs():
    args = ModelArgs(dim=64, n_layers=4, n_heads=8, n_kv_heads=4, ffn_dim=96, vocab_size=512, max_seq_len=64)
    costs = unit_costs(args, 64)
    assert len(costs) == args.n_layers + 2 and len(set(costs[1:-1])) == 1
    assert costs[-1] == 6 * args.dim * args.vocab_size
    big = unit_costs(PRESETS["1.4b"], 2048)  # the embedding: memory traffic, small next to a block of a real model
    assert 0 < big[0] < 0.05 * big[1]
    # The blocks' linears and the head are flops_per_token's matrix multiplies; attention comes on top.
    linear = unit_costs(args, 0)[1]  # seq_len 0: no attention products
    assert args.n_layers * linear + costs[-1] == pytest.approx(flops_per_token(args, 0))
    assert costs[1] > linear  # seq_len 64: attention's products
    assert unit_costs(args, 64, attention_density=0.5)[1] < costs[1]  # packed documents: less attention
    measured = [1.0, 2.0, 2.0, 2.0, 2.0, 5.0]
    assert unit_costs(args, 64, measured=measured) == measured
    with pytest.raises(ValueError, match="6 positive values"):
        unit_costs(args, 64, measured=[1.0, 2.0])


@pytest.mark.parametrize("pp", [1, 2, 4])
def test_rank_stages_loop_and_v_orders(pp):
    from torch.distributed.pipelining._utils import generate_stage_to_rank_mapping

    assert [stages_per_rank(s) for s in SCHEDULES] == [1, 2, 2, 2]
    for schedule in SCHEDULES:
        held = [rank_stages(r, pp, schedule) for r in range(pp)]
        n_stages = pp * stages_per_rank(schedule)
        assert sorted(s for stages in held for s in stages) == list(range(n_stages))
        # The placement torch's schedule assumes: loop order, or a V for zbv.
        style = "v" if schedule == "zbv" else "loop"
        mapping = generate_stage_to_rank_mapping(pp, n_stages, style=style)
        assert all(mapping[s] == r for r, stages in enumerate(held) for s in stages)
    if pp == 4:
        assert [rank_stages(r, 4, "zbv") for r in range(4)] == [[0, 7], [1, 6], [2, 5], [3, 4]]
        assert [rank_stages(r, 4, "interleaved") for r in range(4)] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    with pytest.raises(ConfigError, match="parallel.pp_schedule must be one of"):
        stages_per_rank("gpipe")


def _unit_of(key: str, n_layers: int) -> int:
    """The unit [embedding, blocks, head] a state_dict key of the plain model belongs to."""
    if key.startswith("tok_embeddings."):
        return 0
    return int(key.split(".")[1]) + 1 if key.startswith("layers.") else n_layers + 1


def test_stage_models_keep_the_plain_names_and_chain_to_the_plain_loss():
    """Each stage's state_dict is the plain model's restricted to its units (so checkpoints reshard across
    pipeline degrees), the stages together hold every parameter once, and run one after another on packed
    documents they give the plain model's loss and gradients."""
    args = ModelArgs(dim=32, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=48, vocab_size=64, max_seq_len=16)
    torch.manual_seed(0)
    plain = build(args)
    g = torch.Generator().manual_seed(1)
    tokens, targets = torch.randint(0, 64, (2, 16), generator=g), torch.randint(0, 64, (2, 16), generator=g)
    targets[:, -3:] = -100
    doc_ids = torch.tensor([[0] * 5 + [1] * 11, [0] * 16])
    want = plain(tokens, targets, doc_ids)
    want.backward()

    bounds = stage_bounds(unit_costs(args, 16), 3)
    stages = [stage_model(copy.deepcopy(plain), a, b) for a, b in bounds]
    keys = list(plain.state_dict())
    seen = []
    for (a, b), stage in zip(bounds, stages):
        assert list(stage.state_dict()) == [k for k in keys if a <= _unit_of(k, args.n_layers) <= b]
        seen += list(stage.state_dict())
    assert sorted(seen) == sorted(keys)
    assert stages[0].norm is None and stages[-1].tok_embeddings is None and stages[-1].output is not None

    h, inputs, outputs = tokens, [], []
    for stage in stages:
        x = h.detach().requires_grad_() if h.is_floating_point() else h
        h = stage(x, doc_ids=doc_ids)
        assert h.shape == (2, 16, args.dim)
        inputs.append(x)
        outputs.append(h)
    got = stages[-1].loss(h, targets)
    assert torch.allclose(got, want, atol=1e-6)
    got.backward()
    for i in range(len(stages) - 2, -1, -1):  # back through the stages, as the schedule's transfers do
        outputs[i].backward(inputs[i + 1].grad)
    plain_grads = {n: p.grad for n, p in plain.named_parameters()}
    for stage in stages:
        for n, p in stage.named_parameters():
            assert torch.allclose(p.grad, plain_grads[n], atol=1e-6), n


def test_stage_model_refuses_tied_embeddings():
    args = ModelArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=48, vocab_size=64, max_seq_len=16,
                     tie_embeddings=True)
    with pytest.raises(ConfigError, match="tie_embeddings"):
        stage_model(build(args), 0, 2)

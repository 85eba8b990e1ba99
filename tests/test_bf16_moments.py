"""memory.adamw_moments = "bf16": AdamW with its moments stored in bf16, stochastically rounded
(holotrain/optim/bf16_moments.py), on the CPU's reference path and, with a GPU, its Triton kernel."""

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader

from holotrain.optim.bf16_moments import AdamWBf16Moments, reference_update, round_bf16_stochastic
from holotrain.train.checkpoint import latest_checkpoint
from tests.conftest import read_metrics, run_cli, tiny_args


def test_stochastic_rounding_is_unbiased_and_keeps_bf16_values():
    gen = torch.Generator().manual_seed(0)
    noise = torch.randint(0, 1 << 16, (100_000,), generator=gen, dtype=torch.int32)
    for value in (1 + 2 ** -10, -(3 + 2 ** -9), 1e-20 * (1 + 2 ** -11)):
        x = torch.full((100_000,), value)
        rounded = round_bf16_stochastic(x, noise).float()
        below, above = sorted({v.item() for v in rounded.unique()})  # only the two neighbours occur
        assert below < value < above
        assert rounded.mean().item() == pytest.approx(value, rel=2e-5)  # unbiased
    exact = torch.tensor([1.0, -2.5, 0.0, 2.0 ** 127])
    assert torch.equal(round_bf16_stochastic(exact, noise[:4]).float(), exact)


def test_a_slow_second_moment_keeps_moving_where_rounding_to_nearest_freezes_it():
    """beta2 = 0.999 moves v by 0.05% a step here, under half of bf16's step at 1.0 (0.39%): rounded to nearest, v
    never leaves 1.0; rounded stochastically it follows the fp32 value."""
    gen = torch.Generator().manual_seed(0)
    exact, nearest = torch.ones(10_000), torch.ones(10_000, dtype=torch.bfloat16)
    stochastic = torch.ones(10_000, dtype=torch.bfloat16)
    for _ in range(200):
        exact = 0.999 * exact + 0.001 * 1.5
        nearest = (0.999 * nearest.float() + 0.001 * 1.5).to(torch.bfloat16)
        noise = torch.randint(0, 1 << 16, (10_000,), generator=gen, dtype=torch.int32)
        stochastic = round_bf16_stochastic(0.999 * stochastic.float() + 0.001 * 1.5, noise)
    assert torch.all(nearest == 1.0) and exact[0] > 1.09
    assert stochastic.float().mean().item() == pytest.approx(exact[0].item(), rel=2e-3)


def _pair(seed=0, shape=(48, 40)):
    torch.manual_seed(seed)
    w = torch.randn(shape)
    a, b = torch.nn.Parameter(w.clone()), torch.nn.Parameter(w.clone())
    hyper = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    return w, a, b, torch.optim.AdamW([a], foreach=False, **hyper), AdamWBf16Moments([b], **hyper)


def test_the_step_is_adamws_and_honours_the_clip_and_a_skipped_step():
    w, a, b, fp32, bf16 = _pair()
    for _ in range(40):
        g = torch.randn_like(w)
        a.grad, b.grad = g.clone(), g.clone()
        fp32.step()
        bf16.step()
    moved = (a - w).abs().mean()
    assert (a - b).abs().max() < 0.03 * moved  # the rounded moments stay close to fp32's
    assert bf16.state[b]["exp_avg"].dtype == torch.bfloat16 and bf16.state[b]["step"].item() == 40

    # The clip's divisor, read with each gradient: a doubled gradient with grad_scale 2 is the same step.
    _, _, b1, _, one = _pair(1)
    _, _, b2, _, two = _pair(1)
    b1.grad = torch.randn_like(b1)
    b2.grad = 2 * b1.grad
    two.grad_scale = torch.tensor(2.0)
    one.step()
    two.step()
    assert torch.equal(b1, b2)
    assert torch.equal(one.state[b1]["exp_avg_sq"], two.state[b2]["exp_avg_sq"])

    # found_inf: weights, moments and step count untouched.
    before = b2.detach().clone(), two.state[b2]["exp_avg"].clone(), two.state[b2]["step"].clone()
    two.found_inf = torch.tensor(1.0)
    b2.grad = torch.full_like(b2, float("nan"))
    two.step()
    after = b2.detach(), two.state[b2]["exp_avg"], two.state[b2]["step"]
    assert all(torch.equal(x, y) for x, y in zip(before, after))


def test_a_state_from_fp32_adamw_loads_in_bf16_and_back():
    w, a, b, fp32, bf16 = _pair()
    a.grad = torch.randn_like(w)
    fp32.step()
    bf16.load_state_dict(fp32.state_dict())
    assert bf16.state[b]["exp_avg"].dtype == torch.bfloat16
    assert torch.allclose(bf16.state[b]["exp_avg"].float(), fp32.state[a]["exp_avg"], rtol=1e-2)
    b.grad = torch.randn_like(w)
    bf16.step()
    assert bf16.state[b]["step"].item() == 2
    fp32.load_state_dict(bf16.state_dict())
    assert fp32.state[a]["exp_avg"].dtype == torch.float32


def _moment_dtypes(run_dir) -> set:
    meta = FileSystemReader(latest_checkpoint(run_dir)).read_metadata()
    return {m.properties.dtype for key, m in meta.state_dict_metadata.items() if key.endswith(("exp_avg", "exp_avg_sq"))}


COMMON = {"training.steps": 9, "checkpoint.every": 3}
BF16 = {**COMMON, "memory.adamw_moments": "bf16"}


@pytest.fixture(scope="module")
def bf16_run(tmp_path_factory):
    """A 9-step run with bf16 moments, checkpoints at 3, 6 and 9."""
    run_dir = tmp_path_factory.mktemp("bf16")
    run_cli("train", *tiny_args(run_dir, **BF16), env={"OMP_NUM_THREADS": "1"})
    return run_dir


def test_training_with_bf16_moments_follows_fp32_and_resumes_exactly_and_across_the_setting(bf16_run, tmp_path):
    common, bf16 = COMMON, BF16
    run_cli("train", *tiny_args(tmp_path / "fp32", **common))
    full, low = read_metrics(tmp_path / "fp32"), read_metrics(bf16_run)
    assert [r["loss"] for r in full] != [r["loss"] for r in low]  # the bf16 moments really ran
    for a, b in zip(full, low):
        assert b["loss"] == pytest.approx(a["loss"], rel=0.01)
    assert _moment_dtypes(bf16_run) == {torch.bfloat16}

    # Killed while saving step 6: the run resumes from step 3 and draws the same rounding as the straight run.
    killed = tmp_path / "killed"
    proc = run_cli("train", *tiny_args(killed, **bf16), env={"HOLOTRAIN_KILL_DURING_SAVE": "6"}, check=False)
    assert proc.returncode == -9
    run_cli("train", *tiny_args(killed, **bf16))
    assert [r["loss"] for r in read_metrics(killed)] == [r["loss"] for r in low]

    # Each run goes on with the other setting.
    proc = run_cli("train", *tiny_args(killed, **{**common, "training.steps": 12}))
    assert "resuming from" in proc.stdout and _moment_dtypes(killed) == {torch.float32}
    proc = run_cli("train", *tiny_args(tmp_path / "fp32", **{**bf16, "training.steps": 12}))
    assert "resuming from" in proc.stdout and _moment_dtypes(tmp_path / "fp32") == {torch.bfloat16}
    assert [r["step"] for r in read_metrics(tmp_path / "fp32")] == list(range(1, 13))


@pytest.mark.slow
def test_fsdp_over_two_processes_with_bf16_moments_trains_like_one_process(bf16_run, tmp_path):
    """FSDP2's shards: the moments are bf16 DTensors beside their parameters; each rank draws its shard's random bits,
    so the losses follow the one-process run closely, not exactly."""
    from tests.test_distributed import torchrun

    out = torchrun(2, "train", *tiny_args(tmp_path / "two", **BF16))
    assert "world size 2" in out
    one, two = read_metrics(bf16_run), read_metrics(tmp_path / "two")
    assert [r["step"] for r in two] == list(range(1, 10))
    for a, b in zip(one, two):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4)
    assert _moment_dtypes(tmp_path / "two") == {torch.bfloat16}


def test_bf16_moments_with_offload_is_one_config_error(tmp_path):
    from tests.conftest import run_cli_here

    proc = run_cli_here("train", *tiny_args(tmp_path, **{"memory.adamw_moments": "bf16", "memory.offload": True}))
    assert proc.returncode == 2 and "memory.adamw_moments" in proc.stderr and "Traceback" not in proc.stderr


def test_the_memory_plan_counts_four_bytes_a_parameter_less():
    from holotrain.errors import ConfigError
    from holotrain.memory import fit, plan
    from holotrain.model import build
    from holotrain.plan.planner import job_config
    from holotrain.train.resolve import model_args

    sizes = {}
    for moments in ("fp32", "bf16"):
        cfg = job_config("1.4b", [f"--memory.adamw_moments={moments}"])
        with torch.device("meta"):
            model = build(model_args(cfg))
        p = plan.plan_memory(model, cfg, 1, torch.device("cuda"), 16, 1, gpu_capacity=200e9, host_capacity=500e9)
        sizes[moments] = p.gpu_need
    n = sum(q.numel() for q in model.parameters())
    assert sizes["fp32"] - sizes["bf16"] == pytest.approx(4 * n)
    # A GPU between the two: the fit check names the setting that fits.
    cfg = job_config("1.4b", [])
    capacity = (sizes["fp32"] + sizes["bf16"]) / 2
    with pytest.raises(ConfigError, match='memory.adamw_moments = "bf16" .*: fits'):
        fit.check_fit(model, cfg, 1, torch.device("cuda"), 16, 1, gpu_capacity=capacity, host_capacity=500e9)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton kernel needs a GPU")
def test_the_kernel_matches_the_reference_on_the_gpu():
    """Many tensors of odd sizes in one launch (a norm's, a block's, one that ends mid-block): from the same state,
    the weights and moments as the torch reference computes them (the same random bits), each moment one of the two
    bf16 values around its exact fp32 value; the clip's divisor and a skipped step as on the CPU."""
    torch.manual_seed(0)
    shapes = [(7,), (2048,), (300, 77), (4096, 513), (1,)]
    params = [torch.nn.Parameter(torch.randn(s, device="cuda")) for s in shapes]
    opt = AdamWBf16Moments(params, lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    for step in range(1, 4):
        grads = [torch.randn_like(p) for p in params]
        ref = [(p.detach().clone(), opt.state[p]["exp_avg"].clone(), opt.state[p]["exp_avg_sq"].clone())
               if opt.state[p] else (p.detach().clone(), torch.zeros_like(p, dtype=torch.bfloat16),
                                     torch.zeros_like(p, dtype=torch.bfloat16)) for p in params]
        for param, g in zip(params, grads):
            param.grad = 3 * g
        opt.grad_scale = torch.tensor(3.0, device="cuda")
        opt.step()
        for i, (param, (p, m, v), g) in enumerate(zip(params, ref, grads)):
            exact = {"exp_avg": m.float().lerp(g, 0.1), "exp_avg_sq": v.float() * 0.95 + 0.05 * g * g}
            # Where m + 0.1 (g - m) cancels to almost nothing, fp32's own rounding (its order differs between the
            # kernel and torch) is larger than bf16's step at the result.
            slack = 2 ** -21 * (m.float().abs() + g.abs())
            reference_update(p, g, m, v, step, i, 0, 1e-3, 0.9, 0.95, 1e-8, 0.1, 1.0)
            torch.testing.assert_close(param.detach(), p, rtol=1e-5, atol=1e-6)
            for key, x in exact.items():
                got = opt.state[param][key].float()
                ulp = torch.ldexp(torch.ones_like(x), torch.frexp(x).exponent - 8)  # bf16's step at x
                off = ((got - x).abs() - slack).clamp_min(0) / ulp
                worst = off.flatten().argmax()
                assert off.max() < 1.0001, (shapes[i], key, step, x.flatten()[worst].item(), got.flatten()[worst].item())
            # The same random bits as the reference: the same moments, but where fp32's rounding differs.
            assert (opt.state[param]["exp_avg"] == m).float().mean() > 0.999
            assert (opt.state[param]["exp_avg_sq"] == v).float().mean() > 0.999
            assert opt.state[param]["step"].item() == step
    opt.found_inf = torch.tensor(1.0, device="cuda")
    before = [(p.detach().clone(), opt.state[p]["exp_avg"].clone()) for p in params]
    for param in params:
        param.grad = torch.full_like(param, float("nan"))
    opt.step()
    for param, (w, m) in zip(params, before):
        assert torch.equal(param.detach(), w) and torch.equal(opt.state[param]["exp_avg"], m)
        assert opt.state[param]["step"].item() == 3

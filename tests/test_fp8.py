"""training.fp8: the precision lever (torchao float8 linear layers). On a CPU the FP8 numerics are emulated
(training.fp8_emulate); the speed path needs a GPU with FP8 (sm_89+)."""

import pytest
import torch

from tests.conftest import read_metrics, run_cli, run_cli_here, tiny_args

pytest.importorskip("torchao")


def test_fp8_on_a_cpu_is_one_config_error_and_auto_says_why_it_is_off(tmp_path):
    for recipe in ("tensorwise", "rowwise", "delayed"):
        proc = run_cli_here("train", *tiny_args(tmp_path / recipe, **{"training.fp8": recipe}))
        assert proc.returncode == 2 and "training.fp8" in proc.stderr and "Traceback" not in proc.stderr
    fused = {"training.fp8": "tensorwise", "training.fp8_emulate": True, "parallel.tp": 2,
             "parallel.tp_overlap": "fused"}
    proc = run_cli_here("train", *tiny_args(tmp_path / "tp", **fused))
    assert proc.returncode == 2 and "parallel.tp_overlap = 'none'" in proc.stderr, proc.stderr
    proc = run_cli("train", *tiny_args(tmp_path / "auto", **{"training.fp8": "auto", "training.steps": 2}))
    assert "training.fp8 = auto -> none (cpu has no FP8 matmuls)" in proc.stdout


def test_auto_takes_the_delayed_recipe_where_the_memory_plan_fits_it():
    """Where FP8 pays, auto takes the delayed recipe unless its FP8 transposes (5.9 GB more than tensorwise for the
    1.4b at micro-batch 8: 42.3 against 36.5 GB measured) overflow the GPU; then tensorwise, saying why."""
    from holotrain.model import build
    from holotrain.plan.planner import job_config
    from holotrain.train.resolve import delayed_if_it_fits, model_args

    cfg = job_config("1.4b", ["--memory.activation_checkpointing=none"])
    with torch.device("meta"):
        model = build(model_args(cfg))
    cuda = torch.device("cuda")
    assert delayed_if_it_fits(model, cfg, cuda, 8, 1, gpu_capacity=80e9, host_capacity=100e9)[0] == "delayed"
    choice, why = delayed_if_it_fits(model, cfg, cuda, 8, 1, gpu_capacity=40e9, host_capacity=100e9)
    assert choice == "tensorwise" and "would need 42." in why and "40.0 GB available" in why, why
    assert cfg.training.fp8 == "none", "the job's own config is not changed"


def test_emulated_fp8_trains_like_fp32_and_resumes_with_fp8_switched_off(tmp_path):
    """Both recipes: the linear layers (not the output head) go FP8; the loss follows the full-precision run closely;
    checkpoints keep the weights in the model's dtype, so the run resumes with FP8 off (and on again) to the end."""
    common = {"training.steps": 6, "checkpoint.every": 3}
    run_cli("train", *tiny_args(tmp_path / "fp32", **common))
    full = read_metrics(tmp_path / "fp32")
    for recipe in ("tensorwise", "delayed"):
        fp8 = {**common, "training.fp8": recipe, "training.fp8_emulate": True}
        proc = run_cli("train", *tiny_args(tmp_path / recipe, **fp8))
        assert f"fp8 {recipe} on 14 linear layers (emulated)" in proc.stdout  # 2 blocks x 7; the head stays
        low = read_metrics(tmp_path / recipe)
        assert low[0]["loss"] != full[0]["loss"]  # FP8 really ran
        for a, b in zip(full, low):
            assert b["loss"] == pytest.approx(a["loss"], rel=0.01)
        # Resume the FP8 run's step-6 checkpoint without FP8, then with it again.
        proc = run_cli("train", *tiny_args(tmp_path / recipe, **{**common, "training.steps": 9}))
        assert "resuming from" in proc.stdout and "holotrain: fp8" not in proc.stdout
        proc = run_cli("train", *tiny_args(tmp_path / recipe, **{**fp8, "training.steps": 12}))
        assert "resuming from" in proc.stdout
        assert [r["step"] for r in read_metrics(tmp_path / recipe)] == list(range(1, 13))


@pytest.mark.slow
def test_fsdp_over_two_processes_trains_fp8_like_one_process(tmp_path):
    """FSDP2 over two gloo ranks with each recipe (emulated): tensorwise all-gathers its weights in FP8 (torchao's
    float8 all-gather), delayed gathers them in the model's dtype and casts them. Each rank scales its own half of
    the batch, so the losses follow the one-process run's closely, not exactly."""
    from tests.test_distributed import torchrun

    common = {"training.steps": 4, "checkpoint.every": 0, "checkpoint.save_final": False, "training.fp8_emulate": True}
    for recipe in ("tensorwise", "delayed"):
        settings = {**common, "training.fp8": recipe}
        run_cli("train", *tiny_args(tmp_path / f"one-{recipe}", **settings), env={"OMP_NUM_THREADS": "1"})
        out = torchrun(2, "train", *tiny_args(tmp_path / f"two-{recipe}", **settings))
        assert f"fp8 {recipe} on 14 linear layers (emulated)" in out and "world size 2" in out, out[-2000:]
        assert ("weights all-gathered in FP8" in out) == (recipe == "tensorwise"), out[-2000:]
        one, two = read_metrics(tmp_path / f"one-{recipe}"), read_metrics(tmp_path / f"two-{recipe}")
        assert [r["step"] for r in two] == [1, 2, 3, 4]
        for a, b in zip(one, two):
            assert b["loss"] == pytest.approx(a["loss"], rel=0.01), (recipe, a["loss"], b["loss"])


def sqnr(a, b):
    """Signal to quantization noise of b against a, in dB."""
    return (20 * torch.log10(a.float().norm() / (a.float() - b.float()).norm())).item()


def test_delayed_scaling_takes_its_scales_from_the_previous_backward_passes():
    """precision/delayed.py: before its first refresh a layer scales by its tensors' current maxima; each call raises
    the layer's running maxima (a recomputed forward does not change them), and each refresh moves them into the
    histories and maps the histories' maxima onto FP8's largest numbers. So results are as close to full precision
    as FP8 gives while the tensors keep their range, and saturate until the next refresh when they outgrow it.
    Compiled (the trainer's blocks are), the results and histories are the eager ones."""
    from holotrain.precision import delayed

    torch.manual_seed(0)
    ref = torch.nn.Linear(64, 48, bias=False)

    def fp8_copy():
        layer = torch.nn.Linear(64, 48, bias=False)
        layer.weight.data.copy_(ref.weight.data)
        delayed.convert(layer)
        return layer

    x = torch.randn(32, 64) * 5
    g = torch.randn(32, 48) * 1e-5

    def step(layer, fn=None, grow=1.0, forwards=1):
        xi = (x * grow).requires_grad_()
        for _ in range(forwards):  # more than one: as a recomputing checkpoint policy runs it
            y = (layer if fn is None else fn)(xi)
        y.backward(g)
        if isinstance(layer, delayed.DelayedFp8Linear):
            assert layer.fp8_amax.tolist() == [xi.abs().max().item(), layer.weight.abs().max().item(),
                                               g.abs().max().item()]
            delayed.refresh([layer])
            assert (layer.fp8_amax == 0).all()
        grad_w = layer.weight.grad.clone()
        layer.weight.grad = None
        return y.detach(), xi.grad, grad_w

    def close(want, got):
        return sqnr(want[0], got[0]) > 25 and sqnr(want[1], got[1]) > 20 and sqnr(want[2], got[2]) > 20

    want = step(ref)
    low = fp8_copy()
    assert close(want, step(low, forwards=2))  # before the first refresh: current maxima
    maxima = torch.tensor([x.abs().max(), low.weight.detach().abs().max(), g.abs().max()])
    assert torch.equal(low.fp8_history[:, 0], maxima) and (low.fp8_history[:, 1:] == 0).all()
    assert torch.allclose(low.fp8_scale, torch.tensor([448.0, 448.0, 57344.0]) / maxima)
    assert close(want, step(low))  # from the histories
    assert torch.equal(low.fp8_history[:, :2], maxima[:, None].repeat(1, 2))
    # Inputs ten times larger than the histories have seen saturate at e4m3's largest number, once.
    grown = step(ref, grow=10.0)
    assert sqnr(grown[0], step(low, grow=10.0)[0]) < 10
    assert close(grown, step(low, grow=10.0))
    # Compiled, from the same state: the same results and the same histories, the first call's variant included.
    eager, compiled = fp8_copy(), fp8_copy()
    fn = torch.compile(compiled)
    for grow in (1.0, 1.0, 10.0, 1.0):
        a, b = step(eager, grow=grow), step(compiled, fn, grow=grow)
        for u, v in zip(a, b):
            assert sqnr(u, v) > 40
    for name in ("fp8_history", "fp8_scale", *delayed.INV_SCALES):
        assert torch.allclose(getattr(eager, name), getattr(compiled, name)), name


def test_delayed_fp8_casts_the_input_of_linears_that_read_one_input_once():
    """The delayed recipe gives q, k and v (and gate and up) one cast of their input, scaled by the first linear's
    input history (the others' stay empty), each with its own weight and gradient scales; a group with a layer that
    training.fp8_skip keeps in the compute dtype casts its input per layer. Results stay within FP8's error of the
    full-precision model, and every weight gets its gradient."""
    from types import SimpleNamespace

    from holotrain.model import ModelArgs, build
    from holotrain.precision import Precision, delayed

    args = ModelArgs(dim=64, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=176, vocab_size=128, max_seq_len=32)
    torch.manual_seed(0)
    ref = build(args)
    tokens = torch.randint(0, 128, (4, 32))
    ref(tokens, tokens).backward()

    def fp8_model(skip):
        model = build(args)
        model.load_state_dict(ref.state_dict())
        lever = Precision(SimpleNamespace(fp8="delayed", fp8_skip=skip, fp8_emulate=True), None, 1)
        lever.apply(model)
        lever.initialize(model)
        return model, lever

    model, lever = fp8_model(["output"])
    block = model.layers["0"]
    assert len(lever.converted) == 7 and "layers.0.attention.wk" in lever.converted
    assert all(isinstance(m, delayed.DelayedFp8Linear) for m in (block.attention.wv, block.feed_forward.w2))
    for _ in range(2):  # before the first refresh (current maxima), then the histories
        model.zero_grad()
        loss = model(tokens, tokens)
        loss.backward()
        for hook in model.hooks.after_backward:
            hook()
        assert loss.item() == pytest.approx(ref(tokens, tokens).item(), rel=0.02)
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            assert sqnr(q.grad, p.grad) > 15, name
    for lead, other in ((block.attention.wq, block.attention.wv), (block.feed_forward.w1, block.feed_forward.w3)):
        assert (lead.fp8_history[delayed.X, :2] > 0).all() and (other.fp8_history[delayed.X] == 0).all()
        assert (other.fp8_history[delayed.W:, :2] > 0).all()

    model, lever = fp8_model(["output", "*.wk"])
    block = model.layers["0"]
    assert "layers.0.attention.wk" not in lever.converted and type(block.attention.wk) is torch.nn.Linear
    assert model(tokens, tokens).item() == pytest.approx(ref(tokens, tokens).item(), rel=0.02)
    assert block.attention.wv.fp8_amax[delayed.X] > 0 and block.feed_forward.w3.fp8_amax[delayed.X] == 0


def test_the_training_step_refreshes_the_delayed_scales_after_every_backward():
    """The trainer's step (TrainStep, on the model build_model makes) refreshes the delayed recipe's histories and
    scales after each micro-batch's backward: two steps of two micro-batches fill four history entries."""
    from holotrain.config import load_config, resolve
    from holotrain.parallel import DistEnv
    from holotrain.precision import delayed
    from holotrain.train.trainer import TrainStep, build_model, build_optimizer

    cfg = resolve(load_config(None, [
        "--model.dim=32", "--model.n_layers=1", "--model.n_heads=2", "--model.n_kv_heads=1", "--model.ffn_dim=64",
        "--data.seq_len=8", "--training.fp8=delayed", "--training.fp8_emulate=true",
    ]), tokenizer_vocab=64)
    env = DistEnv(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    model = build_model(cfg, env, torch.float32)
    step = TrainStep(model, build_optimizer(model, cfg, env), cfg, env, torch.float32)
    batch = (torch.randint(0, 64, (2, 8)), torch.randint(0, 64, (2, 8)))
    linears = delayed.layers(model)
    assert len(linears) == 7 and not any(lin.fp8_started for lin in linears)
    for _ in range(2):
        step(lambda m: batch, 2, 1e-3)
    for lin in linears:
        assert lin.fp8_started and (lin.fp8_amax == 0).all()
        seen = lin.fp8_history[delayed.W:]  # every layer's weight and output gradient (inputs: the group's first)
        assert (seen[:, :4] > 0).all() and (seen[:, 4:] == 0).all()
        assert torch.allclose(lin.fp8_scale[delayed.W], 448.0 / seen[0].max())


def test_the_fp8_transpose_op_is_the_transpose_eager_and_compiled():
    """precision/transpose.py: the delayed recipe's transposes, an op opaque to inductor (its CPU path is the
    reference the GPU kernel is checked against below)."""
    from holotrain.precision.transpose import fp8_transpose

    x = torch.randn(37, 70).to(torch.float8_e5m2)
    for fn in (fp8_transpose, torch.compile(lambda t: fp8_transpose(t * 1)), torch.compile(fp8_transpose)):
        y = fn(x)
        assert y.dtype == x.dtype and y.is_contiguous() and torch.equal(y.float(), x.t().float())
    torch.library.opcheck(fp8_transpose, (torch.randint(0, 255, (5, 9), dtype=torch.uint8),))
    with pytest.raises(ValueError, match="one-byte values"):
        fp8_transpose(torch.zeros(3, 3))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_the_fp8_transpose_kernel_matches_torch_on_the_gpu():
    from holotrain.precision.transpose import fp8_transpose

    for rows, cols in ((1000, 333), (16384, 2048), (2048, 5632), (132, 260), (1, 7)):
        x = torch.randn(rows, cols, device="cuda").to(torch.float8_e4m3fn)
        assert torch.equal(fp8_transpose(x).view(torch.uint8), x.t().contiguous().view(torch.uint8))
    # A view 260 bytes into its storage: not 16-byte aligned, so the byte way only, at a shape already tuned.
    x = torch.randn(133, 260, device="cuda").to(torch.float8_e4m3fn)[1:]
    assert torch.equal(fp8_transpose(x).view(torch.uint8), x.t().contiguous().view(torch.uint8))


def test_the_fp8_transpose_kernel_compiles_for_hopper_without_a_gpu():
    """Triton's compiler, not its interpreter (a kernel the interpreter runs can still fail to compile), on any
    machine with Triton; the GPU test below runs it."""
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget

    from holotrain.precision.transpose_kernel import _BYTES, _WORDS, _transpose

    for config in (_BYTES[1], _WORDS[-1]):  # each way once, the word way in diagonal order
        blocks = config.kwargs
        signature = {"src": "*u8", "dst": "*u8", "M": "i32", "N": "i32", **{n: "constexpr" for n in blocks}}
        source = triton.compiler.ASTSource(fn=_transpose, signature=signature, constexprs=blocks)
        options = {"num_warps": config.num_warps}
        assert "cubin" in triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options).asm


def test_delayed_fp8_saturates_a_value_above_its_recent_maxima():
    from holotrain.precision import delayed

    history = torch.zeros(delayed.HISTORY)
    history[3] = 2.0
    scale = delayed.scale_from(history, delayed.E4M3)
    assert scale == 448.0 / 2.0
    out = delayed.to_fp8(torch.tensor([1.0, 2.0, 10.0, -10.0]), scale, delayed.E4M3).float() / scale
    assert out.tolist() == [1.0, 2.0, 2.0, -2.0]


@pytest.mark.slow
def test_emulated_fp8_under_tensor_parallelism_trains_like_one_process(tmp_path):
    """parallel.tp = 2 (gloo, 2 ranks): the TP layers' GEMMs go FP8 on each rank's shards (the head stays); the
    losses follow the one-process FP8 run within FP8's tolerance (each rank scales its own shard), and differ
    from the TP run without FP8."""
    from tests.test_distributed import torchrun

    common = {"training.steps": 4, "model.ffn_dim": 192, "profile.report": False, "checkpoint.every": 0}
    fp8 = {**common, "training.fp8": "tensorwise", "training.fp8_emulate": True}
    run_cli("train", *tiny_args(tmp_path / "one", **fp8), env={"OMP_NUM_THREADS": "1"})
    out = torchrun(2, "train", *tiny_args(tmp_path / "tp2", **fp8), "--parallel.tp=2")
    assert "fp8 tensorwise on 14 linear layers (emulated)" in out, out
    torchrun(2, "train", *tiny_args(tmp_path / "tp2-bf", **common), "--parallel.tp=2")
    one, tp2, plain = (read_metrics(tmp_path / n) for n in ("one", "tp2", "tp2-bf"))
    assert [r["step"] for r in tp2] == [1, 2, 3, 4]
    for a, b in zip(one, tp2):
        assert b["loss"] == pytest.approx(a["loss"], rel=0.01), (a, b)
    assert any(b["loss"] != c["loss"] for b, c in zip(tp2, plain))  # FP8 really ran under TP


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                    reason="needs a GPU with FP8 (sm_89 or later)")
def test_one_fp8_linear_matches_its_bf16_reference_within_fp8_tolerance():
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    from holotrain.precision.probe import predict

    torch.manual_seed(0)
    ref = torch.nn.Linear(2048, 4096, bias=False, device="cuda", dtype=torch.bfloat16)
    low = torch.nn.Sequential(torch.nn.Linear(2048, 4096, bias=False, device="cuda", dtype=torch.bfloat16))
    low[0].weight.data.copy_(ref.weight.data)
    convert_to_float8_training(low, config=Float8LinearConfig.from_recipe_name("tensorwise"))
    x = torch.randn(4096, 2048, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    x8 = x.detach().clone().requires_grad_()
    y, y8 = ref(x), low(x8)
    g = torch.randn_like(y)
    y.backward(g)
    y8.backward(g)

    assert sqnr(y, y8) > 25 and sqnr(x.grad, x8.grad) > 20 and sqnr(ref.weight.grad, low[0].weight.grad) > 20
    gain = predict({(2048, 8192): 1}, 16384, torch.device("cuda"))[0]["gain"]
    assert 0.5 < gain < 3.0  # measured, so not fixed; FP8 GEMMs are about twice bf16's peak


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                    reason="needs a GPU with FP8 (sm_89 or later)")
def test_one_delayed_fp8_linear_matches_its_bf16_reference_on_the_gpu():
    """precision/delayed.py's FP8 GEMMs on the GPU (torch._scaled_mm's layouts), compiled as the trainer's blocks are:
    before the first refresh (scaled by the current maxima) and after it (by the histories)."""
    from holotrain.precision import delayed

    torch.manual_seed(0)
    ref = torch.nn.Linear(2048, 4096, bias=False, device="cuda")
    low = torch.nn.Linear(2048, 4096, bias=False, device="cuda")
    low.weight.data.copy_(ref.weight.data)
    delayed.convert(low)
    fn = torch.compile(low)
    x = torch.randn(4096, 2048, device="cuda", dtype=torch.bfloat16)
    g = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16) * 1e-4
    for _ in range(3):
        xr, xl = (x.clone().requires_grad_() for _ in range(2))
        with torch.autocast("cuda", torch.bfloat16):
            y, y8 = ref(xr), fn(xl)
        y.backward(g)
        y8.backward(g)
        assert low.fp8_amax[delayed.G] == g.abs().max().float()
        delayed.refresh([low])
        assert y8.dtype == torch.bfloat16 and low.weight.grad.dtype == torch.float32
        assert sqnr(y, y8) > 25 and sqnr(xr.grad, xl.grad) > 20 and sqnr(ref.weight.grad, low.weight.grad) > 20
        ref.weight.grad = low.weight.grad = None
    assert (low.fp8_history[:, :3] > 0).all() and (low.fp8_history[:, 3:] == 0).all()


def test_fp8_leaves_experts_in_bf16_where_their_grouped_gemms_cannot_run_and_says_so():
    """On the CPU (FP8 emulated) a mixture-of-experts model's linear layers are converted, its experts are not."""
    from holotrain.model import build
    from holotrain.model.registry import preset
    from holotrain.parallel import DistEnv
    from holotrain.precision import build as build_precision

    class Section:
        fp8, fp8_skip, fp8_emulate = "tensorwise", [], True

    model = build(preset("qwen3_moe", "tiny"))
    precision = build_precision(Section(), DistEnv(0, 1, 0, torch.device("cpu")), 1)
    precision.apply(model)
    assert model.hooks.grouped_mm is None
    assert "4 mixture-of-experts layers' experts in bf16 (FP8 grouped GEMMs need CUDA)" in precision.describe()


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
                    reason="needs a Hopper GPU (FP8 rowwise grouped GEMMs)")
def test_fp8_grouped_experts_match_bf16_within_fp8_tolerance():
    """The FP8 lever's grouped GEMM (the model's grouped_mm hook) against torch._grouped_mm on 16 experts' SwiGLU:
    outputs and all gradients."""
    from holotrain.model import build
    from holotrain.model.moe import grouped_swiglu
    from holotrain.model.registry import preset
    from holotrain.parallel import DistEnv
    from holotrain.precision import build as build_precision

    class Section:
        fp8, fp8_skip, fp8_emulate = "rowwise", [], False

    with torch.device("meta"):
        model = build(preset("qwen3_moe", "tiny"))
    build_precision(Section(), DistEnv(0, 1, 0, torch.device("cuda")), 1).apply(model)
    mm = model.hooks.grouped_mm
    assert mm is not None
    torch.manual_seed(0)
    E, D, F_ = 16, 1024, 512
    counts = torch.randint(32, 512, (E,), device="cuda")
    counts[3] = 0  # an expert with no token
    x = torch.randn(int(counts.sum()), D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    ws = [(torch.randn(E, F_, D, device="cuda") * D ** -0.5).requires_grad_() for _ in range(2)]
    w2 = (torch.randn(E, D, F_, device="cuda") * F_ ** -0.5).requires_grad_()
    grads = []
    for fn in (None, mm):
        for t in (x, *ws, w2):
            t.grad = None
        y = grouped_swiglu(x, counts, ws[0], ws[1], w2, grouped=True, mm=fn)
        y.backward(torch.ones_like(y))
        grads.append([y.detach().float()] + [t.grad.float() for t in (x, *ws, w2)])
    for ref, low in zip(*grads):
        assert sqnr(ref, low) > 20

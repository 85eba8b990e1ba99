"""The mixture-of-experts feed-forward (holotrain/model/moe.py) and its families, qwen3_moe and mixtral, against
transformers (tiny random models made here, fp32, CPU): logits, packed documents, import -> export -> import bit for
bit, the export loading in transformers; the expert computation against a per-token loop, the auxiliary losses and
the sigmoid router's bias against direct formulas, and a few training steps through holotrain's loss."""

import dataclasses
import json
import shutil

import pytest
import torch

from holotrain.model import ModelArgs, build
from holotrain.model.moe import MoE, grouped_swiglu, load_balance_loss, router_z_loss
from tests.hf_models import VOCAB, make_tokenizer

transformers = pytest.importorskip("transformers")

T = 64
TOKENS = torch.randint(0, VOCAB, (2, T), generator=torch.Generator().manual_seed(0))
SHAPE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
             max_position_embeddings=T, rms_norm_eps=1e-5, tie_word_embeddings=False)
KINDS = {
    # Qwen3-MoE: q/k norm, head_dim 32 apart from the width (4 heads of 32 in 64), 8 experts top-2 renormalized;
    # block 1 dense (mlp_only_layers) to see decoder_sparse_step's and mlp_only_layers' reading.
    "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM,
                  dict(head_dim=32, intermediate_size=96, moe_intermediate_size=48, num_experts=8,
                       num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[1],
                       rope_theta=1e6)),
    # Qwen3-MoE without renormalized weights, every block MoE.
    "qwen3_moe_raw": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM,
                      dict(head_dim=16, intermediate_size=96, moe_intermediate_size=48, num_experts=4,
                           num_experts_per_tok=3, norm_topk_prob=False, rope_theta=1e6)),
    # Mixtral: 4 experts top-2, a sliding window of 16 (seen at T = 64).
    "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM,
                dict(intermediate_size=80, num_local_experts=4, num_experts_per_tok=2, sliding_window=16,
                     rope_theta=1e6)),
}
FAMILY = {"qwen3_moe": "qwen3_moe", "qwen3_moe_raw": "qwen3_moe", "mixtral": "mixtral"}


def make_hf_moe(directory, kind: str, seed: int = 0, shard: bool = False):
    """A random transformers model of `kind` saved (save_pretrained: per-expert tensors; in files of 20 KB with
    `shard`) into `directory`."""
    config_class, model_class, spec = KINDS[kind]
    torch.manual_seed(seed)
    model = model_class(config_class(**SHAPE, **spec)).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):  # non-trivial norms, so that a missed one shows
                p.normal_(1.0, 0.2)
            elif name.endswith("gate.weight"):  # routers with clear choices (no near-ties between the top k)
                p.normal_(0.0, 0.5)
            elif "experts" in name:
                p.normal_(0.0, 0.05)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory, max_shard_size="20KB" if shard else "1GB")
    make_tokenizer(directory)
    return model


def _imported(directory):
    from holotrain.config import load_config, resolve
    from holotrain.parallel import DistEnv
    from holotrain.train.trainer import build_model

    cfg = resolve(load_config(None, [f"--model.init_from={directory}", f"--data.seq_len={T}", "--job.device=cpu"]),
                  tokenizer_vocab=VOCAB)
    env = DistEnv(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    return build_model(cfg, env, torch.float32).eval()


@pytest.fixture(scope="module", params=list(KINDS))
def hf_and_ours(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(request.param)
    hf = make_hf_moe(directory / "hf", request.param)
    return request.param, directory, hf, _imported(directory / "hf")


def test_logits_match_transformers_with_and_without_documents(hf_and_ours):
    kind, _, hf, model = hf_and_ours
    assert model.args.family == FAMILY[kind] and model.args.n_experts == hf.config.num_local_experts
    with torch.no_grad():
        expected = hf(TOKENS).logits
        assert (model(TOKENS) - expected).abs().max().item() <= 1e-4
        # Packed documents (24 + 40 tokens): each as transformers sees it alone.
        doc_ids = (torch.arange(T) >= 24).long().expand(2, T)
        alone = torch.cat([hf(TOKENS[:, :24]).logits, hf(TOKENS[:, 24:]).logits], dim=1)
        assert (model(TOKENS, doc_ids=doc_ids) - alone).abs().max().item() <= 1e-4
    if kind == "qwen3_moe":
        assert [type(b.feed_forward).__name__ for b in model.layers.values()] == ["MoE", "FeedForward"]


def test_export_loads_in_transformers_and_imports_back_bit_for_bit(hf_and_ours):
    from safetensors import safe_open
    from safetensors.torch import save_file

    from holotrain.export import write_model
    from holotrain.model.hf import hf_config_dict, to_hf_state_dict

    kind, directory, hf, model = hf_and_ours
    with torch.no_grad():
        expected = hf(TOKENS).logits
    # holotrain export (no family given to the names: transformers 5's fused expert tensors), and the family's
    # per-expert layout, as transformers' save_pretrained writes it.
    fused, per_expert = directory / "export", directory / "per_expert"
    write_model(model, fused)
    per_expert.mkdir()
    state = to_hf_state_dict(model.state_dict(), family=model.args.family)
    save_file({k: v.contiguous() for k, v in state.items()}, per_expert / "model.safetensors",
              metadata={"format": "pt"})
    (per_expert / "config.json").write_text(json.dumps(hf_config_dict(model.args)))
    with safe_open(str(directory / "hf" / "model.safetensors"), "pt") as f:
        assert set(state) == set(f.keys())  # the names transformers saves
    for out in (fused, per_expert):
        shutil.copyfile(directory / "hf" / "tokenizer.json", out / "tokenizer.json")
        loaded = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
        assert type(loaded) is type(hf)
        with torch.no_grad():
            assert (loaded(TOKENS).logits - expected).abs().max().item() <= 1e-4
        again = _imported(out)
        assert again.args == model.args
        for name, value in model.state_dict().items():
            assert torch.equal(again.state_dict()[name], value), name


def test_an_import_fine_tunes_with_a_balancing_bias_that_does_not_export(hf_and_ours, tmp_path):
    """A Hugging Face model imported with model.router_bias = true: its bias (absent from the checkpoint) starts at
    zero, so the logits are transformers' still; its export is refused in one line naming the key."""
    from holotrain.config import load_config, resolve
    from holotrain.errors import ConfigError
    from holotrain.export import write_model
    from holotrain.parallel import DistEnv
    from holotrain.train.trainer import build_model

    kind, directory, hf, _ = hf_and_ours
    cfg = resolve(load_config(None, [f"--model.init_from={directory / 'hf'}", f"--data.seq_len={T}",
                                     "--job.device=cpu", "--model.router_bias=true",
                                     "--model.router_bias_update=batch"]), tokenizer_vocab=VOCAB)
    env = DistEnv(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    model = build_model(cfg, env, torch.float32).eval()
    assert all(not moe.expert_bias.any() for moe in model.moe_modules().values())
    with torch.no_grad():
        assert (model(TOKENS) - hf(TOKENS).logits).abs().max().item() <= 1e-4
    with pytest.raises(ConfigError, match="model.router_bias = true: Hugging Face's .* without a balancing bias"):
        write_model(model, tmp_path / "export")


def _moe(router="softmax", norm=True, shared=0, E=6, k=2, D=16, F=24, aux=0.0, z=0.0, seed=0) -> MoE:
    torch.manual_seed(seed)
    args = ModelArgs(dim=D, n_experts=E, n_active_experts=k, moe_ffn_dim=F, shared_ffn_dim=shared, router=router,
                     norm_topk_prob=norm, moe_aux_loss_coef=aux, router_z_loss_coef=z)
    moe = MoE(args)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0.0, 0.3)
    return moe


@pytest.mark.parametrize("router,norm,shared", [("softmax", True, 0), ("softmax", False, 12), ("sigmoid", True, 0)])
def test_experts_equal_a_loop_over_tokens(router, norm, shared):
    moe = _moe(router, norm, shared)
    x = torch.randn(3, 7, 16)
    if router == "sigmoid":
        moe.expert_bias.copy_(torch.linspace(-0.5, 0.5, 6))
    y = moe(x)
    flat = x.reshape(-1, 16)
    logits = flat @ moe.router.weight.T
    scores = logits.softmax(-1) if router == "softmax" else logits.sigmoid()
    choice = scores if router == "softmax" else scores + moe.expert_bias
    want = torch.zeros_like(flat)
    for n in range(flat.shape[0]):
        chosen = choice[n].topk(2).indices
        weights = scores[n, chosen] / (scores[n, chosen].sum() if norm else 1)
        for w, e in zip(weights, chosen):
            h = torch.nn.functional.silu(moe.w1[e] @ flat[n]) * (moe.w3[e] @ flat[n])
            want[n] += w * (moe.w2[e] @ h)
        if shared:
            s = moe.shared
            want[n] += s.w2.weight @ (torch.nn.functional.silu(s.w1.weight @ flat[n]) * (s.w3.weight @ flat[n]))
    assert torch.allclose(y.reshape(-1, 16), want, atol=1e-5)
    assert moe.last_load.sum().item() == flat.shape[0] * 2 and moe.last_load.shape == (6,)


def test_grouped_gemms_equal_the_reference_loop():
    """torch._grouped_mm (CUDA's path; it runs on the CPU too) against the loop, with an expert of no rows."""
    torch.manual_seed(0)
    counts = torch.tensor([3, 0, 5, 1])
    x = torch.randn(9, 16, requires_grad=True)
    w1, w3, w2 = torch.randn(4, 8, 16), torch.randn(4, 8, 16), torch.randn(4, 16, 8)
    ref = grouped_swiglu(x, counts, w1, w3, w2, grouped=False)
    got = grouped_swiglu(x, counts, w1, w3, w2, grouped=True)
    assert torch.allclose(got, ref, atol=1e-5)
    (gx,) = torch.autograd.grad(got.square().sum(), x)
    (rx,) = torch.autograd.grad(ref.square().sum(), x)
    assert torch.allclose(gx, rx, atol=1e-4)


def test_grouped_gemms_with_aligned_groups_equal_the_reference_loop():
    """An mm that wants each expert's rows a multiple of 16 (FP8's scaled grouped GEMM) gets them padded: the same
    outputs and gradients (inputs and all three weights) as the unpadded loop, groups of 0, 1, 16 and 17 rows; the
    padded rows' total a multiple of 16 too."""
    seen = []

    def aligned_mm(a, b_t, offs):
        seen.append(offs.clone())
        assert (offs % 16 == 0).all(), offs
        assert a.shape[0] % 16 == 0, a.shape  # the weight gradient reads the rows transposed: a 16-byte row stride
        return torch._grouped_mm(a, b_t, offs=offs)

    aligned_mm.row_alignment = 16
    torch.manual_seed(0)
    counts = torch.tensor([17, 0, 1, 16, 5])
    x = torch.randn(int(counts.sum()), 16, requires_grad=True)
    ws = [torch.randn(5, 8, 16, requires_grad=True), torch.randn(5, 8, 16, requires_grad=True),
          torch.randn(5, 16, 8, requires_grad=True)]
    grads = []
    for kwargs in (dict(grouped=False), dict(grouped=True, mm=aligned_mm)):
        y = grouped_swiglu(x, counts, *ws, **kwargs)
        grads.append([y, *torch.autograd.grad(y.square().sum(), [x, *ws])])
    assert len(seen) == 3 and seen[0].tolist() == [32, 32, 48, 64, 80]
    for ref, got in zip(*grads):
        assert got.shape == ref.shape and torch.allclose(got, ref, rtol=1e-4, atol=1e-3)


def test_aux_losses_equal_their_formulas():
    scores = torch.tensor([[0.7, 0.2, 0.1], [0.1, 0.6, 0.3], [0.5, 0.1, 0.4], [0.2, 0.2, 0.6]])
    counts = torch.tensor([3, 2, 3])  # top-2 of each row: (0, 1), (1, 2), (0, 2), (2, 0)
    f = torch.tensor([3, 2, 3]) / 8
    P = scores.mean(0)
    assert torch.allclose(load_balance_loss(scores, counts), 3 * (f * P).sum())
    uniform = torch.full((4, 3), 1 / 3)
    assert torch.allclose(load_balance_loss(uniform, torch.tensor([2, 2, 2])), torch.tensor(1.0))
    logits = torch.tensor([[1.0, 2.0, 3.0], [0.0, 0.0, 0.0]])
    assert torch.allclose(router_z_loss(logits), (torch.logsumexp(logits, -1) ** 2).mean())

    # In a forward: the module's term is coef * balance + coef * z over its routing.
    moe = _moe(aux=0.01, z=0.001)
    x = torch.randn(10, 16)
    moe(x)
    logits = x @ moe.router.weight.T
    probs = logits.softmax(-1)
    counts = torch.bincount(probs.topk(2).indices.flatten(), minlength=6)
    want = 0.01 * load_balance_loss(probs, counts) + 0.001 * router_z_loss(logits)
    assert torch.allclose(moe.aux_loss, want) and torch.equal(moe.last_load, counts)
    assert torch.allclose(moe.last_aux, torch.stack([load_balance_loss(probs, counts), router_z_loss(logits)]))


def test_sigmoid_router_chooses_by_biased_scores_and_weights_by_plain_ones():
    moe = _moe("sigmoid", norm=False, E=4, k=1)
    with torch.no_grad():
        moe.router.weight.zero_()
        moe.router.weight[0, 0] = 4.0  # expert 0 scores highest for x[0] > 0
    x = torch.zeros(2, 16)
    x[:, 0] = 1.0
    weights, experts, _, scores = moe.route(x)
    assert experts[:, 0].tolist() == [0, 0]
    moe.expert_bias.copy_(torch.tensor([0.0, 0.0, 0.7, 0.0]))  # sigmoid(4) = 0.982 < 0.5 + 0.7
    weights, experts, _, scores = moe.route(x)
    assert experts[:, 0].tolist() == [2, 2]
    assert torch.allclose(weights[:, 0], torch.full((2,), 0.5))  # expert 2's own score, not 1.2


def test_bias_update_moves_load_toward_balance():
    moe = _moe("sigmoid", E=4, k=1, seed=1)
    with torch.no_grad():
        moe.router.weight[0] += 0.3  # on positive inputs, expert 0 scores highest for every token
    x = torch.rand(256, 16, generator=torch.Generator().manual_seed(2))
    moe(x)
    assert moe.last_load.tolist() == [256, 0, 0, 0]
    for _ in range(40):
        moe(x)
        moe.update_bias(0.02)
    moe(x)
    assert moe.last_load.max().item() < 2 * 64 and moe.last_load.min().item() > 64 / 2, moe.last_load
    assert moe.expert_bias[0].item() < 0 < moe.expert_bias[1:].min().item()


def _shape(family: str, name: str, **changes) -> ModelArgs:
    """A family's preset with its fixed switches (as config resolution makes it) and `changes`."""
    from holotrain.model.registry import fix_switches, preset

    args = dataclasses.replace(preset(family, name), family=family, **changes)
    fix_switches(family, args)
    return args


def _tiny(family="qwen3_moe", **extra) -> ModelArgs:
    return _shape(family, "tiny", dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, ffn_dim=64,
                  moe_ffn_dim=64, vocab_size=VOCAB, max_seq_len=T, **extra)


def test_aux_loss_reaches_the_gradient_not_the_value():
    """With coefficients > 0 the loss's value is the cross-entropy's (an eval compares with a dense model's), its
    gradient that of the cross-entropy + the blocks' aux terms; a logits-only call is unaffected."""
    torch.manual_seed(0)
    args = _tiny(moe_aux_loss_coef=0.5, router_z_loss_coef=0.1)
    model, direct_model = build(args), build(args)
    plain = build(dataclasses.replace(args, moe_aux_loss_coef=0.0, router_z_loss_coef=0.0))
    for other in (direct_model, plain):
        other.load_state_dict(model.state_dict())
    targets = torch.roll(TOKENS, -1, 1)
    loss = model(TOKENS, targets)
    assert torch.equal(loss, plain(TOKENS, targets))
    assert all(m.aux_loss is None for m in model.moe_modules().values())  # consumed by the loss
    loss.backward()
    # By hand: the cross-entropy of the logits + each block's term of that forward (a logits-only call leaves them).
    logits = direct_model(TOKENS)
    direct = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))
    (direct + sum(m.aux_loss for m in direct_model.moe_modules().values())).backward()
    for (name, p), q in zip(model.named_parameters(), direct_model.parameters()):
        assert torch.allclose(p.grad, q.grad, atol=1e-6), name
    plain(TOKENS, targets).backward()
    router = "layers.0.feed_forward.router.weight"
    assert (dict(plain.named_parameters())[router].grad - dict(model.named_parameters())[router].grad).abs().max() > 1e-4
    with torch.no_grad():
        assert torch.equal(model(TOKENS), plain(TOKENS))


@pytest.mark.parametrize("aligned", [False, True])
def test_compiled_blocks_trace_whole_and_keep_the_aux_gradient(aligned):
    """Each block compiled as the trainer does (block.compile; here fullgraph with aot_eager, and the grouped GEMMs
    in bf16 as on a GPU): one graph for both blocks, no break, and eager's gradients with the auxiliary losses. Also
    with a grouped GEMM that wants aligned groups (FP8's: the rows padded by pad_groups)."""
    from torch._dynamo.utils import counters

    def aligned_mm(a, b_t, offs):
        return torch._grouped_mm(a, b_t, offs=offs)

    aligned_mm.row_alignment = 16
    torch.manual_seed(0)
    args = _tiny(moe_aux_loss_coef=0.5, router_z_loss_coef=0.1)
    eager, compiled = build(args).bfloat16(), build(args).bfloat16()
    compiled.load_state_dict(eager.state_dict())
    for model in (eager, compiled):
        if aligned:
            model.hooks.install("grouped_mm", aligned_mm, "precision")
        for moe in model.moe_modules().values():
            moe.grouped = True
    for block in compiled.layers.values():
        block.compile(backend="aot_eager", fullgraph=True)
    torch._dynamo.reset()
    counters.clear()
    doc_ids = (torch.arange(T) >= 24).long().expand(2, T)
    for model in (eager, compiled):
        model(TOKENS, torch.roll(TOKENS, -1, 1), doc_ids).backward()
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"]
    for (name, p), q in zip(compiled.named_parameters(), eager.parameters()):
        assert torch.equal(p.grad, q.grad), name
    assert torch.equal(compiled.expert_load(), eager.expert_load())


class _SumsInFp32(torch.overrides.TorchFunctionMode):
    """CUDA's autocast on the CPU, for one of its rules: a sum under autocast runs in fp32 and returns fp32 (CPU
    autocast leaves sums alone)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.sum, torch.Tensor.sum) and torch.is_autocast_enabled("cpu") and "dtype" not in kwargs:
            args = (args[0].float(), *args[1:])
        return func(*args, **kwargs)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_blocks_keep_the_residual_stream_in_bf16_under_an_autocast_that_sums_in_fp32(family):
    """Under CUDA's autocast every block hands the next a bf16 residual stream: an fp32 one would send the next
    blocks' experts down the reference loop (a host read per block, a recompilation per routing under compile)."""
    torch.manual_seed(0)
    model = build(_tiny(family, moe_aux_loss_coef=0.5))
    dtypes = []
    for block in model.layers.values():
        block.register_forward_hook(lambda module, inputs, output: dtypes.append(output.dtype))
    with _SumsInFp32(), torch.autocast("cpu", dtype=torch.bfloat16):
        model(TOKENS, torch.roll(TOKENS, -1, 1)).backward()
    assert dtypes == [torch.bfloat16] * len(model.layers)


@pytest.mark.parametrize("policy", ["full", "pointwise"])
def test_activation_checkpointing_keeps_the_aux_gradient(policy):
    from holotrain.memory.activation_checkpointing import apply_activation_checkpointing

    torch.manual_seed(0)
    args = _tiny(moe_aux_loss_coef=0.5, router_z_loss_coef=0.1)
    plain, checkpointed = build(args), build(args)
    checkpointed.load_state_dict(plain.state_dict())
    apply_activation_checkpointing(checkpointed, policy)
    for model in (plain, checkpointed):
        model(TOKENS, torch.roll(TOKENS, -1, 1)).backward()
    for (name, p), q in zip(checkpointed.named_parameters(), plain.parameters()):
        assert torch.equal(p.grad, q.grad), name


def test_a_tiny_moe_trains_through_holotrains_loss():
    torch.manual_seed(0)
    model = build(_tiny("mixtral", moe_aux_loss_coef=0.01, router_z_loss_coef=0.001))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    data = torch.randint(0, 32, (4, T + 1), generator=torch.Generator().manual_seed(1))
    losses = []
    for _ in range(8):
        loss = model(data[:, :-1], data[:, 1:])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.5, losses
    assert model.expert_load().shape == (2, 8)
    assert model.layers["0"].feed_forward.w1.grad is not None


def test_refusals_in_one_line():
    from holotrain.config import load_config, resolve
    from holotrain.errors import ConfigError
    from holotrain.model.registry import parallel_problem

    with pytest.raises(ConfigError, match=r"model.n_experts is not part of the llama family \(qwen3_moe, mixtral have"):
        resolve(load_config(None, ["--model.n_experts=8"]))
    with pytest.raises(ConfigError, match="model.n_active_experts = 9 must be between 1 and model.n_experts = 8"):
        resolve(load_config(None, ["--model.family=qwen3_moe", "--model.n_active_experts=9"]))
    with pytest.raises(ConfigError, match="tensor parallelism does not split a mixture-of-experts"):
        build(_tiny()).layer_roles()
    assert "parallel.tp = 2" in parallel_problem(_tiny(), tp=2) and parallel_problem(_tiny(), tp=1) is None
    cfg = resolve(load_config(None, ["--model.family=mixtral"]))
    assert cfg.model.n_experts == 8 and cfg.model.n_active_experts == 2 and cfg.model.norm_topk_prob


@pytest.mark.slow
def test_sharded_imports_and_layouts_equal_one_process():
    """Two gloo ranks (tests/moe_worker.py): FSDP2 imports of checkpoints in many files give one rank's logits; FSDP2
    (with the auxiliary losses), context and pipeline parallelism give one process's losses, for both families."""
    from tests.conftest import run_worker

    out = run_worker("moe_worker.py", 2, "MOE WORKER OK")
    assert out.count("losses equal one process's") == 6


def test_costs_count_active_parameters():
    from holotrain.model import num_params
    from holotrain.model.costs import block_active_params, block_params, flops_per_token, model_params
    args = _shape("qwen3_moe", "30b-a3b", max_seq_len=4096)
    with torch.device("meta"):
        assert num_params(build(args)) == model_params(args)
    assert round(model_params(args) / 1e9, 1) == 30.5 and round(model_params(args, active=True) / 1e9, 1) == 3.4
    d, E, k, F = 2048, 128, 8, 768
    attention = d * (2 * 32 * 128 + 2 * 4 * 128)
    assert block_params(args) == attention + d * E + 3 * d * F * E + 2 * d + 2 * 128
    assert block_active_params(args) == attention + d * E + 3 * d * F * k + 2 * d + 2 * 128
    linear = 48 * (attention + d * E + 3 * d * F * k) + d * 151936
    assert flops_per_token(args, 4096) == 6 * linear + 12 * 48 * 32 * 128 * 4096
    mixed = _tiny(dense_layers=(1,))
    with torch.device("meta"):
        assert num_params(build(mixed)) == model_params(mixed)


def test_expert_copies_cast_once_a_step_and_match_the_cast_at_each_micro_batch():
    """TrainStep under bf16 autocast on one device (model/moe.py's ExpertCopies): the experts run on bf16 copies made
    once a step, their gradients summed on the copies and handed to the fp32 weights before the optimizer. One
    micro-batch a step: the same losses and weights as the cast at each forward, bit for bit; two: within bf16's
    rounding of the gradient's sum. After each step the copies hold the new weights (evaluations see them)."""
    import copy

    from holotrain.config import load_config, resolve
    from holotrain.model.moe import ExpertCopies
    from holotrain.parallel import DistEnv
    from holotrain.train.trainer import TrainStep, build_model, build_optimizer

    def config(*more):
        return resolve(load_config(None, [
            "--model.family=qwen3_moe", "--model.preset=tiny", "--model.dim=32", "--model.n_layers=2",
            "--model.n_heads=2", "--model.n_kv_heads=1", "--model.head_dim=16", "--model.ffn_dim=64",
            "--model.moe_ffn_dim=16", "--model.n_experts=4", "--model.n_active_experts=2", "--data.seq_len=8",
            "--training.compile=false", *more,
        ]), tokenizer_vocab=64)

    cfg, cfg_off = config(), config("--training.expert_weight_copies=false")
    env = DistEnv(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    torch.manual_seed(0)
    base = build_model(cfg, env, torch.float32)
    batches = [(torch.randint(0, 64, (2, 8)), torch.randint(0, 64, (2, 8))) for _ in range(4)]

    def train(copies: bool, accum: int):
        model = copy.deepcopy(base)
        job = cfg if copies else cfg_off
        step = TrainStep(model, build_optimizer(model, job, env), job, env, torch.bfloat16)
        assert (step.expert_copies is not None) == copies  # on by default for this model under bf16 autocast
        losses = [step(lambda m, s=s: batches[(s * accum + m) % 4], accum, 1e-3)[0].item() for s in range(3)]
        return model, step, losses

    for accum in (1, 2):
        plain, _, plain_losses = train(False, accum)
        model, step, losses = train(True, accum)
        weights = dict(model.named_parameters())
        for name, w in plain.named_parameters():
            if accum == 1:
                assert torch.equal(weights[name], w), name
            else:
                assert torch.allclose(weights[name], w, atol=1e-4), name
        if accum == 1:
            assert losses == plain_losses
        else:
            assert losses[0] == plain_losses[0] and max(abs(a - b) for a, b in zip(losses, plain_losses)) < 1e-4
    moes = list(model.moe_modules().values())
    assert moes and ExpertCopies.applies(model) == moes
    for moe in moes:
        for c, w in zip(moe.copies, (moe.w1, moe.w3, moe.w2)):
            assert c.dtype == torch.bfloat16 and torch.equal(c, w.detach().to(torch.bfloat16)) and c.grad is None

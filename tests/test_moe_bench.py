"""The mixture-of-experts benchmark's pieces on the CPU: Qwen3-MoE with the sigmoid router (built, and refused by
export in one line), the shipped MoE configs, bench/moe_peer.py at its tiny shape, and bench/moe_summary.py on
rows written here."""

import importlib.util
import json

import pytest
import torch

from holotrain.config import ConfigError, load_config, resolve
from holotrain.model import build, model_args
from holotrain.model.hf import hf_config_dict
from holotrain.model.moe import MoE
from tests.conftest import REPO


def _bench(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_sigmoid_qwen3_moe_builds_and_export_refuses_it():
    cfg = resolve(load_config(None, ["--model.family=qwen3_moe", "--model.router=sigmoid"]), tokenizer_vocab=512)
    args = model_args(cfg.model)
    assert args.router == "sigmoid"
    with torch.device("meta"):
        model = build(args)
    moes = [m for m in model.modules() if isinstance(m, MoE)]
    assert len(moes) == args.n_layers and all(m.expert_bias is not None for m in moes)
    with pytest.raises(ConfigError, match=r"model\.router = 'sigmoid'.*cannot be exported"):
        hf_config_dict(args)
    softmax = model_args(resolve(load_config(None, ["--model.family=qwen3_moe"]), tokenizer_vocab=512).model)
    assert hf_config_dict(softmax)["architectures"] == ["Qwen3MoeForCausalLM"]


@pytest.mark.parametrize("name,overrides,layers,router", [
    ("qwen3-30b-a3b", [], 10, "softmax"),
    ("moe-balance", [], 12, ("softmax", True, "batch")),
    ("moe-balance", ["--model.router_bias=false", "--model.moe_aux_loss_coef=0.01"], 12, ("softmax", False, "batch")),
    ("moe-balance", ["--model.router=sigmoid", "--model.router_bias_update=solve"], 12, ("sigmoid", True, "solve")),
    (str(REPO / "bench" / "moe_proxy.toml"), [], 4, ("softmax", True, "batch")),  # moe-balance's CPU proxy
])
def test_moe_configs_load_and_resolve(name, overrides, layers, router):
    cfg = resolve(load_config(name, overrides), tokenizer_vocab=32000)
    args = model_args(cfg.model)
    assert (args.family, args.n_layers) == ("qwen3_moe", layers)
    if isinstance(router, str):
        assert args.router == router
    else:  # the router, whether its choice has the balancing bias (the sigmoid always has), and how that moves
        assert (args.router, args.router == "sigmoid" or args.router_bias, args.router_bias_update) == router
    if name == "qwen3-30b-a3b":  # Qwen3-30B-A3B's layer shape
        assert (args.dim, args.n_heads, args.n_kv_heads, args.head_dim) == (2048, 32, 4, 128)
        assert (args.n_experts, args.n_active_experts, args.moe_ffn_dim, args.vocab_size) == (128, 8, 768, 151936)
        assert cfg.training.compile and not args.tie_embeddings


def test_moe_peer_runs_its_tiny_shape_on_the_cpu(capsys):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model: two threads beside another test's spin-wait for seconds a step
    try:
        _bench("moe_peer").main(["--tiny"])
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("moe_peer: grouped_mm"))
    assert "tokens/s" in line and "micro 2x2" in line, out
    row = json.loads(next(x for x in out.splitlines() if x.startswith("{")))
    assert row["tokens_per_s"] > 0 and row["flops_per_token"] > 0 and row["checkpointing"] == "none"


def test_moe_summary_reads_the_parts(tmp_path, capsys):
    def jsonl(name, rows):
        (tmp_path / name).write_text("".join(json.dumps(r) + "\n" for r in rows))

    jsonl("moe-train.jsonl", [{"step": s, "loss": 9.0, "tokens_per_s": 1000.0 * s, "tflops": 300.0, "mfu": 0.3,
                               "mem.peak_gb": 120.0} for s in (5, 10, 15)])
    (tmp_path / "peer-grouped_mm-bf16.log").write_text("")
    (tmp_path / "peer-grouped_mm-bf16.json").write_text(json.dumps({"rows": [
        {"experts": "grouped_mm", "precision": "bf16", "tokens_per_s": 5000.0, "tflops": 120.0, "mfu": 0.12,
         "peak_mem_gb": 60.0, "micro": 4, "accum": 8, "checkpointing": "none"}]}))
    (tmp_path / "peer-eager-autocast.log").write_text("")  # timed out: no JSON
    for name, loss, worst in (("solve", 3.03 * 1.002, 1.2), ("sigmoid", 3.00, 1.1), ("batch", 3.03, 1.04),
                              ("aux", 3.03, 1.4)):
        jsonl(f"balance-{name}.jsonl", [{"step": s, "loss": loss, "tokens_per_s": 900.0 + s, "moe.load_max_over_mean":
                                         [1.05, worst if s > 100 else 3.0, None]} for s in range(5, 305, 5)])
    _bench("moe_summary").main(tmp_path)
    out = capsys.readouterr().out
    assert "holotrain: 12,500 tokens/s" in out and "peer eager-autocast: no result" in out
    assert "holotrain / fastest peer (grouped_mm bf16): 2.50x" in out
    assert "balance sigmoid: max/mean expert load after step 100: worst 1.100" in out
    assert "balance aux: max/mean expert load after step 100: worst 1.400" in out
    assert "sigmoid loss / auxiliary-loss run's: 0.9901" in out
    assert "balance solve: max/mean expert load after step 100: worst 1.200" in out
    assert "solve loss / auxiliary-loss run's: 1.0020" in out
    assert "balance batch: max/mean expert load after step 100: worst 1.050" in out  # the first layer's 1.05
    assert "batch loss / auxiliary-loss run's: 1.0000" in out and "balance batch: 1,102 tokens/s" in out  # steps 105-300


def test_balance_floor_counts_the_three_biases_of_a_watched_forward():
    """bench/balance_floor.py's watch: in a training forward of a sigmoid-routed block it records, on the second
    half of the rows, the max/mean load of the block's own bias ("now"), of a bias solved on those rows ("self") and
    of one solved on the first half ("cross"), each as max_over_mean counts it; nothing in a no_grad forward."""
    from holotrain.model.moe import balancing_bias

    floor = _bench("balance_floor")
    args = model_args(resolve(load_config(None, [
        "--model.family=qwen3_moe", "--model.router=sigmoid", "--model.dim=32", "--model.n_experts=8",
        "--model.n_active_experts=2", "--model.moe_ffn_dim=16"]), tokenizer_vocab=64).model)
    record = MoE.record
    rows: list[dict] = []
    try:
        floor.watch(1, rows)
        torch.manual_seed(0)
        moe = MoE(args)
        for w in (moe.router.weight, moe.w1, moe.w3, moe.w2):
            torch.nn.init.normal_(w, std=0.5)
        moe.expert_bias.copy_(torch.linspace(-0.2, 0.2, 8))
        x = torch.randn(4, 64, 32)
        with torch.no_grad():
            moe(x)
        assert rows == []
        moe(x)
    finally:
        MoE.record = record
    (row,) = rows
    scores = moe.route(x.reshape(-1, 32))[3].detach()
    first, second = scores[:128], scores[128:]
    bias = moe.expert_bias
    assert row["now"] == floor.max_over_mean(second, bias, 2, 8)
    assert row["self"] == floor.max_over_mean(second, balancing_bias(second, bias, 2), 2, 8)
    assert row["cross"] == floor.max_over_mean(second, balancing_bias(first, bias, 2), 2, 8)
    assert row["self"] < 1.1 < row["now"]
    loads = torch.bincount((second + bias).topk(2).indices.flatten(), minlength=8).float()
    assert row["now"] == (loads.max() / loads.mean()).item()

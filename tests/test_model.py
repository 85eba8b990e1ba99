import pytest
import torch

from holotrain.model.families.llama import PRESETS
from holotrain.model import Decoder, ModelArgs, build, num_params
from holotrain.model.costs import flops_per_token
from holotrain.model.hf import from_hf_state_dict, hf_config_dict, to_hf_state_dict

transformers = pytest.importorskip("transformers")


def hf_twin(model: Decoder):
    cfg = transformers.LlamaConfig(**hf_config_dict(model.args))
    hf = transformers.LlamaForCausalLM(cfg).eval()
    hf.load_state_dict(to_hf_state_dict(model.state_dict()), strict=True)
    return hf


@pytest.mark.parametrize(
    "args",
    [
        ModelArgs(dim=128, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=352, vocab_size=512, max_seq_len=64),
        ModelArgs(dim=96, n_layers=3, n_heads=6, n_kv_heads=6, ffn_dim=256, vocab_size=300, max_seq_len=48,
                  rope_theta=500000.0, norm_eps=1e-6),
    ],
)
def test_logits_match_transformers(args):
    torch.manual_seed(0)
    model = build(args).eval()
    # Perturb norms away from 1 so their weights are exercised too.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    hf = hf_twin(model)
    tokens = torch.randint(0, args.vocab_size, (3, args.max_seq_len))
    with torch.no_grad():
        ours, theirs = model(tokens), hf(tokens).logits
    assert (ours - theirs).abs().max().item() <= 1e-4
    assert num_params(model) == hf.num_parameters()


def test_loss_matches_manual_cross_entropy():
    args = ModelArgs(dim=64, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=100, max_seq_len=16)
    model = build(args)
    x = torch.randint(0, 100, (2, 16))
    y = torch.randint(0, 100, (2, 16))
    expected = torch.nn.functional.cross_entropy(model(x).reshape(-1, 100), y.reshape(-1))
    assert torch.allclose(model(x, y), expected)


def test_hf_names_round_trip():
    args = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=100, max_seq_len=16)
    sd = build(args).state_dict()
    back = from_hf_state_dict(to_hf_state_dict(sd))
    assert back.keys() == sd.keys()


def test_param_and_flop_counts_1_4b():
    args = ModelArgs(**{**PRESETS["1.4b"].__dict__, "max_seq_len": 2048})
    with torch.device("meta"):
        model = build(args)
    d, L, f, V = 2048, 24, 5632, 32000
    per_layer = 4 * d * d + 3 * d * f + 2 * d
    assert num_params(model) == L * per_layer + 2 * V * d + d
    linear = L * (4 * d * d + 3 * d * f) + d * V
    assert flops_per_token(args, 2048) == 6 * linear + 12 * L * d * 2048


def test_gqa_flops_count_smaller_kv_projections():
    a = ModelArgs(dim=256, n_layers=2, n_heads=8, n_kv_heads=2, ffn_dim=512, vocab_size=1000, max_seq_len=64)
    hd = 32
    linear = 2 * (256 * 256 * 2 + 256 * 2 * hd * 2 + 3 * 256 * 512) + 256 * 1000
    assert flops_per_token(a, 64) == 6 * linear + 12 * 2 * 256 * 64

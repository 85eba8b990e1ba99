"""The model families against transformers (tiny random models made here, fp32, T = 256): Llama 3.2 (tied head),
Qwen2.5 (q/k/v biases), Qwen3 (q/k norm, head_dim 64 in a width of 256), Mistral (sliding window 64). Each imports
with transformers' logits; its export loads in transformers with the same logits and imports back bit for bit."""

import shutil

import pytest
import torch

from tests.hf_models import KINDS, VOCAB, make_hf_model

FAMILY_KINDS = {"llama3.2": "llama", "qwen2.5": "qwen2", "qwen3": "qwen3", "mistral": "mistral"}
T = 256
TOKENS = torch.randint(0, VOCAB, (2, T), generator=torch.Generator().manual_seed(0))


def _imported(directory):
    from holotrain.config import load_config, resolve
    from holotrain.parallel import DistEnv
    from holotrain.train.trainer import build_model

    cfg = resolve(load_config(None, [f"--model.init_from={directory}", f"--data.seq_len={T}", "--job.device=cpu"]),
                  tokenizer_vocab=VOCAB)
    env = DistEnv(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    return build_model(cfg, env, torch.float32).eval()


@pytest.mark.parametrize("kind", list(FAMILY_KINDS))
def test_family_matches_transformers_and_round_trips(kind, tmp_path):
    import transformers

    from holotrain.export import write_model

    hf = make_hf_model(tmp_path / "hf", kind)
    model = _imported(tmp_path / "hf")
    assert model.args.family == FAMILY_KINDS[kind]
    with torch.no_grad():
        expected = hf(TOKENS).logits
        assert (model(TOKENS) - expected).abs().max().item() <= 1e-4

    out = tmp_path / "export"
    write_model(model, out)
    shutil.copyfile(tmp_path / "hf" / "tokenizer.json", out / "tokenizer.json")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert type(loaded) is type(hf)
    with torch.no_grad():
        assert (loaded(TOKENS).logits - expected).abs().max().item() <= 1e-4
    again = _imported(out)
    assert again.args == model.args
    for name, value in model.state_dict().items():
        assert torch.equal(again.state_dict()[name], value), name

    # What the family adds is seen: without it the logits are far from transformers'.
    import dataclasses

    from holotrain.model import build

    plain = dataclasses.replace(model.args, family="llama", qk_norm=False, sliding_window=0, qkv_bias=False,
                                out_bias=False)
    if plain != dataclasses.replace(model.args, family="llama"):
        other = build(plain).eval()
        other.load_state_dict({k: v for k, v in model.state_dict().items() if k in other.state_dict()}, strict=False)
        with torch.no_grad():
            assert (other(TOKENS) - expected).abs().max().item() > 1e-3


def test_hf_shapes_of_the_families():
    assert KINDS["qwen3"]["head_dim"] * KINDS["qwen3"]["num_attention_heads"] != KINDS["qwen3"]["hidden_size"]
    assert KINDS["mistral"]["sliding_window"] < T


def test_a_switch_outside_the_family_is_one_line():
    from holotrain.config import load_config, resolve
    from holotrain.errors import ConfigError

    with pytest.raises(ConfigError, match=r"model.sliding_window is not part of the llama family \(mistral has it"):
        resolve(load_config(None, ["--model.sliding_window=64"]))
    with pytest.raises(ConfigError, match="unknown family 'gpt2'"):
        resolve(load_config(None, ["--model.family=gpt2"]))
    with pytest.raises(ConfigError, match="the qwen3 family has no preset '125m'"):
        resolve(load_config(None, ["--model.family=qwen3", "--model.preset=125m"]))
    cfg = resolve(load_config(None, ["--model.family=qwen3"]))
    assert cfg.model.qk_norm and cfg.model.head_dim == 64 and cfg.model.dim == 256


@pytest.mark.slow
def test_every_family_under_fsdp_tp_cp_and_pp_trains_as_one_process():
    """One torchrun launch of 2 gloo ranks: each family under dp=2 (FSDP2), tp=2, cp=2 and pp=2 gives one process's
    losses over 5 steps of packed documents (tests/families_worker.py)."""
    from tests.conftest import run_worker

    out = run_worker("families_worker.py", 2, "FAMILIES WORKER OK")
    assert out.count("losses equal one process's") == 16


def test_what_cannot_compose_is_refused_in_one_line():
    from holotrain.errors import ConfigError
    from holotrain.parallel.cp import resolve_mode

    assert resolve_mode("auto", 2, 8, 4, window=64) == "alltoall"
    with pytest.raises(ConfigError, match="sliding_window = 64 runs under context parallelism with parallel.cp_mode = "
                                          "'alltoall' only"):
        resolve_mode("ring", 2, 8, 4, window=64)

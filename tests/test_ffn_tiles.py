"""Feed-forwards tiled over the sequence (memory.ffn_tiles; model/parts.py FeedForward): the same loss and gradients
as the whole sequence at once, less kept for backward (with and without block checkpointing), the memory plan's
term, and the config's refusal beside tensor parallelism."""

import copy

import pytest
import torch

from holotrain.config import load_config, resolve
from holotrain.errors import ConfigError
from holotrain.memory.activation_checkpointing import apply_activation_checkpointing
from holotrain.memory.plan import activations
from holotrain.model import ModelArgs, build

ARGS = ModelArgs(family="llama", dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=176, vocab_size=128,
                 max_seq_len=64)


def _saved_bytes(model, tokens, targets) -> tuple[float, int]:
    total = [0]

    def pack(t):
        total[0] += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(tokens, targets)
    loss.backward()
    return loss.item(), total[0]


@pytest.mark.parametrize("checkpointing", ["none", "full"])
def test_tiled_feed_forward_gives_the_same_loss_and_gradients_and_keeps_less(checkpointing):
    torch.manual_seed(0)
    whole = build(ARGS)
    whole.init_weights(seed=1)
    tiled = copy.deepcopy(whole)
    tiled.tile_feed_forward(4)
    if checkpointing != "none":
        for model in (whole, tiled):
            apply_activation_checkpointing(model, checkpointing)
    tokens, targets = torch.randint(0, 128, (2, 64)), torch.randint(0, 128, (2, 64))
    (loss, kept), (loss_tiled, kept_tiled) = (_saved_bytes(m, tokens, targets) for m in (whole, tiled))
    assert loss_tiled == pytest.approx(loss, abs=1e-6)
    for (name, a), b in zip(whole.named_parameters(), tiled.parameters()):
        assert torch.allclose(a.grad, b.grad, atol=1e-6), name
    if checkpointing == "none":
        # Each block keeps its tiles' inputs (dim a token) where it kept gate, up, silu(gate) and their product.
        assert kept - kept_tiled >= 2 * 128 * 4 * (4 * ARGS.ffn_dim - ARGS.dim) * 0.9, (kept, kept_tiled)


def test_the_memory_plan_counts_the_tiles_and_tensor_parallelism_refuses_them():
    common = ["--model.dim=2048", "--model.n_layers=4", "--model.n_heads=16", "--model.n_kv_heads=8",
              "--model.ffn_dim=5632", "--data.seq_len=65536", "--memory.activation_checkpointing=none"]
    cfg, tiled = (resolve(load_config(None, common + extra), tokenizer_vocab=512)
                  for extra in ([], ["--memory.ffn_tiles=8"]))
    whole, less = (activations(c, 1, 2, 0) for c in (cfg, tiled))
    # Four blocks keep their tiles' inputs (one dim a token) in place of gate and up; backward makes one tile's worth.
    assert whole.saved - less.saved > 4 * 65536 * 2 * (2 * 5632 - 2048)
    assert less.recompute < whole.recompute
    with pytest.raises(ConfigError, match="memory.ffn_tiles > 1 does not combine with parallel.tp > 1"):
        resolve(load_config(None, ["--memory.ffn_tiles=4", "--parallel.tp=2"]))
    with pytest.raises(ConfigError, match="memory.ffn_tiles must be >= 1"):
        resolve(load_config(None, ["--memory.ffn_tiles=0"]))

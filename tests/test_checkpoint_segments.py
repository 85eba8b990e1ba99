"""memory.activation_checkpointing_segment: every k-th block's input kept, segments re-run in backward."""

from __future__ import annotations

import gc

import pytest
import torch

from holotrain.memory.activation_checkpointing import (Segments, apply_activation_checkpointing, segment_inputs,
                                                       segment_recompute_share)
from holotrain.model import ModelArgs, build

ARGS = ModelArgs(dim=64, n_layers=5, n_heads=4, n_kv_heads=2, ffn_dim=176, vocab_size=256, max_seq_len=32)


class _Count(torch.nn.Module):
    """A block that counts its forwards and keeps each input it was given (by identity) for the test."""

    def __init__(self, block):
        super().__init__()
        self.block, self.calls = block, 0

    def forward(self, h, *args):
        self.calls += 1
        return self.block(h, *args)


def _step(model, batches, runner):
    model.zero_grad(set_to_none=True)
    model.hooks.install("run_blocks", runner, "memory")
    losses = []
    for tokens in batches:
        loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        losses.append(loss.item())
    return losses, {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("compiled", [False, True])
def test_segments_give_full_checkpointings_gradients_and_forward_each_block_once_more(compiled):
    """Bit for bit the gradients of "full" alone at k = 2 and 3 (5 blocks: segments of 2+2+1 and 3+2), eager and
    with each block compiled; a block of a segment of two or more forwards once more, in the segment's re-run."""
    torch.manual_seed(0)
    model = build(ARGS)
    apply_activation_checkpointing(model, "full")
    if compiled:
        for block in model.layers.values():
            block.compile()
    for name in list(model.layers.keys()):
        model.layers.register_module(name, _Count(model.layers[name]))
    batches = [torch.randint(0, ARGS.vocab_size, (2, 33)) for _ in range(2)]
    runs = {}
    for k in (2, 3, 1):  # compiled first under the segments' checkpoint
        for block in model.layers.values():
            block.calls = 0
        runs[k] = _step(model, batches, Segments(k) if k > 1 else None), [b.calls for b in model.layers.values()]
    (want_losses, want), _ = runs[1]
    for k in (2, 3):
        (losses, got), calls = runs[k]
        assert losses == want_losses
        for name in want:
            assert torch.equal(got[name], want[name]), (k, name)
        # Counted at the wrapper around the checkpointed block: forward and the segment's re-run; the block's own
        # recomputation runs inside the wrapper. A last segment of one block is not re-run.
        alone = ARGS.n_layers - 1 if ARGS.n_layers % k == 1 else None
        assert calls == [len(batches) * (1 if i == alone else 2) for i in range(ARGS.n_layers)], (k, calls)
        assert sum(c - len(batches) for c in calls) == round(
            len(batches) * ARGS.n_layers * segment_recompute_share(ARGS.n_layers, k))


def test_segments_keep_every_kth_input():
    """What forward leaves alive for backward: with k = n_layers (one segment) the stack's hidden states are the
    segment's input alone, with "full" alone every block's input (counted as distinct [B, T, dim] storages alive
    between forward and backward, the head's in both)."""
    torch.manual_seed(0)
    model = build(ARGS)
    apply_activation_checkpointing(model, "full")
    tokens = torch.randint(0, ARGS.vocab_size, (2, 33))

    def hidden_states() -> set[int]:
        gc.collect()
        return {o.untyped_storage().data_ptr() for o in gc.get_objects()
                if type(o) is torch.Tensor and o.shape == (2, 32, ARGS.dim)}

    def alive(runner) -> int:
        model.hooks.install("run_blocks", runner, "memory")
        before = hidden_states()
        loss = model(tokens[:, :-1], tokens[:, 1:])
        held = hidden_states() - before
        loss.backward()
        return len(held)

    assert alive(None) - alive(Segments(ARGS.n_layers)) == ARGS.n_layers - 1
    assert segment_inputs(ARGS.n_layers, ARGS.n_layers) == (1, ARGS.n_layers - 1)
    assert segment_inputs(32, 4) == (8, 3) and segment_inputs(32, 1) == (32, 0)


def test_segments_are_refused_without_full_checkpointing_or_with_offloaded_inputs():
    from holotrain.config import ConfigError, load_config, resolve

    def check(*overrides):
        return resolve(load_config("tiny", ["--memory.activation_checkpointing=full", *overrides]))

    with pytest.raises(ConfigError, match="activation_checkpointing_segment = 2 re-runs"):
        check("--memory.activation_checkpointing=selective", "--memory.activation_checkpointing_segment=2")
    with pytest.raises(ConfigError, match="do not combine"):
        check("--memory.activation_checkpointing_segment=2", "--memory.activation_offload_blocks=1")
    assert check("--memory.activation_checkpointing_segment=2").memory.activation_checkpointing_segment == 2

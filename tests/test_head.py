"""The fused output head (model/head.py): the same loss and gradients as the plain head and cross-entropy."""

import gc
import weakref

import pytest
import torch
import torch.nn.functional as F

from holotrain.model import ModelArgs, build
from holotrain.model.head import fused_linear_cross_entropy


def test_fused_head_matches_the_plain_cross_entropy_and_its_gradients():
    torch.manual_seed(0)
    h = torch.randn(100, 16, requires_grad=True)
    w = torch.randn(50, 16, requires_grad=True)
    targets = torch.randint(0, 50, (100,))
    targets[::7] = -100
    ref = F.cross_entropy(h @ w.t(), targets, ignore_index=-100)
    ref.backward()
    gh, gw = h.grad.clone(), w.grad.clone()
    h.grad = w.grad = None
    total, count = fused_linear_cross_entropy(h, w, targets, chunk=32)  # 4 pieces, the last one short
    loss = total / count
    loss.backward()
    assert count.item() == (targets != -100).sum().item()
    assert loss.item() == pytest.approx(ref.item(), rel=1e-6)
    torch.testing.assert_close(h.grad, gh, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(w.grad, gw, atol=1e-6, rtol=1e-5)


def test_a_model_with_a_chunked_loss_trains_like_the_whole_loss():
    """memory.loss_chunk_tokens > 0 takes the fused path: loss and every parameter's gradient as with no chunks."""
    args = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=100, max_seq_len=32)
    torch.manual_seed(0)
    tokens = torch.randint(0, 100, (3, 33))
    tokens[1, 5:9] = -100
    inputs, targets = tokens[:, :-1].clamp_min(0), tokens[:, 1:]
    grads = []
    for chunk in (0, 40):
        model = build(args)
        model.init_weights(seed=1)
        model.hooks.install("loss_chunk_tokens", chunk, "memory")
        loss = model(inputs, targets)
        loss.backward()
        grads.append((loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (a, ga), (b, gb) = grads
    assert b == pytest.approx(a, rel=1e-6)
    for name in ga:
        torch.testing.assert_close(gb[name], ga[name], atol=1e-6, rtol=1e-4, msg=name)


def test_the_final_norm_in_the_pieces_keeps_only_the_gradients():
    """With the final norm fused into the pieces, backward keeps the gradients of the hidden states and of the two
    weights, not the norm's fp32 input and output (at T = 1M and dim 2048: 17 GB); loss and gradients are those of
    the norm, head and cross-entropy taken whole."""
    from holotrain.model.parts import RMSNorm

    torch.manual_seed(0)
    norm = RMSNorm(16, 1e-5)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    h = torch.randn(100, 16, requires_grad=True)
    w = torch.randn(50, 16, requires_grad=True)
    targets = torch.randint(0, 50, (100,))
    ref = F.cross_entropy(norm(h) @ w.t(), targets)
    want = torch.autograd.grad(ref, (h, w, norm.weight))
    saved = []  # every tensor saved for a backward: the pieces' own (freed with each piece) and the loss's
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(weakref.ref(t)) or t, lambda t: t):
        total, count = fused_linear_cross_entropy(h, w, targets, chunk=32, norm=(norm.weight, norm.with_weight))
    gc.collect()
    kept = [ref().shape for ref in saved if ref() is not None]
    got = torch.autograd.grad(total / count, (h, w, norm.weight))
    assert (total / count).item() == pytest.approx(ref.item(), rel=1e-6)
    for g, r in zip(got, want):
        torch.testing.assert_close(g, r, atol=1e-6, rtol=1e-5)
    assert sorted(kept) == sorted([h.shape, w.shape, norm.weight.shape]), kept

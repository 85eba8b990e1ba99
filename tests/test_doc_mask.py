"""Cross-document attention masking for packed sequences (Llama.forward's doc_ids)."""

import pytest
import torch
import torch.nn.functional as F

from holotrain.model import Decoder, ModelArgs, build
from holotrain.model import parts

ARGS = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=100, max_seq_len=64)


def small_model(args: ModelArgs = ARGS, seed: int = 0) -> Decoder:
    torch.manual_seed(seed)
    return build(args).eval()


def packed(lengths: list[int], vocab: int) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """One row of random documents of the given lengths: tokens [1, T], doc_ids [1, T], and the documents."""
    docs = [torch.randint(0, vocab, (1, n)) for n in lengths]
    doc_ids = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])[None]
    return torch.cat(docs, dim=1), doc_ids, docs


@pytest.mark.parametrize("lengths", [[13, 20], [7, 25, 11, 5]])  # the second: three documents and a padding tail
def test_packed_logits_equal_separate_documents(lengths):
    model = small_model()
    tokens, doc_ids, docs = packed(lengths, ARGS.vocab_size)
    with torch.no_grad():
        together = model(tokens, doc_ids=doc_ids)
        alone = torch.cat([model(d) for d in docs], dim=1)
    assert (together - alone).abs().max().item() <= 1e-5


def test_packed_batch_rows_are_independent():
    model = small_model()
    t0, d0, docs0 = packed([13, 20], ARGS.vocab_size)
    t1, d1, docs1 = packed([5, 9, 19], ARGS.vocab_size)
    with torch.no_grad():
        together = model(torch.cat([t0, t1]), doc_ids=torch.cat([d0, d1]))
        alone = torch.cat([torch.cat([model(d) for d in docs], dim=1) for docs in (docs0, docs1)])
    assert (together - alone).abs().max().item() <= 1e-5


def test_loss_ignores_minus_100_targets():
    model = small_model()
    tokens, doc_ids, _ = packed([13, 20], ARGS.vocab_size)
    targets = torch.randint(0, ARGS.vocab_size, tokens.shape)
    targets[0, 12] = -100  # last token of document A: no next token within it
    targets[0, 28:] = -100  # a padding tail
    with torch.no_grad():
        logits = model(tokens, doc_ids=doc_ids)
        loss = model(tokens, targets, doc_ids=doc_ids)
    keep = targets[0] != -100
    expected = F.cross_entropy(logits[0, keep], targets[0, keep])
    assert torch.allclose(loss, expected, atol=1e-6)


def test_single_document_equals_fast_path():
    model = small_model()
    tokens = torch.randint(0, ARGS.vocab_size, (2, 33))
    with torch.no_grad():
        masked = model(tokens, doc_ids=torch.zeros_like(tokens))
        plain = model(tokens)
    assert torch.allclose(masked, plain, atol=1e-5)


def test_doc_positions():
    doc_ids = torch.tensor([[0, 0, 1, 1, 1, 2], [0, 1, 1, 1, 1, 1], [0, 0, 0, 0, 0, 0]])
    expected = torch.tensor([[0, 1, 0, 1, 2, 0], [0, 0, 1, 2, 3, 4], [0, 1, 2, 3, 4, 5]])
    assert torch.equal(parts.doc_positions(doc_ids), expected)


def test_doc_attn_mask():
    mask = parts.doc_attn_mask(torch.tensor([[0, 0, 1]]))
    expected = torch.tensor([[1, 0, 0], [1, 1, 0], [0, 0, 1]], dtype=torch.bool)
    assert mask.shape == (1, 1, 3, 3) and torch.equal(mask[0, 0], expected)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="flex_attention path needs CUDA")
def test_flex_matches_sdpa_mask_on_cuda(monkeypatch):
    args = ModelArgs(dim=128, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=256, vocab_size=100, max_seq_len=256)
    model = small_model(args).cuda().train()
    # Two rows, lengths not multiples of flex's 128-token blocks, the second with a padding tail.
    rows = [[50, 70, 60, 20], [3, 150, 47]]
    tokens = torch.randint(0, args.vocab_size, (2, 200), device="cuda")
    doc_ids = torch.stack([torch.cat([torch.full((n,), i) for i, n in enumerate(r)]) for r in rows]).cuda()
    targets = torch.randint(0, args.vocab_size, (2, 200), device="cuda")
    targets[1, 180:] = -100

    def run():
        model.zero_grad()
        with torch.autocast("cuda", torch.bfloat16):
            logits = model(tokens, doc_ids=doc_ids)
            loss = model(tokens, targets, doc_ids=doc_ids)
        loss.backward()
        return logits.float(), loss.float(), {n: p.grad.clone() for n, p in model.named_parameters()}

    flex = run()
    monkeypatch.setattr(parts, "doc_block_mask", parts.doc_attn_mask)  # the SDPA boolean-mask reference
    ref = run()

    def rel(a, b):
        return ((a - b).norm() / b.norm()).item()

    assert rel(flex[0], ref[0]) < 2e-2
    assert rel(flex[1], ref[1]) < 2e-2
    for name, grad in ref[2].items():
        assert rel(flex[2][name], grad) < 2e-2, name

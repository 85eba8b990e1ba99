"""Context parallelism (holotrain/parallel/cp.py): the model split over ranks by sequence against one process.
Training through `holotrain train` under parallel.cp is checked in tests/test_distributed.py."""


import pytest
import torch

from holotrain.config import ConfigError, load_config, resolve
from holotrain.parallel.cp import resolve_mode
from tests.conftest import run_worker


@pytest.mark.slow
def test_cp4_dp2xcp2_and_cp2xtp2_losses_and_gradients_equal_one_process():
    """One torchrun launch of 4 gloo ranks: cp=4, dp=2 x cp=2 (FSDP2) and cp=2 x tp=2, each in ring and all-to-all
    mode, on packed documents with masked targets: loss and every gradient equal one process's (fp32)."""
    out = run_worker("cp_worker.py", 4, "CP WORKER OK")
    assert out.count("gradients equal one process's") == 6


def test_cp_mode_auto_and_config_errors_name_the_key():
    assert resolve_mode("auto", 2, 8, 4) == "alltoall"
    assert resolve_mode("auto", 4, 8, 2) == "ring"  # kv heads do not divide
    with pytest.raises(ConfigError, match="cp_mode = 'alltoall' needs the heads"):
        resolve_mode("alltoall", 4, 8, 2)
    for override, message in (("--parallel.cp=0", "parallel.cp must be >= 1"),
                              ("--parallel.cp_mode=zigzag", "parallel.cp_mode must be auto, ring or alltoall"),
                              ("--data.seq_len=36", r"data.seq_len=36 must divide by 2 x parallel.cp")):
        with pytest.raises(ConfigError, match=message):
            resolve(load_config(None, ["--parallel.cp=4", "--data.seq_len=64", override]), tokenizer_vocab=500)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_ring_blocks_merge_to_whole_attention(device):
    """The ring's per-block kernels (CPU flash, CUDA memory-efficient) on one rank: a query chunk over an earlier key
    chunk under a document mask (one row sees none of it) and over its own chunk (causal), merged by log-sum-exp,
    and each block's backward given the merged output: equal to attention over both chunks at once."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from holotrain.parallel.cp import CAUSAL, _block_backward, _block_forward, _merge

    g = torch.Generator().manual_seed(3)
    B, H, Hkv, c, D = 2, 4, 2, 48, 16
    q, k0, k1, v0, v1 = (torch.randn(B, h, c, D, generator=g).to(device) for h in (H, Hkv, Hkv, Hkv, Hkv))
    # Row 0: the document that ends the key chunk goes on through the query chunk; row 1: a new one starts with it.
    docs_q = torch.tensor([[1] * 48, [3] * 48]).to(device)
    docs_k = torch.tensor([[0] * 30 + [1] * 18, [0] * 20 + [2] * 28]).to(device)
    mask0 = (docs_q[:, :, None] == docs_k[:, None, :])[:, None]  # [B, 1, c, c]
    mask1 = torch.ones(B, 1, c, c, dtype=torch.bool, device=device).tril()
    whole = torch.cat([mask0, mask1], dim=-1)
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, torch.cat([k0, k1], 2), torch.cat([v0, v1], 2)))
    ref = torch.nn.functional.scaled_dot_product_attention(qr, kr, vr, attn_mask=whole, enable_gqa=True)
    dout = torch.randn(ref.shape, generator=g).to(device)
    ref.backward(dout)

    out = torch.zeros(B, H, c, D, device=device)
    lse = torch.full((B, H, c), float("-inf"), device=device)
    for kk, vv, kind in ((k0, v0, mask0), (k1, v1, CAUSAL)):
        _merge(out, lse, *_block_forward(q, kk, vv, kind))
    assert torch.allclose(out, ref.detach(), atol=2e-5), (out - ref).abs().max()
    dq0, dk0, dv0 = _block_backward(dout, q, k0, v0, out, lse, mask0)
    dq1, dk1, dv1 = _block_backward(dout, q, k1, v1, out, lse, CAUSAL)
    for got, want in ((dq0 + dq1, qr.grad), (torch.cat([dk0, dk1], 2), kr.grad), (torch.cat([dv0, dv1], 2), vr.grad)):
        assert torch.allclose(got, want, atol=5e-5), (got - want).abs().max()

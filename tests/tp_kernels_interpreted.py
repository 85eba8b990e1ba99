"""The fused TP kernels' index logic under Triton's CPU interpreter (run by tests/test_tp.py when Triton is
installed): the GEMM alone, all-gather + GEMM as any rank with every piece arrived, the error word when a piece
never arrives, and GEMM + reduce-scatter for 2 and 3 ranks simulated in one address space (a peer's kernel runs
first and stores its tiles into this rank's staging). fp16: the interpreter mishandles bf16."""

import os
import sys
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import triton.runtime.interpreter as _interp  # noqa: E402

_patch = _interp._patch_lang_tensor


def _patch_index(tensor, scope):  # numpy >= 2.4 no longer converts size-1 arrays with int()
    _patch(tensor, scope)
    scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))


_interp._patch_lang_tensor = _patch_index

from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: E402

from holotrain.parallel import overlap_kernels as ok  # noqa: E402
from holotrain.parallel.symm import SYMM_HEADER  # noqa: E402
from holotrain.parallel.tiles import Tiles  # noqa: E402

T = Tiles(bm=16, bn=32, bk=16, group_m=2, stages=2, warps=4, reserve_sms=0)
DT = torch.float16
torch.manual_seed(0)


def ref(a, w, layout):
    return a.float() @ (w.float().t() if layout == "nk" else w.float())


def weight(N, K, layout):
    return torch.randn(N, K, dtype=DT) if layout == "nk" else torch.randn(K, N, dtype=DT)


def out_desc(out):
    return TensorDescriptor.from_tensor(out, [T.bm, T.bn])


def stage_desc(buf, W, m, N):
    """A rank's staging [2 parities x W sources, m, N] after the header, as the host side describes it."""
    return TensorDescriptor.from_tensor(buf[SYMM_HEADER:].view(DT).view(2 * W, m, N), [1, T.bm, T.bn])


def main():
    flat_halves = Tiles(bm=16, bn=32, bk=16, group_m=2, stages=2, warps=4, reserve_sms=0, flat=1, epi=2)
    for M, K, N in [(40, 48, 72), (64, 32, 64)]:
        for layout in ("nk", "kn"):
            for tiles in (T, flat_halves):
                a, w = torch.randn(M, K, dtype=DT), weight(N, K, layout)
                y = ok.triton_matmul(a, w, layout, tiles, num_sms=3)
                err = (y.float() - ref(a, w, layout)).abs().max().item()
                assert err < 0.05, ("matmul", M, K, N, layout, str(tiles), err)

    W, m, K, N = 3, 40, 48, 72
    for rank in range(W):
        for layout in ("nk", "kn"):
            g, w = torch.randn(W * m, K, dtype=DT), weight(N, K, layout)
            y = torch.full((W * m, N), float("nan"), dtype=DT)
            flags, err = torch.ones(W * 2, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
            own = g[rank * m:(rank + 1) * m].clone()
            g[rank * m:(rank + 1) * m] = float("nan")  # the own rows are read from the shard, never from g
            ok.ag_gemm_kernel[(5,)](TensorDescriptor.from_tensor(own, [T.bm, T.bk]),
                                    TensorDescriptor.from_tensor(g, [T.bm, T.bk]), ok.b_desc(w, layout, T),
                                    ok.c_desc(y, W, m, N, T), flags, err, rank, W, m, N, K, 32, 2, 100, 5, BM=T.bm,
                                    BN=T.bn, BK=T.bk, GROUP_M=T.group_m, B_NK=layout == "nk", FENCE=False)
            g[rank * m:(rank + 1) * m] = own
            e = (y.float() - ref(g, w, layout)).abs().max().item()
            assert e < 0.05 and err.item() == 0, ("all-gather GEMM", rank, layout, e, err.item())
    flags[1] = 0  # piece 1 of the first peer chunk to arrive (rank 1's rows, seen from rank 0) never comes
    ok.ag_gemm_kernel[(2,)](TensorDescriptor.from_tensor(g[:m].clone(), [T.bm, T.bk]),
                            TensorDescriptor.from_tensor(g, [T.bm, T.bk]), ok.b_desc(w, "kn", T),
                            ok.c_desc(y, W, m, N, T), flags, err,
                            0, W, m, N, K, 32, 2, 5, 2, BM=T.bm, BN=T.bn, BK=T.bk, GROUP_M=T.group_m, B_NK=False,
                            FENCE=False)
    assert err.item() == 2, ("missing piece: error word", err.item())

    for W in (2, 3):
        for dynamic in (True, False):
            for layout in ("nk", "kn"):
                m, K, N = 40, 48, 56
                A = [torch.randn(W * m, K, dtype=DT) for _ in range(W)]
                B = [weight(N, K, layout) for _ in range(W)]
                stage = W * m * N
                bufs = [torch.zeros(SYMM_HEADER + 2 * stage * 2, dtype=torch.uint8) for _ in range(W)]
                bases = torch.tensor([b.data_ptr() for b in bufs], dtype=torch.int64)
                per_chunk = -(-m // T.bm) * -(-N // T.bn)
                outs = [torch.full((m, N), float("nan"), dtype=DT) for _ in range(W)]

                def run(rank, expected):
                    cnt, err = torch.zeros(1, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
                    ok.gemm_rs_kernel[(3,)](
                        TensorDescriptor.from_tensor(A[rank], [T.bm, T.bk]), ok.b_desc(B[rank], layout, T),
                        out_desc(outs[rank]), stage_desc(bufs[rank], W, m, N), bases, cnt, err, rank, W, m, N, K, 1,
                        expected, 50, 3, BM=T.bm, BN=T.bn, BK=T.bk, GROUP_M=T.group_m, B_NK=layout == "nk",
                        HEADER_BYTES=SYMM_HEADER, DYNAMIC=dynamic, FENCE=False)
                    return err.item()

                for peer in range(1, W):
                    run(peer, 0)  # its own rows are wrong (rank 0 has not run), its tiles for rank 0 land
                assert run(0, per_chunk) == 0
                want = sum(ref(A[r], B[r], layout) for r in range(W))[:m]
                e = (outs[0].float() - want).abs().max().item()
                counters = bufs[0][:8 * W].view(torch.int64).tolist()
                assert e < 0.1 and counters == [0] + [per_chunk] * (W - 1), ("reduce-scatter", W, dynamic, layout, e,
                                                                            counters)
                assert 100 < run(0, 2 * per_chunk + 1) < 100 + W, "a peer's tiles that never come: error word"

    # The benchmark's diagnostic variant: the peers' tiles stored into this rank's own staging, no signal, no wait.
    # Alone (no peer ever runs) it finishes, leaves the peers' counters untouched and writes this rank's partial
    # plus whatever its other staging slots hold (zeros here).
    W, m, K, N = 2, 40, 48, 56
    A, B = torch.randn(W * m, K, dtype=DT), weight(N, K, "nk")
    stage = W * m * N
    bufs = [torch.zeros(SYMM_HEADER + 2 * stage * 2, dtype=torch.uint8) for _ in range(W)]
    bases = torch.tensor([b.data_ptr() for b in bufs], dtype=torch.int64)
    out = torch.full((m, N), float("nan"), dtype=DT)
    cnt, err = torch.zeros(1, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
    ok.gemm_rs_kernel[(3,)](TensorDescriptor.from_tensor(A, [T.bm, T.bk]), ok.b_desc(B, "nk", T), out_desc(out),
                            stage_desc(bufs[0], W, m, N), bases, cnt, err, 0, W, m, N, K, 0, 10**6, 50, 3, BM=T.bm,
                            BN=T.bn, BK=T.bk, GROUP_M=T.group_m, B_NK=True, HEADER_BYTES=SYMM_HEADER, DYNAMIC=True,
                            FENCE=False, LOCAL_STORES=True)
    e = (out.float() - ref(A, B, "nk")[:m]).abs().max().item()
    assert err.item() == 0 and e < 0.05 and not bufs[1].any(), ("local-stores diagnostic", err.item(), e)
    print("INTERPRETED KERNELS OK")


if __name__ == "__main__":
    main()

"""The FP8 transposes the delayed recipe's GEMMs need, as an op of their own with a tiled kernel on the GPU.

torch._scaled_mm takes its first operand row-major and its second column-major, so the weight gradient's GEMM
(contracting over tokens) needs the input and the output's gradient transposed, and the input gradient's GEMM the
weight transposed. Left to inductor, each transpose rides in the kernel that casts the tensor, a row reduction
that writes the transposed copy a byte at a time down a column; written as x.t().contiguous() on its own, inductor
does no better. Both move about 1.1-1.3 TB/s of the H200's 4.8 (bench/fp8_cast.py). This op is opaque to inductor
(the cast still fuses into its producer), and on CUDA runs one Triton kernel that reads and writes whole tiles. On
the H200 the 1.4b's step gained 1.1% with it; the kernel itself is faster than inductor's transpose at widths 5632
and 11264 but slower at 2048, where rows are powers of two apart (bench/RESULTS.md).
"""

from __future__ import annotations

import torch


@torch.library.custom_op("holotrain::fp8_transpose", mutates_args=())
def fp8_transpose(x: torch.Tensor) -> torch.Tensor:
    """x [M, N], one byte a value, as a row-major [N, M]."""
    if x.dim() != 2 or x.element_size() != 1:
        raise ValueError(f"fp8_transpose takes a 2-D tensor of one-byte values, not {x.dtype} {tuple(x.shape)}")
    if not x.is_cuda:
        return x.t().contiguous()
    from holotrain.precision.transpose_kernel import transpose_bytes

    out = torch.empty((x.shape[1], x.shape[0]), dtype=x.dtype, device=x.device)
    transpose_bytes(x.contiguous().view(torch.uint8), out.view(torch.uint8))
    return out


@fp8_transpose.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return x.new_empty((x.shape[1], x.shape[0]))

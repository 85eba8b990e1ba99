"""Dense bf16 peak FLOP/s per GPU model, for MFU. Unknown devices get None: report TFLOP/s, not a guess."""

from __future__ import annotations

import torch

# Vendor datasheet figures, dense (no sparsity), bf16 tensor cores. Matched as substrings of the device
# name, most specific first.
_PEAKS: list[tuple[str, float]] = [
    ("H200", 989e12),
    ("H100 PCIe", 756e12),
    ("H100 NVL", 835e12),
    ("H100", 989e12),
    ("H800", 989e12),
    ("GH200", 989e12),
    ("B200", 2250e12),
    ("A100", 312e12),
    ("A800", 312e12),
    ("L40S", 362e12),
    ("A10G", 70e12),
]


def peak_bf16_flops(device: torch.device | str | None = None) -> float | None:
    device = torch.device(device) if device is not None else None
    if device is None or device.type != "cuda" or not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name(device)
    for key, peak in _PEAKS:
        if key in name:
            return peak
    return None

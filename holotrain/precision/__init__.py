"""The precision lever: which linear layers run their matmuls in FP8 (training.fp8)."""

from holotrain.precision.lever import Precision, build

__all__ = ["Precision", "build"]

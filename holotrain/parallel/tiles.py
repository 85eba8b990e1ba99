"""The fused kernels' tile configuration (parallel.tp_tiles): the Tiles fields and their text form. No Triton here,
so the config can be validated on any machine."""

from __future__ import annotations

import re
from dataclasses import dataclass

from holotrain.errors import ConfigError


@dataclass(frozen=True)
class Tiles:
    bm: int = 128
    bn: int = 256
    bk: int = 64
    stages: int = 3
    warps: int = 8
    group_m: int = 8
    reserve_sms: int = 2  # left to the copy stream's small kernels while the all-gather GEMM runs
    dynamic: int = 1  # GEMM + reduce-scatter tiles handed out by an atomic counter (1) or round-robin (0)
    ws: int = 0  # Triton's automatic warp specialization of the K loop (experimental on Hopper)
    flat: int = 0  # all-gather GEMM: tile and K loops flattened into one pipeline
    epi: int = 1  # all-gather GEMM: the epilogue's TMA stores in 1 or 2 column pieces
    core: int = 0  # all-gather GEMM: 0 the Triton kernel (overlap_kernels.py), 1 the Gluon one (gluon_gemm.py)

    def __str__(self) -> str:
        return (f"{self.bm}x{self.bn}x{self.bk}-s{self.stages}-w{self.warps}-g{self.group_m}-r{self.reserve_sms}"
                f"-d{self.dynamic}-x{self.ws}-f{self.flat}-e{self.epi}-c{self.core}")


def parse_tiles(text: str):
    """'128x256x64-s3-w8-g8-r2' -> Tiles fields (dict); raises ConfigError naming parallel.tp_tiles."""
    m = re.fullmatch(r"(\d+)x(\d+)x(\d+)((?:-[swgrdxfec]\d+)*)", text.strip())
    if not m:
        raise ConfigError("parallel.tp_tiles: expected BMxBNxBK[-sSTAGES][-wWARPS][-gGROUP_M][-rRESERVED_SMS]"
                          f"[-d0|1][-x0|1][-f0|1][-e1|2][-c0|1], e.g. 128x256x64-s3-w8, got {text!r}")
    fields = {"bm": int(m[1]), "bn": int(m[2]), "bk": int(m[3])}
    names = {"s": "stages", "w": "warps", "g": "group_m", "r": "reserve_sms", "d": "dynamic", "x": "ws", "f": "flat",
             "e": "epi", "c": "core"}
    for part in filter(None, m[4].split("-")):
        fields[names[part[0]]] = int(part[1:])
    if fields.get("core", 0) == 1 and (fields["bm"] != 128 or fields.get("warps", 8) != 8 or fields["bn"] > 256
                                       or fields.get("stages", 3) < 2):
        raise ConfigError("parallel.tp_tiles: the warp-specialized core (-c1) needs BM = 128, BN <= 256, 8 warps and "
                          f"at least 2 stages, got {text!r}")
    if fields.get("core", 0) not in (0, 1):
        raise ConfigError(f"parallel.tp_tiles: -c (GEMM core) must be 0 or 1, got {fields['core']}")
    if fields.get("epi", 1) not in (1, 2):
        raise ConfigError(f"parallel.tp_tiles: -e (epilogue pieces) must be 1 or 2, got {fields['epi']}")
    for key in ("bm", "bn", "bk"):
        if fields[key] < 16 or fields[key] & (fields[key] - 1):
            raise ConfigError(f"parallel.tp_tiles: {key} must be a power of two >= 16, got {fields[key]}")
    return fields

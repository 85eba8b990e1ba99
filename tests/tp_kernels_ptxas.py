"""The fused TP kernels compiled ahead of time for Hopper (sm_90a) on this machine, no GPU needed: ptxas must
report no register spills and no serialized wgmma pipeline. Either costs the kernels 10-40% on the H200 (a
[BM, BN] tensor of 64-bit store offsets spills; a GEMM loop in each branch of one tile loop serializes the
wgmma). Run by tests/test_tp.py where Triton is installed; prints one line per kernel variant, then
"PTXAS CHECKS OK"."""

import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from holotrain.parallel import overlap_kernels as ok  # noqa: E402
from holotrain.parallel.symm import SYMM_HEADER  # noqa: E402
from holotrain.parallel.tiles import Tiles  # noqa: E402

PTXAS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")


def ptxas_report(fn, signature: dict, constexprs: dict, tiles: Tiles, tmp: Path, source=ASTSource,
                 options: dict | None = None) -> tuple[str, str]:
    """(ptxas -v output, PTX) of fn compiled for sm_90a."""
    kernel = triton.compile(source(fn=fn, signature=signature, constexprs=constexprs),
                            target=GPUTarget("cuda", 90, 32),
                            options=options or {"num_warps": tiles.warps, "num_stages": tiles.stages})
    ptx = tmp / f"{fn.__name__}.ptx"
    ptx.write_text(kernel.asm["ptx"])
    proc = subprocess.run([PTXAS, "-v", "--gpu-name=sm_90a", str(ptx), "-o", str(ptx.with_suffix(".cubin"))],
                          capture_output=True, text=True, check=True)
    return proc.stdout + proc.stderr, kernel.asm["ptx"]


def gluon_variant(tmp: Path) -> tuple[str, str]:
    """The warp-specialized Gluon all-gather GEMM (tiles 128x256x64, 3 stages): it must also hand registers from
    the producer warp to the consumers (setmaxnreg)."""
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource

    from holotrain.parallel import gluon_gemm as gg

    def desc(block):
        return f"tensordesc<bf16[{','.join(map(str, block))}],{gl.NVMMASharedLayout.get_default_for(block, gl.bfloat16)!r}>"

    t = Tiles(core=1)
    sig = {"own_desc": desc([t.bm, t.bk]), "a_desc": desc([t.bm, t.bk]), "b_desc": desc([t.bn, t.bk]),
           "c_desc": desc([1, t.bm, t.bn]), "flags_ptr": "*i32", "err_ptr": "*i32",
           **{k: "i32" for k in ("rank", "world", "m", "N", "K", "piece_rows", "splits", "spin_limit")}}
    consts = {"GROUP_M": t.group_m, "STAGES": t.stages, "B_NK": True, "FENCE": True, "num_warps": 8}
    sig.update({k: "constexpr" for k in consts})
    return ptxas_report(gg.ag_gemm_ws_kernel, sig, consts, Tiles(), tmp, GluonASTSource,
                        {"num_warps": 8, "maxnreg": gg.MAXNREG})


def check(what: str, report: str, failures: list) -> None:
    lines = [ln.strip() for ln in report.splitlines() if "spill" in ln or "registers" in ln or "serialized" in ln]
    print(f"{what}: " + " | ".join(lines))
    clean = "0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads"
    if any("serialized" in ln or ("spill" in ln and not ln.startswith(clean)) for ln in lines):
        failures.append(what)


def main():
    import tempfile

    bm, bn, bk = 128, 256, 64  # the tiles the H200 benchmark chose
    tiles = Tiles(bm=bm, bn=bn, bk=bk, stages=3, warps=8)
    a, b = f"tensordesc<bf16[{bm},{bk}]>", f"tensordesc<bf16[{bn},{bk}]>"
    scalars = {k: "i32" for k in ("rank", "world", "m", "N", "K")}
    common = {"BM": bm, "BN": bn, "BK": bk, "GROUP_M": tiles.group_m, "B_NK": True, "FENCE": True}
    ag = ({"own_desc": a, "a_desc": a, "b_desc": b, "c_desc": f"tensordesc<bf16[1,{bm},{bn}]>", "flags_ptr": "*i32",
           "err_ptr": "*i32", **scalars, "piece_rows": "i32", "splits": "i32", "spin_limit": "i32", "nprog": "i32"},
          common)
    rs = ({"a_desc": a, "b_desc": b, "out_desc": f"tensordesc<bf16[{bm},{bn}]>",
           "stage_desc": f"tensordesc<bf16[1,{bm},{bn}]>", "bases_ptr": "*i64", "counter_ptr": "*i32",
           "err_ptr": "*i32", **scalars, "parity": "i32", "expected": "i64", "spin_limit": "i32", "nprog": "i32"},
          {**common, "HEADER_BYTES": SYMM_HEADER, "DYNAMIC": True})
    failures = []
    with tempfile.TemporaryDirectory() as tmp:
        four_stages = Tiles(bm=bm, bn=bn, bk=bk, stages=4, warps=8)
        variants = [(ok.ag_gemm_kernel, ag, {"WS": ws}, tiles) for ws in (False, True)]
        variants += [(ok.ag_gemm_kernel, ag, {"WS": False, "FLAT": True, "EPI": epi}, t)
                     for epi, t in ((1, tiles), (2, four_stages))]
        variants += [(ok.gemm_rs_kernel, rs, {"WS": ws}, tiles) for ws in (False, True)]
        for fn, (sig, consts), extra, t in variants:
            c = {**consts, **extra}
            sig_c = {**sig, **{k: "constexpr" for k in c}}
            if extra.get("EPI") == 2:
                sig_c["c_desc"] = f"tensordesc<bf16[1,{bm},{bn // 2}]>"
            report, _ = ptxas_report(fn, sig_c, c, t, Path(tmp))
            check(f"{fn.__name__} {extra} stages {t.stages}", report, failures)
        report, ptx = gluon_variant(Path(tmp))
        check("ag_gemm_ws_kernel (Gluon)", report, failures)
        if "setmaxnreg" not in ptx:
            failures.append("ag_gemm_ws_kernel: no setmaxnreg (the producer keeps its registers)")
    if failures:
        raise SystemExit("register spills or serialized wgmma in: " + ", ".join(failures))
    print("PTXAS CHECKS OK")


if __name__ == "__main__":
    main()

"""GPU time per step of a torch.profiler chrome trace, by kernel family (GEMM, attention, optimizer, ...; inductor's
kernels also by their part in FP8 scaling), and its longest kernels. Usage: python bench/trace_families.py TRACE.json[.gz] [--steps N] [--top K]"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import re

FAMILIES = [  # first match wins
    ("attention (flex)", r"flex_attention|triton_tem_fused_flex|_flex_"),
    ("attention (sdpa)", r"flash|fmha|cudnn.*attn|sdpa|attention"),
    # Inductor's own kernels before the GEMMs: their names list the ops they fused (an FP8 cast names _scaled_mm,
    # a cast of any kind _to_copy), which says nothing of what they run.
    ("inductor fused", r"^triton_"),
    ("gemm fp8", r"e4m3|e5m2|fp8|f8f8|nvjet_sm90_q"),  # cuBLAS's nvjet kernels name FP8 operands q/r
    ("gemm", r"gemm|nvjet|sm90_xmma|cutlass|ampere_|sm80_|wgmma"),
    ("optimizer", r"adam|multi_tensor|foreach|norm_kernel.*grad|clip"),
    ("copies", r"memcpy|memset|copy_kernel|CatArrayBatched|elementwise_kernel.*copy"),
]


def fp8_role(name: str) -> str:
    """What an inductor kernel does for FP8, by the ops its name lists: a maximum (abs, max), a cast (the saturating
    clamp), both, or neither (norms, rotary, SwiGLU, the loss, adds)."""
    amax, cast = "abs" in name and "max" in name, "clamp" in name
    if amax and cast:
        return "maximum and cast"
    if amax or cast:
        return "maximum" if amax else "cast"
    return "no FP8 scaling"


def load(path: str) -> dict:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("trace")
    p.add_argument("--steps", type=int, default=2, help="steps the trace covers")
    p.add_argument("--top", type=int, default=25)
    a = p.parse_args()
    kernels = [e for e in load(a.trace).get("traceEvents", []) if e.get("cat") == "kernel" and "dur" in e]
    by_family, by_name, by_role, role_count = (collections.Counter() for _ in range(4))
    for e in kernels:
        name = e["name"]
        fam = next((f for f, rx in FAMILIES if re.search(rx, name, re.I)), "other")
        by_family[fam] += e["dur"]
        by_name[name[:110]] += e["dur"]
        if fam == "inductor fused":
            by_role[fp8_role(name)] += e["dur"]
            role_count[fp8_role(name)] += 1
    total = sum(by_family.values())
    span = (max(e["ts"] + e["dur"] for e in kernels) - min(e["ts"] for e in kernels)) if kernels else 0
    print(f"{a.trace}: {len(kernels)} kernels, busy {total / a.steps / 1e3:.1f} ms/step of a "
          f"{span / a.steps / 1e3:.1f} ms/step span")
    for fam, us in by_family.most_common():
        print(f"  {fam:18} {us / a.steps / 1e3:8.2f} ms/step  {us / total:6.1%}")
        if fam == "inductor fused":
            for role, r_us in by_role.most_common():
                print(f"    of which {role:18} {r_us / a.steps / 1e3:8.2f} ms/step  ({role_count[role] // a.steps} "
                      "kernels a step)")
    for name, us in by_name.most_common(a.top):
        print(f"    {us / a.steps / 1e3:7.2f} ms  {name}")


if __name__ == "__main__":
    main()

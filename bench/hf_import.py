"""Starting from a Hugging Face model: a local model directory made with transformers (random weights, bf16
safetensors in 5 GB shards, the tokenizer holotrain trains for the shipped configs), and the time and host memory of
importing it into the placed model, against building the same model from a seed.

  python3 bench/hf_import.py make --preset 1.4b --out DIR     # config.json, model-*.safetensors, tokenizer.json
  python3 bench/hf_import.py time --dir DIR [--json FILE]     # build_model with model.init_from=DIR, and seeded

`time` runs each build in a fresh process (the host memory peak is the process's own) on the first CUDA device,
else the CPU. The pages of a file just written are in the page cache: the read is from memory, not the disk.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MAX_SEQ = 2048


def make(preset: str, out: Path) -> None:
    import torch
    import transformers

    from holotrain.data.corpus import cache_dir, prepare_tokenizer, stdlib_sources
    from holotrain.model.families.llama import PRESETS

    a = PRESETS[preset]
    config = transformers.LlamaConfig(
        hidden_size=a.dim, intermediate_size=a.ffn_dim, num_hidden_layers=a.n_layers, num_attention_heads=a.n_heads,
        num_key_value_heads=a.n_kv_heads, vocab_size=a.vocab_size, max_position_embeddings=MAX_SEQ,
        rms_norm_eps=a.norm_eps, rope_theta=a.rope_theta, tie_word_embeddings=False)
    t0 = time.perf_counter()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(device):
        model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, max_shard_size="5GB")
    del model
    # The tokenizer the shipped 1.4b / 7b configs train on the embedded corpus (data.vocab_size = 32000).
    root = cache_dir("")
    _, tok_path = prepare_tokenizer(stdlib_sources(root), "", 32000, 8.0, root)
    (out / "tokenizer.json").write_bytes(tok_path.read_bytes())
    (out / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>", "pad_token": "<|pad|>"}))
    size = sum(p.stat().st_size for p in out.glob("*.safetensors"))
    print(f"made {out}: {preset} shape, {size / 1e9:.2f} GB of safetensors in {time.perf_counter() - t0:.1f} s")


def build_once(directory: str, pretrained: bool) -> dict:
    """One build in this process: the model placed on the device with model.init_from's weights, or seeded."""
    import resource

    import torch

    from holotrain.config import load_config, resolve
    from holotrain.parallel import DistEnv
    from holotrain.train.trainer import build_model

    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    seq_len = json.loads((Path(directory) / "config.json").read_text())["max_position_embeddings"]
    overrides = [f"--model.init_from={directory}", f"--data.seq_len={seq_len}", "--memory.check_fit=false"]
    cfg = resolve(load_config(None, overrides))
    env = DistEnv(rank=0, world_size=1, local_rank=0, device=device)
    t0 = time.perf_counter()
    model = build_model(cfg, env, torch.bfloat16, pretrained=pretrained)
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    params = sum(p.numel() for p in model.parameters())
    return {"pretrained": pretrained, "build_s": seconds, "params": params,
            "peak_host_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9,
            "first_weight": float(model.layers["0"].attention.wq.weight.flatten()[0])}


def time_import(directory: Path, out: Path | None) -> None:
    rows = []
    for pretrained in (True, False):
        proc = subprocess.run([sys.executable, __file__, "_build", "--dir", str(directory)]
                              + (["--pretrained"] if pretrained else []), capture_output=True, text=True)
        if proc.returncode:
            sys.exit(f"build failed:\n{proc.stdout}\n{proc.stderr[-4000:]}")
        print(proc.stdout.strip().splitlines()[0] if pretrained else "", end="\n" if pretrained else "")
        rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    size = sum(p.stat().st_size for p in directory.glob("*.safetensors"))
    for r in rows:
        print(f"{'init_from' if r['pretrained'] else 'seeded   '}: {r['params'] / 1e9:.2f} G params placed in "
              f"{r['build_s']:.1f} s, peak host memory {r['peak_host_gb']:.1f} GB")
    print(f"checkpoint {size / 1e9:.2f} GB read at {size / rows[0]['build_s'] / 1e9:.2f} GB/s (whole build)")
    if out:
        out.write_text(json.dumps({"dir": str(directory), "safetensors_bytes": size, "rows": rows}, indent=2))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("what", choices=["make", "time", "_build"])
    p.add_argument("--preset", default="1.4b")
    p.add_argument("--out", type=Path)
    p.add_argument("--dir", type=Path)
    p.add_argument("--json", type=Path)
    p.add_argument("--pretrained", action="store_true")
    a = p.parse_args()
    if a.what == "make":
        make(a.preset, a.out)
    elif a.what == "time":
        time_import(a.dir, a.json)
    else:
        print(json.dumps(build_once(str(a.dir), a.pretrained)))


if __name__ == "__main__":
    main()

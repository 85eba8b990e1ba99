"""Generation speed at batch 1: `holotrain generate`'s decoder (holotrain/generate.py, KV cache) on a run's newest
checkpoint against transformers' generate() on the same weights exported with `holotrain export`, greedy, the same
prompt, NEW tokens each (the stop token ignored on both sides so that both produce all of them). Each side is warmed
up once, then timed REPEAT times with the device synchronized; the median is reported, and how many of the first
tokens the two sides agree on (bf16: they may part after a near tie).
Usage (on the GPU machine): python bench/generate_speed.py RUN_DIR HF_DIR [--new 256] [--repeat 3] [--static]"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def timed(fn, repeat: int) -> tuple[float, list[int]]:
    fn()
    seconds, out = [], None
    for _ in range(repeat):
        sync()
        t0 = time.perf_counter()
        out = fn()
        sync()
        seconds.append(time.perf_counter() - t0)
    return statistics.median(seconds), out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("run_dir")
    p.add_argument("hf_dir")
    p.add_argument("--new", type=int, default=256)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--prompt", default="def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n")
    p.add_argument("--static", action="store_true", help="also transformers with a static cache under "
                   "torch.compile (its documented fast path)")
    a = p.parse_args()

    from transformers import AutoModelForCausalLM

    from holotrain.generate import Sampling, load

    gen = load(a.run_dir, device=DEVICE)
    gen.stop_ids = []  # all NEW tokens, as on the transformers side
    ids = gen.encode(a.prompt)
    sampling = Sampling(max_new_tokens=a.new)
    s, ours = timed(lambda: gen.continue_ids(ids, sampling), a.repeat)
    print(f"holotrain generate: {len(ours)} tokens after a {len(ids)}-token prompt in {s:.3f} s: "
          f"{len(ours) / s:,.1f} tokens/s")
    del gen

    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32
    hf = AutoModelForCausalLM.from_pretrained(a.hf_dir, dtype=dtype).to(DEVICE).eval()
    prompt = torch.tensor([ids], device=DEVICE)
    kw = dict(max_new_tokens=a.new, min_new_tokens=a.new, do_sample=False, pad_token_id=0)

    def hf_run(**extra):
        with torch.no_grad():
            return hf.generate(prompt, **kw, **extra)[0, len(ids):].tolist()

    s_hf, theirs = timed(hf_run, a.repeat)
    same = next((i for i, (x, y) in enumerate(zip(ours, theirs)) if x != y), min(len(ours), len(theirs)))
    print(f"transformers generate() (dynamic cache, eager): {len(theirs)} tokens in {s_hf:.3f} s: "
          f"{len(theirs) / s_hf:,.1f} tokens/s; holotrain / transformers: {s_hf / s:.2f}x; the first {same} tokens "
          "agree")
    if a.static:
        hf.forward = torch.compile(hf.forward, mode="reduce-overhead", fullgraph=True)
        t0 = time.perf_counter()
        hf_run(cache_implementation="static")
        print(f"transformers static cache + torch.compile: first call (compile) {time.perf_counter() - t0:.1f} s")
        s_st, _ = timed(lambda: hf_run(cache_implementation="static"), a.repeat)
        print(f"transformers generate() (static cache, compiled): {a.new / s_st:,.1f} tokens/s; holotrain / it: "
              f"{s_st / s:.2f}x")


if __name__ == "__main__":
    main()

"""What the model says at each eval: a few fixed prompts continued greedily, logged as `eval.samples` (metrics.jsonl,
TensorBoard's text tab, report.html).

The prompts are `eval.prompts`, or else the opening tokens of the first evaluation document of each source (text the
model never trained on). Prompts of one length are continued together with a KV cache (model/decoder.py `decode`,
holotrain generate's path): one forward of the prompts, then one of a token a row per new token. The batch holds a
multiple of 16 rows (the prompts, the last repeated), which FP8's GEMMs need of a decode step's single tokens, and the
drawn tokens stay on the device until the end (no synchronization per token). The forwards run eagerly
(torch.compile's stance), so no region compiles a graph for these shapes, and without gradients; on one GPU each
token's step after the first replays a CUDA graph of it (model/kvcache.py), captured at each eval inside its autocast
region (whose cached bf16 casts of the weights the graph reads). Under FSDP2 every
rank runs the same forwards and draws the same tokens; under tensor, context or pipeline parallelism no samples are
drawn.
"""

from __future__ import annotations

import time

import torch

PROMPT_TOKENS = 16  # the opening of an evaluation document, as the default prompt
ALIGN = 16


class Samples:
    def __init__(self, prompts: list[tuple[str, list[int]]], tokenizer, tokens: int, device: torch.device,
                 autocast: bool):
        self.prompts = prompts  # (label, token ids)
        self.tokenizer, self.tokens, self.device, self.autocast = tokenizer, tokens, device, autocast
        self.said_fallback = False

    def __call__(self, model: torch.nn.Module) -> dict:
        """eval.samples: [{"prompt", "text"}] per prompt, and time.eval_samples."""
        t0 = time.perf_counter()
        by_length: dict[int, list[int]] = {}
        for k, (_, ids) in enumerate(self.prompts):
            by_length.setdefault(len(ids), []).append(k)
        texts = [""] * len(self.prompts)
        with torch.no_grad(), torch.compiler.set_stance("force_eager"):
            for group in by_length.values():
                drawn = self._continue(model, [self.prompts[k][1] for k in group])
                for k, ids in zip(group, drawn):
                    texts[k] = self.tokenizer.decode(ids)
        out = [{"prompt": label, "text": text} for (label, _), text in zip(self.prompts, texts)]
        return {"eval.samples": out, "time.eval_samples": time.perf_counter() - t0}

    def _continue(self, model: torch.nn.Module, prompts: list[list[int]]) -> list[list[int]]:
        """Each prompt (all of one length) continued greedily by up to `tokens` tokens, within the model's context."""
        from holotrain.model.kvcache import KVCache, TokenSteps, graphable

        n = len(prompts[0])
        new = min(self.tokens, model.args.max_seq_len - n)
        rows = -(-len(prompts) // ALIGN) * ALIGN
        batch = torch.tensor([prompts[min(i, len(prompts) - 1)] for i in range(rows)], device=self.device)
        dtype = torch.bfloat16 if self.autocast else next(model.parameters()).dtype
        cache = KVCache(model.args, batch=rows, length=n + new, device=self.device, dtype=dtype)
        drawn = []
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast):
            logits = model.decode(batch, cache)
            steps = TokenSteps(model, cache, graph=graphable(model))
            for _ in range(new):
                if hasattr(logits, "full_tensor"):  # a DTensor head
                    logits = logits.full_tensor()
                drawn.append(logits[:, -1].float().argmax(-1))
                if len(drawn) < new:
                    logits = steps.step(drawn[-1][:, None])
        if steps.fallback and not self.said_fallback:
            self.said_fallback = True
            print(f"holotrain: eval samples: {steps.fallback}", flush=True)
        if not drawn:
            return [[] for _ in prompts]
        return torch.stack(drawn, dim=1)[:len(prompts)].tolist()



def build(cfg, dims, rows: dict, tokenizer, device: torch.device, autocast: bool, is_main: bool) -> Samples | None:
    """The job's samples (None with eval.sample_tokens = 0, or under tensor, context or pipeline parallelism)."""
    if not cfg.eval.sample_tokens:
        return None
    if dims.tp > 1 or dims.cp > 1 or dims.pp > 1:
        if is_main:
            print("holotrain: eval: no samples drawn under parallel.tp, cp or pp > 1 (each rank holds part of a "
                  "sequence or of the model)", flush=True)
        return None
    if cfg.eval.prompts:
        prompts = [(text, tokenizer.encode(text).ids) for text in cfg.eval.prompts]
    else:
        prompts = []
        for eval_rows in rows.values():
            ids = [int(t) for t in eval_rows.inputs[0, :PROMPT_TOKENS]]
            prompts.append((tokenizer.decode(ids), ids))
    prompts = [(label, ids) for label, ids in prompts if 0 < len(ids) < cfg.data.seq_len]
    return Samples(prompts, tokenizer, cfg.eval.sample_tokens, device, autocast) if prompts else None

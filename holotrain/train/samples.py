"""What the model says at each eval: a few fixed prompts continued greedily, logged as `eval.samples` (metrics.jsonl,
TensorBoard's text tab, report.html).

The prompts are `eval.prompts`, or else the opening tokens of the first evaluation document of each source (text the
model never trained on). Each continuation of `eval.sample_tokens` tokens runs the model's ordinary forward on one row
of a fixed length (the prompt and its continuation, right-padded to a multiple of 16, which FP8's GEMMs need): causal
attention makes the padding invisible to the positions read. The forwards run eagerly (torch.compile's stance), so
no region compiles a graph for this shape, and without gradients. Under FSDP2 every rank runs the same forwards and
draws the same tokens; under tensor, context or pipeline parallelism no samples are drawn.
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

    def __call__(self, model: torch.nn.Module) -> dict:
        """eval.samples: [{"prompt", "text"}] per prompt, and time.eval_samples."""
        t0 = time.perf_counter()
        out = []
        with torch.no_grad(), torch.compiler.set_stance("force_eager"):
            for label, ids in self.prompts:
                out.append({"prompt": label, "text": self.tokenizer.decode(self._continue(model, ids))})
        return {"eval.samples": out, "time.eval_samples": time.perf_counter() - t0}

    def _continue(self, model: torch.nn.Module, ids: list[int]) -> list[int]:
        limit = model.args.max_seq_len
        new = min(self.tokens, limit - len(ids))
        length = min(-(-(len(ids) + new) // ALIGN) * ALIGN, limit)
        row = torch.zeros((1, length), dtype=torch.int64, device=self.device)
        row[0, :len(ids)] = torch.tensor(ids, device=self.device)
        drawn = []
        for at in range(len(ids), len(ids) + new):
            with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast):
                logits = model(row)
            if hasattr(logits, "full_tensor"):  # a DTensor head
                logits = logits.full_tensor()
            token = int(logits[0, at - 1].float().argmax())
            row[0, at] = token
            drawn.append(token)
        return drawn


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

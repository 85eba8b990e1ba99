"""Validation: the held-out documents of each training source (data/split.py: never served to training), or separate
`[[eval.sources]]`, packed once into rows of data.seq_len + 1 tokens, and the model's loss over their target tokens
(a chat source's assistant tokens only), per source and overall, every `eval.every` steps and at the end of the run.

Every rank builds the same rows (a pure function of the files, the tokenizer and the carve-out); each data-parallel
replica takes its share, padded with rows that have no targets so that every rank runs the same forwards (FSDP2 and
the tensor- and context-parallel collectives need that). The loss is summed over target tokens and divided once, so
sources and ranks with different numbers of targets weigh by their tokens.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from holotrain.data.chat import reader_for
from holotrain.data.packing import Bin, Piece, sample_arrays
from holotrain.data.sources import plan_chunks, source_files
from holotrain.data.split import Split
from holotrain.data.worker import tokenize_chunk
from holotrain.train.samples import build as build_samples

CHUNK_BYTES = 1 << 20


@dataclass
class EvalRows:
    inputs: torch.Tensor  # [R, T] int64
    targets: torch.Tensor  # [R, T] int64, -100 where nothing is predicted
    doc_ids: torch.Tensor  # [R, T] int64

    @property
    def target_tokens(self) -> int:
        return int((self.targets != -100).sum())


def build_rows(sources: list, share: float, held: bool, tokenizer_path: str | Path, chat_template: str,
               eos_id: int, pad_id: int, seq_len: int, rows: int) -> dict[str, EvalRows]:
    """Per source, up to `rows` packed rows of its evaluation documents: the held-out share of a training source
    (`held`, with `share`) or every document of an eval source (held False, share 0), read in file order."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tokenizer_path))
    out = {}
    for index, src in enumerate(sources):
        files = source_files(src)
        chat = reader_for(src, chat_template, tokenizer_path)
        split = Split(src.name, share, held) if held else None
        bins = [Bin()]
        length = seq_len + 1
        for chunk in plan_chunks(index, files, CHUNK_BYTES, src.document, src.path_field):
            part = tokenize_chunk(chunk, files, src.text_field, tokenizer, eos_id, chat, split)
            for d in range(len(part.keys)):
                start, stop = int(part.starts[d]), int(part.starts[d + 1])
                while start < stop and len(bins) <= rows:
                    take = min(stop - start, length - bins[-1].used)
                    mask = None if part.mask is None else part.mask[start:start + take]
                    bins[-1].pieces.append(Piece(part.tokens[start:start + take], tuple(part.keys[d]), mask))
                    bins[-1].used += take
                    start += take
                    if bins[-1].used == length:
                        bins.append(Bin())
            if len(bins) > rows:
                break
        bins = [b for b in bins[:rows] if b.pieces]
        if bins:
            inputs, targets, docs = sample_arrays(bins, length, pad_id)
            out[src.name] = EvalRows(*(torch.from_numpy(np.ascontiguousarray(a)) for a in (inputs, targets, docs)))
    return out


def allot(available: dict[str, int], weights: dict[str, float], total: int) -> dict[str, int]:
    """How many of `total` rows each source gets: shares by weight, a source that holds fewer than its share giving
    what it lacks to the others (by their weights), so that the eval scores `total` rows where the sources hold
    them."""
    given = {name: 0 for name in available}
    open_ = [name for name in available if available[name] > 0]
    left = min(total, sum(available.values()))
    while left > 0 and open_:
        weight = sum(weights[n] for n in open_) or len(open_)
        shares = {n: (weights[n] or 1.0) * left / weight for n in open_}
        step = 0
        for n in open_:
            take = min(available[n] - given[n], max(1, int(shares[n])), left - step)
            given[n] += take
            step += take
        left -= step
        open_ = [n for n in open_ if given[n] < available[n]]
    return given


class Evaluator:
    """The validation set of a job and the loop that scores the model on it."""

    def __init__(self, rows: dict[str, EvalRows], dims, rank: int, micro: int, device: torch.device,
                 autocast: bool, samples=None):
        self.rows, self.dims, self.rank, self.micro = rows, dims, rank, micro
        self.device, self.autocast = device, autocast
        self.samples = samples  # train/samples.py: prompts continued at each eval, or None
        # One rank of each tensor- and context-parallel group adds up, on the first pipeline stage's ranks (every
        # stage ends with the same losses).
        self.leader = rank % dims.batch_group == 0 and dims.pp_index(rank) == 0

    @property
    def empty(self) -> bool:
        return not self.rows

    def _share(self, rows: EvalRows, group: int = 1):
        """This replica's rows in micro-batches, padded with target-less rows to the same count on every replica
        (and to a multiple of `group` micro-batches)."""
        dp, d = self.dims.dp, self.dims.dp_index(self.rank)
        per = math.ceil(rows.inputs.shape[0] / dp)
        per = math.ceil(per / (self.micro * group)) * self.micro * group
        mine = [t[d::dp] for t in (rows.inputs, rows.targets, rows.doc_ids)]
        missing = per - mine[0].shape[0]
        if missing:
            pad = [torch.zeros((missing, rows.inputs.shape[1]), dtype=torch.int64)] * 3
            pad[1] = torch.full_like(pad[1], -100)
            mine = [torch.cat([m, p]) for m, p in zip(mine, pad)]
        for i in range(0, per, self.micro):
            yield [t[i:i + self.micro].to(self.device, non_blocking=True) for t in mine]

    def __call__(self, model: torch.nn.Module) -> dict:
        """eval.loss and eval.ppl over every source's target tokens, the same per source (eval.<name>.loss,
        eval.<name>.ppl), eval.tokens and time.eval; the same on every rank."""
        # The forwards run in grad mode, as training's do: compiled regions are guarded on it, and under no_grad the
        # first eval would compile a second graph of each (8-10 s for the 1.4b). Each loss is detached at once, so
        # its activations are freed before the next forward. Not under activation offload, whose hooks would copy
        # the saved tensors out for a backward that never comes (one more graph is compiled then).
        t0 = time.perf_counter()
        runner = model.hooks.run_blocks
        with torch.set_grad_enabled(runner is None or not runner.saves_to_host):
            row = self._score(model)
        if self.samples is not None:
            row.update(self.samples(model))
        row["time.eval"] = time.perf_counter() - t0
        return row

    def _score(self, model: torch.nn.Module) -> dict:
        totals = torch.zeros(len(self.rows), 2, dtype=torch.float64, device=self.device)  # (loss sum, targets)
        if hasattr(model, "pipeline"):
            return self._score_pipelined(model, totals)
        sequence = model.hooks.sequence
        for s, rows in enumerate(self.rows.values()):
            for inputs, targets, doc_ids in self._share(rows):
                with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast):
                    loss = model(inputs, targets, doc_ids).detach().float()
                if sequence is not None:  # each rank's weighted share of the sequence's mean: their mean is it
                    dist.all_reduce(loss, op=dist.ReduceOp.AVG, group=sequence.group)
                count = (targets != -100).sum()
                if self.leader:
                    totals[s, 0] += loss.double() * count
                    totals[s, 1] += count
        return self._rows(totals)

    def _score_pipelined(self, model: torch.nn.Module, totals: torch.Tensor) -> dict:
        """Under pipeline parallelism: the schedule's micro-batch count at a time, forward only."""
        n = model.pipeline.n_microbatches
        for s, rows in enumerate(self.rows.values()):
            batches = list(self._share(rows, group=n))
            for i in range(0, len(batches), n):
                group = batches[i:i + n]
                losses = model.evaluate(group)
                counts = torch.stack([(targets != -100).sum() for _, targets, _ in group]).to(losses.device)
                if self.leader:
                    totals[s, 0] += (losses.double() * counts).sum()
                    totals[s, 1] += counts.sum()
        return self._rows(totals)

    def _rows(self, totals: torch.Tensor) -> dict:
        if self.dims.world > 1:
            dist.all_reduce(totals)
        totals = totals.cpu()
        row = {}
        for (name, _), (total, count) in zip(self.rows.items(), totals.tolist()):
            if count:
                row[f"eval.{name}.loss"] = total / count
                row[f"eval.{name}.ppl"] = math.exp(min(total / count, 50.0))
        total, count = totals.sum(0).tolist()
        row["eval.loss"] = total / count if count else None
        row["eval.ppl"] = math.exp(min(total / count, 50.0)) if count else None
        row["eval.tokens"] = int(count)
        return row


def build(cfg, env, dims, micro: int, dtype: torch.dtype, run_dir: Path) -> Evaluator | None:
    """The job's evaluator (None with eval.every = 0, or without a document to score)."""
    from tokenizers import Tokenizer

    from holotrain.data.chat import template_for
    from holotrain.data.corpus import special_ids

    if not cfg.eval.every:
        return None
    tokenizer_path = Path(run_dir) / "tokenizer.json"
    eos_id, pad_id = special_ids(Tokenizer.from_file(str(tokenizer_path)), tokenizer_path)
    sources = cfg.eval.sources or cfg.data.sources
    template = template_for(sources, cfg.data.chat_template, tokenizer_path)
    total = cfg.eval.batches * cfg.training.batch_size
    rows = build_rows(sources, cfg.eval.holdout, not cfg.eval.sources, tokenizer_path, template, eos_id, pad_id,
                      cfg.data.seq_len, total)
    counts = allot({n: r.inputs.shape[0] for n, r in rows.items()}, {s.name: s.weight for s in sources}, total)
    rows = {n: EvalRows(*(t[:counts[n]] for t in (r.inputs, r.targets, r.doc_ids))) for n, r in rows.items()
            if counts[n]}
    if not rows:
        if env.is_main:
            print(f"holotrain: warning: eval: no document to evaluate on (eval.holdout = {cfg.eval.holdout:g} of "
                  "the sources held none out); set eval.sources or a larger eval.holdout", flush=True)
        return None
    autocast = dtype == torch.bfloat16 and env.world_size == 1
    samples = build_samples(cfg, dims, rows, Tokenizer.from_file(str(tokenizer_path)), env.device, autocast,
                            env.is_main)
    evaluator = Evaluator(rows, dims, env.rank, micro, env.device, autocast, samples)
    if env.is_main:
        what = ", ".join(f"{name} {r.target_tokens:,}" for name, r in rows.items())
        print(f"holotrain: eval every {cfg.eval.every} steps on the target tokens of "
              f"{'eval.sources' if cfg.eval.sources else f'the held-out {cfg.eval.holdout:g} of each source'}: "
              f"{what}", flush=True)
    return evaluator

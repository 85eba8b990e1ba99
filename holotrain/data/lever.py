"""The data plane as the trainer sees it: built from the `data` section and the job's batch layout, it starts this
node's plane (local rank 0), connects this rank, hands out each step's micro-batches, and reports `data.*`."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from holotrain.data.chat import template_for
from holotrain.data.client import DataClient, plane_address, start_plane
from holotrain.data.corpus import special_ids
from holotrain.data.monitor import SkipMonitor
from holotrain.data.plane import PlaneSpec
from holotrain.data.shm import shm_prefix
from holotrain.jsonl import truncate_jsonl

if TYPE_CHECKING:
    from holotrain.data.config import DataConfig
    from holotrain.parallel import DistEnv
    from holotrain.parallel.dims import ParallelDims

STAT_FIELDS = ("tokens_by_source", "skipped", "skip_examples", "padding", "cost_max_over_mean", "workers",
               "worker_restarts")


@dataclass(frozen=True)
class Layout:
    """How the global batch splits: what the data plane needs from the training and parallel sections."""

    global_batch: int  # sequences per optimizer step, all ranks
    micro: int  # sequences per rank per forward
    accum: int  # micro-batches per step
    seed: int
    dims: ParallelDims  # which ranks read the same rows (parallel/dims.py)
    holdout: float = 0.0  # each source's share held out for validation (data/split.py): never served


class Data:
    """This rank's view of the node's data plane."""

    def __init__(self, section: DataConfig, env: DistEnv, run_dir: Path, tokenizer, layout: Layout,
                 state: dict | None, start_step: int):
        self.env = env
        self.skips = SkipMonitor(section.max_skip_fraction, env.is_main)
        node_first = env.rank - env.local_rank
        tokenizer_path = Path(run_dir) / "tokenizer.json"
        eos_id, pad_id = special_ids(tokenizer, tokenizer_path)
        spec = PlaneSpec(
            sources=section.sources, tokenizer_path=str(tokenizer_path),
            eos_id=eos_id, pad_id=pad_id, seq_len=section.seq_len,
            global_batch=layout.global_batch, world_size=env.world_size,
            local_ranks=list(range(node_first, node_first + env.local_world_size)), micro_batch=layout.micro,
            dims=layout.dims, holdout=layout.holdout, accum=layout.accum, seed=layout.seed, max_workers=section.workers,
            chunk_bytes=int(section.chunk_mb * 2**20), prefetch_steps=section.prefetch_steps,
            balance=section.balance, balance_window=section.balance_window, shuffle=section.shuffle,
            log_samples=section.log_samples,
            backend=section.backend, ray_address=section.ray_address, shm_prefix=shm_prefix(run_dir),
            # Resolved here, before any loader starts, so that a missing or broken template is one error line.
            chat_template=template_for(section.sources, section.chat_template, tokenizer_path),
        )
        address, key = plane_address(run_dir)
        owner = env.local_rank == 0  # starts this node's plane, and restarts it if it dies
        plane = start_plane(spec, state, address, key) if owner else None
        restart = (lambda plane_state: start_plane(spec, plane_state, address, key)) if owner else None
        try:
            self.client = DataClient(address, key, env.rank, start_step, env.device, plane=plane, restart=restart,
                                     plane_state=state)
        except BaseException:  # e.g. a signal while connecting
            if plane is not None:
                plane.stop()
            raise
        self._samples_log = None
        if env.is_main and section.log_samples:
            truncate_jsonl(Path(run_dir) / "samples.jsonl", start_step)
            self._samples_log = open(Path(run_dir) / "samples.jsonl", "a")

    def next(self, step: int):
        """The micro-batches of step `step` (1-based, the step they train) and the seconds spent waiting for them."""
        batches, waited = self.client.next()
        if self._samples_log is not None:
            self._samples_log.write(json.dumps({"step": step, "samples": self.client.samples}) + "\n")
            self._samples_log.flush()
        return batches, waited

    def state(self, steps_done: int) -> dict | None:
        """The plane's state after `steps_done` steps, for a checkpoint (main rank only)."""
        return self.client.state(steps_done) if self.env.is_main else None

    def metrics(self, steps: int) -> dict:
        """The data.* fields of the metrics row. Warns (main rank) of records skipped since the last call, and raises
        ConfigError, on every rank alike, when a source skips more than data.max_skip_fraction (monitor.py)."""
        stats = self.client.stats
        c = self.client
        sources = stats.get("sources", {})
        self.skips.check(sources)
        # Share of the micro-batches handed out so far that held a document boundary (and took the masked attention).
        masked = c.masked_micro_batches / c.micro_batches if c.micro_batches else None
        return {**{f"data.{k}": stats.get(k) for k in STAT_FIELDS}, "data.plane_restarts": c.restarts,
                "data.doc_masked_share": masked,
                "data.records_by_source": {name: s["records"] for name, s in sources.items()},
                "data.skipped_by_source": {name: s["skipped"] for name, s in sources.items()}}

    def close(self) -> None:
        if self._samples_log is not None:
            self._samples_log.close()
            self._samples_log = None
        self.client.close(stop_plane=self.env.local_rank == 0)


def build(section: DataConfig, env: DistEnv, run_dir: Path, tokenizer, layout: Layout, state: dict | None,
          start_step: int) -> Data:
    return Data(section, env, run_dir, tokenizer, layout, state, start_step)

"""Deterministic, resumable batches of fixed-length windows over a flat token array.

Sample order is a seeded permutation per epoch, so the whole data position is one integer: the number
of samples consumed. Each optimizer step takes `batch_size` consecutive samples of that order; rank r
of W reads micro-batch m as samples [m*W*b + r*b, m*W*b + (r+1)*b) of the step, so the global batch is
the same whatever the world size.
"""

from __future__ import annotations

import numpy as np
import torch

from holotrain.config import ConfigError


class TokenBatches:
    def __init__(self, tokens: np.ndarray, seq_len: int, seed: int, rank: int = 0, world_size: int = 1):
        self.tokens = tokens
        self.seq_len = seq_len
        self.seed = seed
        self.rank, self.world_size = rank, world_size
        self.num_samples = (len(tokens) - 1) // seq_len
        if self.num_samples < 1:
            raise ConfigError(f"data.seq_len={seq_len} is longer than the whole corpus ({len(tokens)} tokens)")
        self.samples_consumed = 0
        self._epoch, self._order = -1, None

    def _sample_index(self, g: int) -> int:
        epoch, i = divmod(g, self.num_samples)
        if epoch != self._epoch:
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._order = torch.randperm(self.num_samples, generator=gen).numpy()
            self._epoch = epoch
        return int(self._order[i])

    def micro_batch(self, micro_index: int, micro_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and targets [micro_size, seq_len] for this rank's micro-batch of the current step."""
        start = self.samples_consumed + micro_index * self.world_size * micro_size + self.rank * micro_size
        T = self.seq_len
        rows = np.stack(
            [self.tokens[s * T : s * T + T + 1] for s in (self._sample_index(start + j) for j in range(micro_size))]
        ).astype(np.int64)
        x = torch.from_numpy(rows[:, :-1])
        y = torch.from_numpy(rows[:, 1:])
        return x, y

    def advance(self, global_batch: int) -> None:
        self.samples_consumed += global_batch

    def state_dict(self) -> dict:
        return {"samples_consumed": self.samples_consumed, "seed": self.seed, "num_samples": self.num_samples}

    def load_state_dict(self, state: dict) -> None:
        if state["num_samples"] != self.num_samples or state["seed"] != self.seed:
            raise ConfigError(
                "checkpoint's data position does not match this corpus (data.* or job.seed changed since it was saved)"
            )
        self.samples_consumed = int(state["samples_consumed"])

"""One optimizer step, the hot path: the learning-rate schedule, the attention kernel choice, and TrainStep (shared
with the benchmarks in bench/)."""

from __future__ import annotations

import contextlib
import math

import torch

from holotrain.config import Config
from holotrain.model.moe import ExpertCopies
from holotrain.optim import StepOptimizer
from holotrain.parallel import DistEnv


def lr_at(step: int, cfg: Config) -> float:
    """Linear warmup to training.lr, then cosine decay to lr * min_lr_ratio at the last step."""
    t = cfg.training
    if step < t.warmup_steps:
        return t.lr * (step + 1) / t.warmup_steps
    span = max(1, t.steps - t.warmup_steps)
    progress = min(1.0, (step - t.warmup_steps) / span)
    min_lr = t.lr * t.min_lr_ratio
    return min_lr + 0.5 * (t.lr - min_lr) * (1 + math.cos(math.pi * progress))


def attention_kernels(choice: str, device: torch.device):
    """A context that makes scaled_dot_product_attention prefer the chosen kernel (auto: torch's order)."""
    if choice == "auto" or device.type != "cuda":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    first = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}[choice]
    order = [first] + [b for b in (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION,
                                   SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH) if b != first]
    return sdpa_kernel(order, set_priority=True)


class TrainStep:
    """One optimizer step over `accum` micro-batches. Returns the step's mean loss and the gradient norm as device
    tensors, without synchronizing. Every optimizer path is driven the same way: begin, micro-batches, finish."""

    def __init__(self, model, optimizer: StepOptimizer, cfg: Config, env: DistEnv, dtype: torch.dtype, clock=None):
        self.model, self.optimizer, self.env = model, optimizer, env
        self.clock = clock  # None: no phase timing (bench/peers.py times whole steps itself)
        if clock is not None:
            optimizer.clock = clock
        # Autocast on one device; FSDP2 applies bf16 itself through its mixed-precision policy.
        self.autocast = dtype == torch.bfloat16 and env.world_size == 1
        self.attention = cfg.training.attention
        # What levers ask to run after each backward (the delayed FP8 recipe's scale refresh: precision/lever.py).
        self.after_backward = list(model.hooks.after_backward)
        self.pipelined = hasattr(model, "pipeline")  # parallel/pp.py's PipelineModel: this rank's stages
        # A MoE model's expert weights cast once a step, their gradients summed in bf16 (model/moe.py).
        on = self.autocast and not self.pipelined and cfg.training.expert_weight_copies
        blocks = ExpertCopies.applies(model) if on else []
        self.expert_copies = ExpertCopies(blocks) if blocks else None

    def __call__(self, fetch, accum: int, lr: float) -> tuple[torch.Tensor, torch.Tensor]:
        self.optimizer.begin(lr, accum)
        if self.pipelined:
            return self._pipeline_step(fetch, accum)
        total = None
        device_type = self.env.device.type
        with attention_kernels(self.attention, self.env.device):
            for m in range(accum):
                batch = fetch(m)  # (inputs, targets[, doc_ids])
                if self.env.world_size > 1:
                    self.model.set_requires_gradient_sync(m == accum - 1)
                with self._phase("forward"), torch.autocast(device_type, dtype=torch.bfloat16, enabled=self.autocast):
                    loss = self.model(*batch) / accum
                with self._phase("backward"):
                    loss.backward()
                    for hook in self.after_backward:
                        hook()
                total = loss.detach() if total is None else total + loss.detach()
        if self.expert_copies is not None:
            self.expert_copies.hand_over()
        grad_norm = self.optimizer.finish()  # times its own phases (time.optimizer, time.offload_wait)
        if self.expert_copies is not None:
            self.expert_copies.refresh()
        return total, grad_norm

    def _pipeline_step(self, fetch, accum: int) -> tuple[torch.Tensor, torch.Tensor]:
        """parallel.pp > 1: the step's micro-batches go through the pipeline schedule together, forward and
        backward interleaved by it (one phase, time.pipeline); FSDP2 reduces each stage's gradients after its
        last micro-batch."""
        with attention_kernels(self.attention, self.env.device), self._phase("pipeline"):
            total = self.model.step([fetch(m) for m in range(accum)])
            for hook in self.after_backward:
                hook()
        grad_norm = self.optimizer.finish()
        return total, grad_norm

    def _phase(self, name: str):
        return self.clock.phase(name) if self.clock is not None else contextlib.nullcontext()

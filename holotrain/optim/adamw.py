"""AdamW: its hyperparameters, parameter groups and clipping rule, and the on-device implementation."""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable, Protocol

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_optimizer_state_dict, get_state_dict,
                                                     set_state_dict)

if TYPE_CHECKING:
    from holotrain.profile import PhaseClock


class StepOptimizer(Protocol):
    """What the trainer calls; both optimizer paths implement it."""

    clock: PhaseClock | None  # times this optimizer's phases (time.optimizer, and its own) when set

    def begin(self, lr: float, accum: int) -> None:
        """Before the first micro-batch of a step of `accum` micro-batches, at learning rate `lr`."""

    def finish(self) -> torch.Tensor:
        """After the last backward: clips with the global gradient norm, steps (a non-finite norm skips the
        step), clears the gradients. Returns the norm as a device tensor, without synchronizing."""

    def metrics(self, steps: int) -> dict:
        """The optimizer's own fields of the metrics row, per step over the last `steps` steps."""

    def state_dict(self) -> dict:
        """The training state, {"model": ..., "optim": ..., ...} keyed by parameter name: the tensors that a
        checkpoint saves from and loads into, in place."""

    def load_state_dict(self, state: dict) -> None:
        """After a checkpoint was loaded into state_dict()'s tensors: applies what was not loaded in place."""

    def prepare_hold(self) -> str | None:
        """Makes hold() possible (allocating what it needs); returns why not, or None."""

    def hold(self, wait: bool = True):
        """The training state of the step just finished, held while training goes on: an object with `state`
        (as state_dict(), its host-resident tensors to be read only after `ready()`, on any thread) and
        `release()`; or None, when the caller must copy state_dict() while the loop waits. One hold at a time:
        with `wait`, a hold still in use is waited for; without, None."""

    @property
    def held_paths(self) -> frozenset:
        """Where hold()'s held tensors are in its state (paths of nested keys)."""

    def update_after(self, event: torch.cuda.Event) -> bool:
        """Makes the next update of state_dict()'s device tensors wait (on the device) for `event`, the end of
        copies of them queued on another stream; False where the state is written before that update, and the
        caller must wait for the copies itself."""

    def close(self) -> None:
        """Releases threads and memory; safe to call twice."""


class HyperSection(Protocol):
    """What AdamWHyper reads of the config's `training` section (the trainer's TrainingConfig)."""

    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    grad_clip: float


@dataclass(frozen=True)
class AdamWHyper:
    """AdamW's hyperparameters, read once from the training section."""

    betas: tuple[float, float]
    eps: float
    weight_decay: float
    clip: float  # the gradient norm above which gradients are scaled down; inf: no clipping

    @classmethod
    def from_section(cls, training: HyperSection) -> AdamWHyper:
        # training.grad_clip = 0 means no clipping: an infinite threshold makes every rule below a no-op.
        clip = training.grad_clip if training.grad_clip > 0 else math.inf
        return cls((training.beta1, training.beta2), training.eps, training.weight_decay, clip)

    def clip_scale(self, norm: float) -> float:
        """What the gradients are divided by for a finite norm (1.0: no clipping)."""
        return max(norm / self.clip, 1.0)


_BY_NAME = StateDictOptions(flatten_optimizer_state_dict=True)


def param_groups(params: Iterable[nn.Parameter], weight_decay: float) -> list[dict]:
    """Weight decay on matrices only: norms (1-D parameters) are not decayed. Empty groups are left out. DTensor
    parameters on different meshes (expert parallelism's expert weights) go in groups of their own: a fused or
    foreach kernel takes one mesh's tensors at a time."""
    groups: dict = {}
    for p in params:
        decay = p.ndim >= 2
        groups.setdefault((not decay, _mesh_key(p)), {"params": [], "weight_decay": weight_decay if decay else 0.0})
        groups[(not decay, _mesh_key(p))]["params"].append(p)
    return list(groups.values())


def _mesh_key(t: torch.Tensor):
    mesh = getattr(t, "device_mesh", None)
    return None if mesh is None else (mesh.mesh_dim_names, tuple(mesh.mesh.flatten().tolist()))


def fused_adamw(params: Iterable[nn.Parameter], lr: float, hyper: AdamWHyper) -> torch.optim.AdamW:
    return torch.optim.AdamW(param_groups(params, hyper.weight_decay), lr=lr, betas=hyper.betas, eps=hyper.eps,
                             fused=True)


def step_clipped(optimizer: torch.optim.Optimizer, norm: torch.Tensor, clip: float) -> None:
    """One fused AdamW step (torch's, or bf16_moments.py's) with the clip folded into the kernel: it divides each gradient by grad_scale as it reads
    it, which saves a read-modify-write pass over all gradients; a non-finite norm skips the step (found_inf).
    Only for plain tensors: DTensor gradients (FSDP2) take clip_grad_norm_ instead."""
    optimizer.grad_scale = torch.clamp(norm / clip, min=1.0)
    optimizer.found_inf = (~torch.isfinite(norm)).float()
    optimizer.step()
    optimizer.grad_scale = optimizer.found_inf = None


def _by_mesh(params: Iterable[nn.Parameter]) -> list[list[nn.Parameter]]:
    """The parameters with gradients, grouped by their gradients' mesh (one group of plain tensors)."""
    groups: dict = {}
    for p in params:
        if p.grad is not None:
            groups.setdefault(_mesh_key(p.grad), []).append(p)
    return list(groups.values())


def sharded_clip(params: Iterable[nn.Parameter], clip: float) -> torch.Tensor:
    """Clips FSDP2's DTensor gradients, possibly on several meshes (expert parallelism shards the expert weights
    over other ranks than the rest): each mesh's norm, their total (returned, a plain tensor), and the clip applied
    to one mesh's gradients at a time (DTensor ops take one mesh's operands)."""
    groups = _by_mesh(params)
    norms = [torch.nn.utils.get_total_norm([p.grad for p in group]) for group in groups]
    norms = [n.full_tensor() if hasattr(n, "full_tensor") else n for n in norms]
    total = torch.linalg.vector_norm(torch.stack(norms)) if norms else torch.zeros(())
    for group in groups:
        torch.nn.utils.clip_grads_with_norm_(group, clip, total)
    return total


class DeviceAdamW:
    """AdamW over every parameter of the model, where the parameters live (GPU, or the CPU in tests): torch's fused
    kernel with fp32 moments, or with `moments` = "bf16" optim/bf16_moments.py's."""

    def __init__(self, model: nn.Module, hyper: AdamWHyper, lr: float, sharded: bool, clock=None,
                 moments: str = "fp32"):
        self.model, self.hyper, self.clock = model, hyper, clock
        if moments == "bf16":
            from holotrain.optim.bf16_moments import AdamWBf16Moments

            self.optimizer = AdamWBf16Moments(param_groups(model.parameters(), hyper.weight_decay), lr, hyper.betas,
                                              hyper.eps)
        else:
            self.optimizer = fused_adamw(model.parameters(), lr, hyper)
        # One process: the clip goes into the fused kernel. FSDP2's DTensor gradients take the plain path.
        self.fold_clip = not sharded
        # A pipeline stage's model (parallel/pp.py) gives the norm over every stage, which clipping must use.
        self.whole_norm = getattr(model, "grad_norm", None)
        self._copies: list[torch.cuda.Event] = []  # checkpoint copies of the state still reading it (update_after)

    def begin(self, lr: float, accum: int) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def finish(self) -> torch.Tensor:
        with self._phase("optimizer"):
            for event in self._copies:  # the weights and moments change below: a copy of them must be complete
                torch.cuda.current_stream().wait_event(event)
            self._copies.clear()
            if self.fold_clip:
                grads = [p.grad for p in self.model.parameters() if p.grad is not None]
                grad_norm = torch.nn.utils.get_total_norm(grads)
                step_clipped(self.optimizer, grad_norm, self.hyper.clip)
            else:
                # DTensor gradients (FSDP2): a non-finite norm would turn every gradient into NaN through the clip
                # coefficient, so the host reads the norm (one synchronization per step) and skips the step.
                if self.whole_norm is not None:
                    grad_norm = self.whole_norm()
                    torch.nn.utils.clip_grads_with_norm_(self.model.parameters(), self.hyper.clip, grad_norm)
                    grad_norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
                else:
                    grad_norm = sharded_clip(self.model.parameters(), self.hyper.clip)
                if math.isfinite(grad_norm.item()):
                    self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        return grad_norm

    def metrics(self, steps: int) -> dict:
        return {}

    def state_dict(self) -> dict:
        # The moments by parameter name ("state.<name>.exp_avg"), not by parameter group: a rank's groups hold
        # different parameters at another pipeline degree, and each name is found wherever it is now. The groups'
        # hyperparameters are not saved: they are the config's.
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer, options=_BY_NAME)
        return {"model": model_sd, "optim": {k: v for k, v in optim_sd.items() if k.startswith("state.")}}

    def load_state_dict(self, state: dict) -> None:
        groups = {k: v for k, v in get_optimizer_state_dict(self.model, self.optimizer, options=_BY_NAME).items()
                  if k.startswith("param_groups.")}
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                       optim_state_dict={**state["optim"], **groups}, options=_BY_NAME)

    def prepare_hold(self) -> str | None:
        return "the state is on the device"  # copied to the host in the blocking part at device-to-host speed

    def hold(self, wait: bool = True):
        return None

    held_paths = frozenset()

    def update_after(self, event: torch.cuda.Event) -> bool:
        # Only finish() writes the weights and moments: forward and backward read them, and the buffers that
        # forward updates (FP8 scales) are not in the state.
        self._copies.append(event)
        return True

    def close(self) -> None:
        pass

    def _phase(self, name: str):
        return self.clock.phase(name) if self.clock is not None else contextlib.nullcontext()

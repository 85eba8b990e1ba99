"""The offload engine's units of work: a bucket (one unit's offloaded parameters as flat host buffers), the step
it is in, and the decision that the global gradient norm makes for the step."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from holotrain.memory.offload.host import host_empty, pinned_empty

# Bucket states within a step: LANDED (gradient on the host, norm known), SPECULATED (updated unclipped and
# uploaded before the norm was known), FINAL (this step's update is uploaded; the next forward may use it).
LANDED, SPECULATED, FINAL = "landed", "speculated", "final"


def local(t: torch.Tensor) -> torch.Tensor:
    """The tensor this rank holds: a DTensor's local shard, or the tensor itself."""
    return t._local_tensor if isinstance(t, DTensor) else t


def fqn(name: str) -> str:
    """A parameter's name as the model's state dict spells it (without wrapper modules' prefixes)."""
    for wrapper in ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module."):
        name = name.replace(wrapper, "")
    return name


def squared_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """The tensors' summed squared L2 norm as an fp64 scalar on their device (each norm taken in fp32)."""
    try:
        norms = torch._foreach_norm(grads, 2, dtype=torch.float32)
    except (TypeError, RuntimeError):
        norms = [torch.linalg.vector_norm(g, dtype=torch.float32) for g in grads]
    return torch.stack(norms).double().square().sum()


@dataclass
class Step:
    lr: float
    t: int  # AdamW step number of this step's update (1-based)
    landings: int  # gradient arrivals per bucket per step: micro-batches on one device, 1 with FSDP2
    speculate: bool
    decision: Decision | None = None


@dataclass
class Decision:
    scale: float  # gradients are divided by it (1.0: no clipping)
    skip: bool  # the norm is not finite: no update

    @property
    def unchanged(self) -> bool:
        return self.scale == 1.0 and not self.skip


class Bucket:
    """One unit's offloaded parameters as flat host buffers."""

    def __init__(self, name: str, index: int, named: list[tuple[str, nn.Parameter]], working_dtype, pin: bool):
        self.name, self.index = name, index
        self.params = [p for _, p in named]
        self.fqns = [fqn(n) for n, _ in named]
        self.shapes = [local(p).shape for p in self.params]
        self.spans, offset = [], 0
        for shape in self.shapes:
            n = shape.numel()
            self.spans.append((offset, n))
            offset += n
        self.numel = offset
        self.master = host_empty(offset, torch.float32)
        self.exp_avg = host_empty(offset, torch.float32, zero=True)
        self.exp_avg_sq = host_empty(offset, torch.float32, zero=True)
        # The D2H target; pinned so that the copies run asynchronously, on the copy engine.
        self.staging = pinned_empty(offset, working_dtype) if pin else torch.empty(offset, dtype=working_dtype)
        self.acc: torch.Tensor | None = None  # fp32 sum of micro-batch gradients (one device, accumulation)
        # Per step: the engine's lock guards these.
        self.state = FINAL
        self.step: Step | None = None
        self.arrived = 0  # gradients counted in this backward (autograd thread only)
        self.staged = 0  # staging copies issued this step
        self.staging_free = True
        self.grad: torch.Tensor | None = None  # the landed gradient (staging or acc)
        self.sq_norm = 0.0
        # The squared norm of this step's gradient, taken on the device before the copy (one landing per step):
        # a pinned fp64 slot the D2H stream writes after the gradient (on the CPU device, the norm tensor itself).
        self.sq_host = torch.zeros(1, dtype=torch.float64, pin_memory=True) if pin else None
        self.speculated = False  # masters hold this step's unclipped update
        self.version = self.uploaded = 0  # master changes / the change the working weights show
        self.grads_ready = None  # CUDA event: backward is done with this bucket's weights and gradients
        # Checkpoints that go on while training does (state.HeldState): a second set of master and moments, and
        # the step whose final values the current set is held for (its next update then writes the other set).
        self.spare: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self.held_for: object | None = None
        self.held = False  # a checkpoint is reading one of the two sets
        self.upload_event = None  # CUDA event: the latest upload has landed
        # Delayed update: the staging buffer holds the bucket's new weights (in the working dtype), to be uploaded
        # when the next backward is done with the old ones.
        self.pending_upload = False

    @property
    def buffers(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """master, exp_avg, exp_avg_sq: the set the updates write now."""
        return self.master, self.exp_avg, self.exp_avg_sq

    def view(self, flat: torch.Tensor, i: int) -> torch.Tensor:
        off, n = self.spans[i]
        return flat[off:off + n].view(self.shapes[i])


class UploadBuffer:
    """Pinned host memory for one bucket's new weights in the working dtype, on their way to the GPU."""

    def __init__(self, numel: int, dtype: torch.dtype):
        self.data = pinned_empty(numel, dtype)
        self.in_use = None  # CUDA event of the copy that reads it

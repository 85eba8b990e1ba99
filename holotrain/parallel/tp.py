"""Tensor parallelism for the decoder, applied to the plain model from outside (torchtitan's habit): Megatron's
column/row split of every block with sequence parallelism between them.

Parameters become DTensors on the "tp" mesh, so FSDP2 over "dp" composes with them on a 2-D mesh and DCP
checkpoints them like any other DTensor:
  attention wq/wk/wv, FFN w1/w3     Shard(0)  column-parallel: a rank computes its heads / FFN columns
  attention wo, FFN w2              Shard(1)  row-parallel: partial sums over a rank's heads / columns
  tok_embeddings, output            Shard(0)  vocabulary-parallel
  the RMSNorm weights               Replicate (their gradients summed over the group)
  biases (where a checkpoint has them): a column-parallel linear's Shard(0), a row-parallel one's Replicate
Activations between the parallel regions are sequence-parallel: a rank holds 1/tp of the micro-batch's
tokens, one contiguous block of its flattened B*T rows, shaped [B, T/tp, dim]; norms and residual adds run on
that share. A column-parallel group all-gathers the tokens into its GEMM (QKV as one GEMM over the three
weights' local rows, gate/up likewise), a row-parallel layer reduce-scatters its GEMM's partial sums back
into the token blocks; overlap.py does both, by `parallel.tp_overlap`. The embedding looks up the rank's
vocabulary slice and reduce-scatters; the head computes the rank's vocabulary slice of the logits for all
tokens and a vocabulary-parallel cross-entropy, so no rank holds [tokens, vocab] logits.

The model's code is untouched: the styles below replace `Attention.qkv`, `FeedForward.gate_up`, the forward of
the row-parallel linears, norms and embedding on the instances, and the model's loss through its loss hook.
"""

from __future__ import annotations

import functools
from typing import Protocol

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle, parallelize_module

from holotrain.errors import ConfigError
from holotrain.model.parts import rms_norm
from holotrain.parallel.overlap import (
    MODES, TPComm, ag_linear, all_gather_rows, gather_columns, grad_all_reduce, linear_rs, reduce_scatter_rows,
)


class TPSection(Protocol):
    """What apply_tp reads of the config's `parallel` section (holotrain.parallel.config.ParallelConfig)."""

    tp_overlap: str
    tp_tiles: str
    tp_spin_limit: int
    tp_barrier_ms: int
    tp_piece_mb: float


_SECTION_KEYS = tuple(TPSection.__annotations__)


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, section: TPSection) -> TPComm:
    """Splits `model` (a holotrain decoder, on any device, "meta" included) over `tp_mesh` in place, as the config's
    `parallel` section says (tp_overlap, tp_tiles and the fused kernels' tp_spin_limit, tp_barrier_ms, tp_piece_mb)."""
    missing = [k for k in _SECTION_KEYS if not hasattr(section, k)]
    if missing:
        raise TypeError(f"apply_tp(model, tp_mesh, section) takes the config's parallel section (cfg.parallel), got "
                        f"{type(section).__name__} {section!r}, without {', '.join(missing)}")
    overlap = section.tp_overlap
    if overlap not in MODES:
        raise ConfigError(f"parallel.tp_overlap must be one of {', '.join(MODES)}, got {overlap!r}")
    tp = tp_mesh.size()
    a = model.args
    for key in ("n_heads", "n_kv_heads", "ffn_dim", "vocab_size"):
        if getattr(a, key) % tp:
            raise ConfigError(f"parallel.tp={tp} must divide model.{key}={getattr(a, key)}")
    if overlap != "none" and tp_mesh.device_type != "cuda":
        raise ConfigError(f"parallel.tp_overlap={overlap!r} runs on CUDA GPUs only; use 'none' on the CPU")
    comm = TPComm(tp_mesh.get_group(), overlap, section.tp_tiles, spin_limit=section.tp_spin_limit,
                  barrier_ms=section.tp_barrier_ms, piece_mb=section.tp_piece_mb)
    # The model's modules by role (a pipeline stage declares only those it holds). A norm's weight is replicated and
    # its gradient summed over the group: the norms between blocks see this rank's tokens, the per-head q/k norms
    # (qwen3) its heads, so each rank's gradient is a partial sum either way.
    styles = {"embedding": VocabParallelEmbedding, "norm": SequenceParallelNorm, "row": RowParallel,
              "head": VocabParallelHead}
    plan = {path: ColumnParallelGroup(comm, role[1], role[2]) if role[0] == "input_group" else styles[role[0]](comm)
            for path, role in model.layer_roles().items()}
    parallelize_module(model, tp_mesh, plan)
    model.hooks.shard_sequence(tp, "tp")  # the hidden state between blocks holds one block of each sequence's tokens
    model.tie_weights()  # the embedding and the head are split alike (Shard(0) over the vocabulary)
    model.hooks.install("loss", functools.partial(_vocab_parallel_loss, model, comm), "tp")
    model.hooks.install("tp_comm", comm, "tp")
    return comm


# --------------------------------------------------------------------------------------------------------
# Styles: each distributes its module's parameters and installs the forward that works on local shards.


def _distribute(module: nn.Module, name: str, mesh: DeviceMesh, placement) -> None:
    param = getattr(module, name)
    # src_data_rank=None: every rank keeps its own slice without communication (the weights are drawn later,
    # by the decoder's init_weights, which distributes each full tensor the same way).
    dt = distribute_tensor(param.data, mesh, [placement], src_data_rank=None)
    module.register_parameter(name, nn.Parameter(dt, requires_grad=param.requires_grad))


class _Style(ParallelStyle):
    def __init__(self, comm: TPComm):
        super().__init__()
        self.comm = comm


class ColumnParallelGroup(_Style):
    """Linears reading the same input, split by output rows, computed as one all-gather + GEMM.

    Replaces `module.<method>` (e.g. Attention.qkv), which returns the linears' outputs in order.
    """

    def __init__(self, comm: TPComm, method: str, names: tuple[str, ...]):
        super().__init__(comm)
        self.method, self.names = method, names

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        linears = [getattr(module, n) for n in self.names]
        for lin in linears:
            _distribute(lin, "weight", device_mesh, Shard(0))
            if lin.bias is not None:
                _distribute(lin, "bias", device_mesh, Shard(0))
        setattr(module, self.method, functools.partial(_column_group_forward, linears, self.comm))
        return module


class RowParallel(_Style):
    """A linear split by input columns: partial sums over a rank's columns, reduce-scattered into token blocks."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        _distribute(module, "weight", device_mesh, Shard(1))
        if module.bias is not None:
            _distribute(module, "bias", device_mesh, Replicate())
        module.forward = functools.partial(_row_forward, module, self.comm)
        return module


class SequenceParallelNorm(_Style):
    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        _distribute(module, "weight", device_mesh, Replicate())
        module.forward = functools.partial(_norm_forward, module, self.comm)
        return module


class VocabParallelEmbedding(_Style):
    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        _distribute(module, "weight", device_mesh, Shard(0))
        module.forward = functools.partial(_embedding_forward, module, self.comm)
        return module


class VocabParallelHead(_Style):
    """The output head split by vocabulary. Its forward (logits without targets) gathers the full vocabulary;
    training goes through the decoder's loss, through its loss hook the vocabulary-parallel cross-entropy."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        _distribute(module, "weight", device_mesh, Shard(0))
        module.forward = functools.partial(_head_forward, module, self.comm)
        return module


# --------------------------------------------------------------------------------------------------------
# Forwards on local shards. Each is opaque to torch.compile (communication, custom kernels): a compiled block
# compiles the code between them.


def _fp8_matmul(linears: list[nn.Linear]):
    """The FP8 matmul the precision lever gave all of these linears (precision/lever.py), or None: bf16."""
    fns = {getattr(lin, "fp8_matmul", None) for lin in linears}
    return fns.pop() if len(fns) == 1 else None


def _gathered_linear(linears: list[nn.Linear], x: torch.Tensor, w: torch.Tensor, comm: TPComm) -> torch.Tensor:
    """all_gather(x) @ w.T, with the overlap mode's GEMM, or FP8's after a plain all-gather."""
    fp8 = _fp8_matmul(linears)
    if fp8 is None:
        return ag_linear(x, w, comm)
    return fp8(all_gather_rows(x, comm), w.t())


@torch.compiler.disable
def _column_group_forward(linears: list[nn.Linear], comm: TPComm, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    B, Tl, K = x.shape
    ws = [lin.weight.to_local() for lin in linears]
    w = ws[0] if len(ws) == 1 else torch.cat(ws)  # one GEMM over the linears' local rows
    y = _gathered_linear(linears, x.reshape(B * Tl, K), w, comm)
    if linears[0].bias is not None:
        y = y + torch.cat([lin.bias.to_local() for lin in linears]).to(y.dtype)
    y = y.view(B, Tl * comm.world, -1)
    return y.split([t.shape[0] for t in ws], dim=-1)


@torch.compiler.disable
def _row_forward(linear: nn.Linear, comm: TPComm, x: torch.Tensor) -> torch.Tensor:
    B, T, Kl = x.shape
    x, w = x.reshape(B * T, Kl), linear.weight.to_local()
    fp8 = _fp8_matmul([linear])
    y = linear_rs(x, w, comm) if fp8 is None else reduce_scatter_rows(fp8(x, w.t()), comm)
    if linear.bias is not None:  # added once, after the sum; its gradient summed over the ranks' token blocks
        y = y + grad_all_reduce(linear.bias.to_local(), comm).to(y.dtype)
    return y.view(B, T // comm.world, -1)


@torch.compiler.disable
def _norm_forward(norm: nn.Module, comm: TPComm, x: torch.Tensor) -> torch.Tensor:
    return rms_norm(x, grad_all_reduce(norm.weight.to_local(), comm), norm.eps)


@torch.compiler.disable
def _embedding_forward(emb: nn.Embedding, comm: TPComm, tokens: torch.Tensor) -> torch.Tensor:
    w = emb.weight.to_local()  # [V/tp, dim]: vocabulary rows v0 .. v0 + V/tp - 1
    local = tokens - comm.rank * w.shape[0]
    inside = (local >= 0) & (local < w.shape[0])
    h = F.embedding(torch.where(inside, local, 0), w).masked_fill(~inside.unsqueeze(-1), 0)  # partial sums
    B, T, D = h.shape
    if T % comm.world:
        raise ValueError(f"tensor parallelism: sequence length {T} does not split over {comm.world} ranks")
    return reduce_scatter_rows(h.reshape(B * T, D), comm).view(B, T // comm.world, D)


@torch.compiler.disable
def _head_forward(head: nn.Linear, comm: TPComm, h: torch.Tensor) -> torch.Tensor:
    B, Tl, D = h.shape
    logits = _gathered_linear([head], h.reshape(B * Tl, D), head.weight.to_local(), comm)  # [B*T, V/tp]
    return gather_columns(logits, comm).view(B, Tl * comm.world, -1)


@torch.compiler.disable
def _vocab_parallel_loss(model: nn.Module, comm: TPComm, h: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The decoder's loss under tensor parallelism: final norm on the token block, the head's vocabulary slice of the
    logits for all tokens, and the mean cross-entropy over targets other than -100 (same value on every rank)."""
    x = model.norm(h)
    B, Tl, D = x.shape
    logits = _gathered_linear([model.output], x.reshape(B * Tl, D), model.output.weight.to_local(), comm)
    return _VocabParallelCrossEntropy.apply(logits, targets.reshape(-1), comm)  # logits [B*T, V/tp]


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy (fp32) of logits split by vocabulary over the group; targets are global ids."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, comm: TPComm) -> torch.Tensor:
        x = logits.float()
        vl = x.shape[1]
        row_max = x.max(dim=1).values
        dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=comm.group)
        x = x - row_max.unsqueeze(1)
        local = targets - comm.rank * vl
        inside = (local >= 0) & (local < vl)
        target_logit = x.gather(1, torch.where(inside, local, 0).unsqueeze(1)).squeeze(1) * inside
        exp = x.exp_()  # x is a fresh tensor: reuse it for the exponentials
        sums = torch.stack([exp.sum(dim=1), target_logit])
        dist.all_reduce(sums, group=comm.group)
        valid = targets != -100
        count = valid.sum().clamp(min=1)
        loss = ((sums[0].log() - sums[1]) * valid).sum() / count
        ctx.save_for_backward(exp, sums[0], local, inside, valid, count)
        ctx.logits_dtype = logits.dtype
        return loss

    @staticmethod
    def backward(ctx, dloss: torch.Tensor):
        exp, sumexp, local, inside, valid, count = ctx.saved_tensors
        grad = exp.div_(sumexp.unsqueeze(1))  # softmax over the whole vocabulary, this rank's slice
        rows = torch.nonzero(inside, as_tuple=True)[0]
        grad[rows, local[rows]] -= 1.0
        grad.mul_((valid.float() * (dloss / count)).unsqueeze(1))
        return grad.to(ctx.logits_dtype), None, None

"""Expert parallelism's token exchange: each rank of an expert-parallel group holds E / ep of a mixture-of-experts
layer's experts (a contiguous range); the tokens routed to an expert travel to its rank and back by all-to-all with
uneven splits.

`dispatch` takes this rank's token copies sorted by expert (what the layer's permutation produces) and the count per
expert, and returns the copies this rank's experts must process, sorted by local expert, with their counts; `combine`
sends the experts' outputs back in the order dispatch received them from, so that the layer's un-permutation applies
unchanged. Both are differentiable: the backward of an all-to-all is the all-to-all with the splits swapped.
`ExpertExchange`, the model's hook, does the same pipelined in chunks of the local experts, so that transfers run
behind the expert GEMMs; `apply_ep` puts a model's experts under it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

# Chunks of the local experts the exchange is pipelined in (ExpertExchange; the cost model's overlap reads it).
EP_CHUNKS = 2


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out_splits, in_splits = ctx.splits
        back = grad.new_empty((sum(in_splits), *grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return back, None, None, None


def all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    """Rows of `x` (in_splits[r] of them for rank r, in rank order) to their ranks; returns the rows received
    (out_splits[r] from rank r)."""
    return _AllToAll.apply(x, out_splits, in_splits, group)


@dataclass
class Dispatched:
    """What combine needs to send the outputs back: the splits of both exchanges, and the order that sorted the
    received rows by local expert."""

    sent: list[int]  # rows sent to each rank
    received: list[int]  # rows received from each rank
    order: torch.Tensor  # received rows -> local-expert order


def dispatch(x: torch.Tensor, counts: torch.Tensor, group) -> tuple[torch.Tensor, torch.Tensor, Dispatched]:
    """x: [N, D] this rank's token copies sorted by (global) expert; counts: [E] copies per expert, E divisible by
    the group's size. Returns the rows for this rank's experts sorted by local expert [M, D], the count per local
    expert [E / ep], and what combine needs."""
    ep = dist.get_world_size(group)
    local = counts.numel() // ep
    # Each rank's count per expert it owns, from every rank: [ep (source), E / ep]
    incoming = torch.empty_like(counts)
    dist.all_to_all_single(incoming, counts.contiguous(), group=group)
    incoming = incoming.view(ep, local)
    sent = counts.view(ep, local).sum(1).tolist()
    received = incoming.sum(1).tolist()
    rows = all_to_all(x, received, sent, group)
    # The received rows come by source rank, each source's sorted by expert; sort them by local expert (stable, so
    # that each expert's rows keep the source order).
    expert_of_row = torch.repeat_interleave(torch.arange(local, device=x.device).repeat(ep), incoming.flatten())
    order = torch.argsort(expert_of_row, stable=True)
    return rows[order], incoming.sum(0), Dispatched(sent, received, order)


def combine(y: torch.Tensor, how: Dispatched, group) -> torch.Tensor:
    """The experts' outputs [M, D] (in dispatch's local-expert order) back to the ranks their tokens came from, in
    the order they were sent ([N, D], sorted by global expert as dispatch's input was)."""
    inverse = torch.empty_like(how.order)
    inverse[how.order] = torch.arange(how.order.numel(), device=how.order.device)
    return all_to_all(y[inverse], how.sent, how.received, group)


class _ScaleGrad(torch.autograd.Function):
    """The identity forward; backward multiplies the gradient by `scale`."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.scale, None


class ExpertExchange:
    """The model's `experts` hook under expert parallelism: a mixture-of-experts layer's sorted token copies sent to
    the ranks holding their experts, run there, and sent back.

    Pipelined in `chunks` (each a contiguous share of every rank's local experts): all the chunks' all-to-alls are
    issued at once (torch's functional collectives, which wait only where their result is first read), then each
    chunk's experts run as soon as its rows have arrived and its outputs start back at once, so the transfers of the
    other chunks overlap the expert GEMMs; the backward's all-to-alls are the same collectives, waited on the same
    way. One chunk (or one expert a rank) is dispatch, experts, combine in turn.

    A rank's expert-weight gradients sum the tokens of its whole expert-parallel group, where every other gradient
    holds its own rank's rows only; FSDP2 averages both over the ranks holding the same weights (for experts, the
    data-parallel ranks / ep of them). So the gradient into the local experts is divided by ep, and the gradient
    out to the tokens multiplied back: the tokens' gradients are unchanged and the experts' come out as the mean over
    every data-parallel rank's rows, as the rest of the model's."""

    def __init__(self, group, chunks: int = EP_CHUNKS):
        self.group, self.chunks = group, chunks
        self.ep = dist.get_world_size(group)

    def __call__(self, rows: torch.Tensor, counts: torch.Tensor, local) -> torch.Tensor:
        n_local = counts.numel() // self.ep
        chunks = max(1, min(self.chunks, n_local))
        if chunks == 1:
            received, local_counts, how = dispatch(rows, counts, self.group)
            out = local(_ScaleGrad.apply(received, float(self.ep)), local_counts)
            return combine(_ScaleGrad.apply(out, 1.0 / self.ep), how, self.group)
        return self._pipelined(rows, counts, local, n_local, chunks)

    def _pipelined(self, rows, counts, local, n_local: int, chunks: int) -> torch.Tensor:
        from torch.distributed._functional_collectives import all_to_all_single_autograd as a2a

        ep, device = self.ep, rows.device
        incoming = torch.empty_like(counts)  # [source rank, local expert]: the copies each rank sends each of mine
        dist.all_to_all_single(incoming, counts.contiguous(), group=self.group)
        sent_by_expert, got = counts.view(ep, n_local).tolist(), incoming.view(ep, n_local)
        starts = [0]
        for n in counts.tolist():
            starts.append(starts[-1] + n)
        bounds = [n_local * c // chunks for c in range(chunks + 1)]
        parts = []
        for first, last in zip(bounds, bounds[1:]):
            # The rows for experts [first, last) of every rank: one contiguous run per destination.
            runs = [(starts[r * n_local + first], starts[r * n_local + last]) for r in range(ep)]
            index = torch.cat([torch.arange(a, b, device=device) for a, b in runs])
            sent = [b - a for a, b in runs]
            mine = got[:, first:last]
            received = mine.sum(1).tolist()
            parts.append((index, sent, received, mine,
                          a2a(rows.index_select(0, index), received, sent, self.group)))
        outs = []
        for (index, sent, received, mine, arrived), first, last in zip(parts, bounds, bounds[1:]):
            # Received by source rank, each source's sorted by expert: sorted by local expert (stable).
            expert = torch.repeat_interleave(torch.arange(first, last, device=device).repeat(ep), mine.flatten())
            order = torch.argsort(expert, stable=True)
            local_counts = torch.zeros(n_local, dtype=counts.dtype, device=device)
            local_counts[first:last] = mine.sum(0)
            out = local(_ScaleGrad.apply(arrived[order], float(ep)), local_counts)
            back = torch.empty_like(order).index_copy_(0, order, torch.arange(order.numel(), device=device))
            outs.append(a2a(_ScaleGrad.apply(out, 1.0 / ep)[back], sent, received, self.group))
        index = torch.cat([part[0] for part in parts])
        return torch.empty_like(rows).index_copy(0, index, torch.cat(outs))


def apply_ep(model, mesh) -> None:
    """Splits every mixture-of-experts layer's experts over `mesh` (the "ep" dimension: adjacent data-parallel
    ranks) and routes the layers' tokens through the exchange. On the plain model, before FSDP2, which then shards
    the expert weights over the ranks that hold the same experts (parallel/dp.py)."""
    for moe in model.moe_modules().values():
        moe.shard_experts(mesh)
    model.hooks.install("experts", ExpertExchange(mesh.get_group()), owner="parallel")

"""Context parallelism: each sequence split over the ranks of the "cp" mesh dimension, applied to the plain model
from outside (the model's sequence hook).

Every rank of a context-parallel group receives the whole micro-batch (the data plane hands one batch to the group)
and keeps its share of the tokens; everything but attention is per token and runs on that share. Attention spans
the group in one of two ways (`parallel.cp_mode`):

- ring: the sequence is cut into 2N chunks and rank r holds chunks r and 2N-1-r, so that every rank does the same
  share of causal attention work. Keys and values pass around the ring of ranks; each hop is in flight while the
  rank computes attention on the block it holds, and the partial results merge through their log-sum-exp. Backward
  passes the blocks around again, with the gradients of each block's keys and values travelling alongside it back
  to its owner.
- alltoall (DeepSpeed-Ulysses): rank r holds the r-th contiguous slice. An all-to-all turns [tokens/N, all heads]
  into [all tokens, heads/N]; attention runs over the whole sequence with the model's own kernels (SDPA, or
  flex_attention's block-sparse document mask), and a second all-to-all turns it back. Needs the heads and kv heads
  of a rank to divide by N.

Packed documents keep their mask in both: the group knows the whole row's document ids, so every block of the ring
is masked by global position and document, and the all-to-all path masks the whole sequence.

torch's own context_parallel (torch.distributed.tensor.experimental) rings SDPA's causal kernels on CUDA; it takes
neither a document mask nor the CPU, which CI proves this on, hence the ring here.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from holotrain.errors import ConfigError
from holotrain.model.parts import SequenceAttention, attention, attention_mask, doc_positions

MODES = ("auto", "ring", "alltoall")


def resolve_mode(mode: str, cp: int, n_heads: int, n_kv_heads: int, window: int = 0) -> str:
    """"auto": alltoall where every rank's heads and kv heads divide by cp (one all-to-all per tensor, then the
    model's own kernels and document masks at full length), else ring. A sliding window (model.sliding_window) is
    masked by the alltoall path only."""
    if window and (mode == "ring" or (mode == "auto" and (n_heads % cp or n_kv_heads % cp))):
        raise ConfigError(f"model.sliding_window = {window} runs under context parallelism with parallel.cp_mode = "
                          f"'alltoall' only, which needs the heads ({n_heads}) and kv heads ({n_kv_heads}) of a rank to "
                          f"divide by parallel.cp = {cp}")
    if mode == "auto":
        return "alltoall" if n_heads % cp == 0 and n_kv_heads % cp == 0 else "ring"
    if mode == "alltoall" and (n_heads % cp or n_kv_heads % cp):
        raise ConfigError(f"parallel.cp_mode = 'alltoall' needs the heads ({n_heads}) and kv heads ({n_kv_heads}) of a "
                          f"rank to divide by parallel.cp = {cp}; use 'ring'")
    return mode


def apply_cp(model: nn.Module, cp_mesh: DeviceMesh, mode: str, tp: int = 1) -> ContextParallel:
    """Makes `model` (a holotrain decoder, tensor-parallel or not) split each sequence over `cp_mesh`."""
    a = model.args
    mode = resolve_mode(mode, cp_mesh.size(), a.n_heads // tp, a.n_kv_heads // tp, a.sliding_window)
    cp = ContextParallel(cp_mesh, mode, a.sliding_window)
    model.hooks.install("sequence", cp, "cp")
    model.hooks.shard_sequence(cp.size, "cp")  # the hidden state between blocks holds this rank's chunks
    return cp


class ContextParallel:
    def __init__(self, mesh: DeviceMesh, mode: str, window: int = 0):
        self.mesh, self.mode, self.window = mesh, mode, window
        self.group = mesh.get_group()
        self.size, self.rank = mesh.size(), mesh.get_local_rank()
        self._index: dict = {}

    def local_index(self, T: int, device: torch.device) -> torch.Tensor:
        """The positions of the sequence this rank holds, in the order it holds them."""
        key = (T, device)
        if key not in self._index:
            n, r = self.size, self.rank
            if T % (2 * n if self.mode == "ring" else n):
                raise ConfigError(f"data.seq_len = {T} must divide into {2 * n if self.mode == 'ring' else n} "
                                  f"equal chunks for parallel.cp = {n} ({self.mode})")
            if self.mode == "ring":
                c = T // (2 * n)
                index = torch.cat([torch.arange(r * c, (r + 1) * c), torch.arange((2 * n - 1 - r) * c, (2 * n - r) * c)])
            else:
                index = torch.arange(r * T // n, (r + 1) * T // n)
            self._index[key] = index.to(device)
        return self._index[key]

    def split(self, tokens: torch.Tensor, targets: torch.Tensor | None, doc_ids: torch.Tensor | None, T: int):
        """(tokens, targets, positions, attention, loss weight) of this rank's share of the micro-batch of T tokens
        a row. tokens: [B, T] ids, or on a pipeline stage without the embedding the previous stage's hidden state,
        already this rank's share (kept as it is)."""
        B = tokens.shape[0]
        index = self.local_index(T, tokens.device)
        pos = (torch.arange(T, device=tokens.device).expand(B, T) if doc_ids is None else doc_positions(doc_ids))
        if self.mode == "ring":
            attend = RingAttention(self, doc_ids, T)
        else:
            attend = AllToAllAttention(self, doc_ids, T, tokens.device)
        weight = None
        if targets is not None:
            targets, weight = self.split_targets(targets)
        if tokens.dim() == 2:
            tokens = tokens[:, index]
        return tokens, targets, pos[:, index], attend, weight

    def split_targets(self, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's share of the targets [B, T], and the weight of its mean loss (`loss_weight`)."""
        targets = targets[:, self.local_index(targets.shape[1], targets.device)]
        return targets, self.loss_weight(targets)

    @torch.no_grad()
    def loss_weight(self, targets: torch.Tensor) -> torch.Tensor:
        """N x (this rank's targets) / (the group's targets): times the rank's mean, the group's gradients (averaged
        over its ranks by FSDP2) are those of the mean over the whole sequence, whatever the share of targets each
        rank holds (padding and chat masks leave some without)."""
        counts = (targets != -100).sum().float().reshape(1)
        local = counts.clone()
        dist.all_reduce(counts, group=self.group)
        return (self.size * local / counts.clamp(min=1)).squeeze(0)


# ---------------------------------------------------------------------------------------------------------------
# All-to-all over heads.


class AllToAllAttention(SequenceAttention):
    def __init__(self, cp: ContextParallel, doc_ids: torch.Tensor | None, T: int, device: torch.device):
        self.cp = cp
        # The whole row's mask, built once per forward and shared by every block.
        self.mask = attention_mask(doc_ids, cp.window, T, device)

    @torch.compiler.disable
    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        n, group = self.cp.size, self.cp.group
        whole = [_sequence_to_heads(t, n, group) for t in (q, k, v)]
        return _heads_to_sequence(attention(*whole, self.mask), n, group)


def _sequence_to_heads(x: torch.Tensor, n: int, group) -> torch.Tensor:
    """[B, H, T/n, D] (this rank's tokens, all heads) -> [B, H/n, T, D] (all tokens, this rank's heads)."""
    B, H, t, D = x.shape
    parts = x.reshape(B, n, H // n, t, D).transpose(0, 1).contiguous()  # [n (to rank), B, H/n, t, D]
    got = funcol.all_to_all_single_autograd(parts, None, None, group)  # [n (from rank), B, H/n, t, D]
    return got.permute(1, 2, 0, 3, 4).reshape(B, H // n, n * t, D)


def _heads_to_sequence(y: torch.Tensor, n: int, group) -> torch.Tensor:
    B, h, T, D = y.shape
    parts = y.reshape(B, h, n, T // n, D).permute(2, 0, 1, 3, 4).contiguous()  # [n (to rank), B, h, T/n, D]
    got = funcol.all_to_all_single_autograd(parts, None, None, group)  # [n (from rank: its heads), B, h, T/n, D]
    return got.transpose(0, 1).reshape(B, n * h, T // n, D)


# ---------------------------------------------------------------------------------------------------------------
# Ring.

EMPTY, FULL, CAUSAL = "empty", "full", "causal"


class RingAttention(SequenceAttention):
    """The ring over one micro-batch: which (query chunk, key chunk) pairs need work, and with which mask."""

    def __init__(self, cp: ContextParallel, doc_ids: torch.Tensor | None, T: int):
        self.cp, self.doc_ids = cp, doc_ids
        self.chunk = T // (2 * cp.size)
        self._kinds: dict = {}

    def chunks_of(self, rank: int) -> tuple[int, int]:
        return rank, 2 * self.cp.size - 1 - rank

    def pair(self, a: int, b: int):
        """How queries of chunk a see keys of chunk b: EMPTY, FULL, CAUSAL, or a boolean mask [B, 1, c, c]."""
        if b > a:
            return EMPTY
        if self.doc_ids is None:
            return CAUSAL if a == b else FULL
        key = (a, b)
        if key not in self._kinds:  # decided once per micro-batch, for every layer and for backward
            c = self.chunk
            da, db = self.doc_ids[:, a * c:(a + 1) * c], self.doc_ids[:, b * c:(b + 1) * c]
            # Document ids never decrease along a row: compare their ends.
            if bool((db[:, -1] < da[:, 0]).all()):
                kind = EMPTY
            elif bool((da[:, 0] == da[:, -1]).all() and (db[:, 0] == da[:, -1]).all()):
                kind = CAUSAL if a == b else FULL
            else:
                kind = "mask"
            self._kinds[key] = kind
        if self._kinds[key] != "mask":
            return self._kinds[key]
        c = self.chunk
        da, db = self.doc_ids[:, a * c:(a + 1) * c], self.doc_ids[:, b * c:(b + 1) * c]
        mask = da[:, :, None] == db[:, None, :]
        if a == b:
            mask &= torch.ones(c, c, dtype=torch.bool, device=mask.device).tril()
        return mask[:, None]

    @torch.compiler.disable
    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return _Ring.apply(q, k, v, self)


class _Ring(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, ring: RingAttention):
        cp, c = ring.cp, ring.chunk
        n, r = cp.size, cp.rank
        qs = (q[:, :, :c], q[:, :, c:])
        out = [torch.zeros(q[:, :, :c].shape, dtype=torch.float32, device=q.device) for _ in range(2)]
        lse = [torch.full(q.shape[:2] + (c,), float("-inf"), device=q.device) for _ in range(2)]
        kv = torch.stack([k, v]).contiguous()
        for step in range(n):
            source = (r - step) % n
            pending = _shift(kv, cp) if step < n - 1 else None  # the next block travels while this one is used
            for i, a in enumerate(ring.chunks_of(r)):
                for j, b in enumerate(ring.chunks_of(source)):
                    kind = ring.pair(a, b)
                    if isinstance(kind, str) and kind == EMPTY:
                        continue
                    o, l = _block_forward(qs[i], kv[0][:, :, j * c:(j + 1) * c], kv[1][:, :, j * c:(j + 1) * c], kind)
                    _merge(out[i], lse[i], o, l)
            if pending is not None:
                kv = _wait(pending)
        out = torch.cat(out, dim=2).to(q.dtype)
        lse = torch.cat(lse, dim=2)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring = ring
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        ring = ctx.ring
        cp, c = ring.cp, ring.chunk
        n, r = cp.size, cp.rank
        dout = dout.contiguous()
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        kv = torch.stack([k, v]).contiguous()
        # The gradient of the block held now, summed over the ranks it has visited, travels with it (fp32).
        dkv_in = torch.zeros(kv.shape, dtype=torch.float32, device=q.device)
        travelling = None
        for step in range(n):
            source = (r - step) % n
            pending = _shift(kv, cp) if step < n - 1 else None
            dkv = torch.zeros_like(dkv_in)
            for i, a in enumerate(ring.chunks_of(r)):
                rows = slice(i * c, (i + 1) * c)
                for j, b in enumerate(ring.chunks_of(source)):
                    kind = ring.pair(a, b)
                    if isinstance(kind, str) and kind == EMPTY:
                        continue
                    cols = slice(j * c, (j + 1) * c)
                    gq, gk, gv = _block_backward(dout[:, :, rows], q[:, :, rows], kv[0][:, :, cols], kv[1][:, :, cols],
                                                 out[:, :, rows], lse[:, :, rows], kind)
                    dq[:, :, rows] += gq
                    dkv[0][:, :, cols] += gk
                    dkv[1][:, :, cols] += gv
            if travelling is not None:
                dkv_in = _wait(travelling)
            dkv += dkv_in
            travelling = _shift(dkv, cp)  # on to the next rank; after the last step, to the block's owner
            if pending is not None:
                kv = _wait(pending)
        dkv = _wait(travelling)
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None


def _shift(t: torch.Tensor, cp: ContextParallel):
    """Sends `t` to the next rank of the ring and receives the previous rank's into a new buffer: (buffer, works)."""
    n, r = cp.size, cp.rank
    got = torch.empty_like(t)
    send_to, receive_from = (dist.get_global_rank(cp.group, (r + d) % n) for d in (1, -1))
    works = dist.batch_isend_irecv([dist.P2POp(dist.isend, t, send_to, cp.group),
                                    dist.P2POp(dist.irecv, got, receive_from, cp.group)])
    return got, works


def _wait(pending) -> torch.Tensor:
    got, works = pending
    for w in works:
        w.wait()
    return got


def _merge(out: torch.Tensor, lse: torch.Tensor, o: torch.Tensor, l: torch.Tensor) -> None:
    """Folds one block's (output, log-sum-exp) into the running ones, in place (fp32)."""
    new = torch.logaddexp(lse, l)
    seen = new > float("-inf")  # rows that have met a visible key so far
    keep = torch.where(seen, torch.exp(lse - new), 0.0)
    take = torch.where(seen, torch.exp(l - new), 0.0)
    out.mul_(keep.unsqueeze(-1)).add_(torch.nan_to_num(o.float()) * take.unsqueeze(-1))
    lse.copy_(new)


def _expand_kv(x: torch.Tensor, heads: int) -> torch.Tensor:
    """Grouped-query kv heads repeated to the query heads (the per-block kernels take equal head counts)."""
    g = heads // x.shape[1]
    return x if g == 1 else x.repeat_interleave(g, dim=1)


def _reduce_kv(g: torch.Tensor, kv_heads: int) -> torch.Tensor:
    B, H, T, D = g.shape
    return g if H == kv_heads else g.view(B, kv_heads, H // kv_heads, T, D).sum(2)


def _bias(kind, q: torch.Tensor):
    """(additive mask or None, is_causal) of a pair kind."""
    if isinstance(kind, str):
        return None, kind == CAUSAL
    zero = torch.zeros((), dtype=q.dtype, device=q.device)
    bias = torch.where(kind, zero, torch.tensor(float("-inf"), dtype=q.dtype, device=q.device))
    return bias.expand(q.shape[0], q.shape[1], *bias.shape[2:]), False


def _block_forward(q, k, v, kind) -> tuple[torch.Tensor, torch.Tensor]:
    """One block's attention output and log-sum-exp [B, H, Tq] (fp32) of queries q over keys k, values v."""
    k, v = _expand_kv(k, q.shape[1]), _expand_kv(v, q.shape[1])
    bias, causal = _bias(kind, q)
    if q.is_cuda:
        out, lse, _, _ = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, bias, True, 0.0, causal)
    else:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, attn_mask=bias)
    lse = lse[..., : q.shape[2]].float()
    if not isinstance(kind, str):  # rows that see no key of this block add nothing (the kernels report lse 0 there)
        lse = torch.where(kind.any(-1), lse, float("-inf"))
    return out, lse


def _block_backward(dout, q, k, v, out, lse, kind) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of one block's share of the merged attention: the kernels' backward, given the merged output and
    log-sum-exp, computes exactly the terms of this block's keys."""
    kv_heads = k.shape[1]
    k, v = _expand_kv(k, q.shape[1]), _expand_kv(v, q.shape[1])
    bias, causal = _bias(kind, q)
    if q.is_cuda:
        # The kernel's log-sum-exp is laid out in rows padded to a multiple of 32.
        padded = torch.nn.functional.pad(lse, (0, -q.shape[2] % 32)).contiguous()
        seed = offset = torch.zeros((), dtype=torch.int64, device=q.device)
        gq, gk, gv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
            dout, q, k, v, bias, out, padded, seed, offset, 0.0, [True, True, True, False], causal)
    else:
        gq, gk, gv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, causal, attn_mask=bias)
    return gq.float(), _reduce_kv(gk.float(), kv_heads), _reduce_kv(gv.float(), kv_heads)

"""The decoder every family is: token embedding, a stack of blocks (the family's), final RMSNorm, output head and
the cross-entropy loss. Reads top to bottom; parallelism, compilation and activation checkpointing are applied from
outside, and what levers plug in goes through `Hooks`, one owner per slot."""

from __future__ import annotations

import contextlib
import math
import os
import zlib
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from holotrain.errors import ConfigError
from holotrain.model.args import ModelArgs
from holotrain.model.head import fused_linear_cross_entropy, piece as head_piece
from holotrain.model.kvcache import KVCache
from holotrain.model.moe import MoE
from holotrain.model.parts import Attention, Block, FeedForward, RMSNorm, attention_mask, doc_positions
from holotrain.model.rope import rope_tables


# Linears that write into the residual stream: initialized with std / sqrt(2 * n_layers) (".w2": the experts'
# stacked down projections).
RESIDUAL_OUTPUTS = ("wo.weight", "w2.weight", ".w2")


class Hooks:
    """What levers plug into a model, each slot owned by one lever (a second owner is refused):

    run_blocks     memory (activation offload, recompute segments): run_blocks(blocks, h, cos, sin, mask) runs the
                   blocks, a list of (index, block), in turn and returns the last one's output; its `saves_to_host`
                   says whether what they save for backward leaves the device
    after_backward precision (delayed FP8): callables the training step runs after each backward
    loss           tensor parallelism: loss(h, targets), the vocabulary-parallel cross-entropy in place of the model's
    sequence       context parallelism: split(tokens, targets, doc_ids, T) spreads each sequence over the group
    loss_chunk_tokens  memory: > 0 takes the head and the loss in pieces of this many tokens
    tp_comm        tensor parallelism: its communicator, for levers that fuse into its collectives (FP8)
    experts        expert parallelism: experts(rows, counts, local) runs a mixture-of-experts layer's sorted token
                   copies through the experts held across the group (parallel/ep.py), `local` this rank's share
    grouped_mm     precision (FP8): grouped_mm(a, b_t, offs), the mixture-of-experts layers' grouped GEMM
    sequence_shards (through shard_sequence): the hidden state between blocks holds 1/this of each sequence's tokens
    """

    SLOTS = {"run_blocks": None, "after_backward": (), "loss": None, "sequence": None, "loss_chunk_tokens": 0,
             "tp_comm": None, "experts": None, "grouped_mm": None}

    def __init__(self):
        for slot, default in self.SLOTS.items():
            object.__setattr__(self, slot, default)
        object.__setattr__(self, "owners", {})
        object.__setattr__(self, "shards", {})

    def install(self, slot: str, value: Any, owner: str) -> None:
        if slot not in self.SLOTS:
            raise KeyError(f"a model has no hook {slot!r} (its hooks: {', '.join(self.SLOTS)})")
        held = self.owners.get(slot)
        if held is not None and held != owner:
            raise RuntimeError(f"the model's {slot} hook belongs to {held}; {owner} cannot take it")
        self.owners[slot] = owner
        object.__setattr__(self, slot, value)

    def shard_sequence(self, factor: int, owner: str) -> None:
        """A lever (tensor or context parallelism) that leaves each rank 1/factor of each sequence's tokens."""
        self.shards[owner] = factor

    @property
    def sequence_shards(self) -> int:
        return math.prod(self.shards.values())

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"hooks are installed with Hooks.install(slot, value, owner), not set ({name})")


class Decoder(nn.Module):
    def __init__(self, args: ModelArgs, block: Callable[[ModelArgs, int], nn.Module]):
        """block(args, index): the family's block at that depth (model/parts.py Block with its attention and
        feed-forward)."""
        super().__init__()
        self.args = args
        self.hooks = Hooks()
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        # A ModuleDict keyed by index keeps names stable when blocks are wrapped or pipelined.
        self.layers = nn.ModuleDict({str(i): block(args, i) for i in range(args.n_layers)})
        for moe in self.moe_modules().values():
            moe.hooks = self.hooks  # the experts hook (expert parallelism) is the model's, read by each MoE layer
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.tie_weights()
        cos, sin = rope_tables(args.head_dim, args.max_seq_len, args.rope_theta, scaling=args.rope_scaling)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        # A pipeline stage (keep_units) holds some of the modules, the others None; its forward returns its blocks'
        # output, and the pipeline schedule applies `loss` on the last stage.
        self.pipeline_stage = False
        # The loss's units, compiled in place by compile_regions.
        self._whole_loss, self._loss_piece = self._loss_sum_mean, head_piece
        self._masks: dict = {}  # the sliding window's mask by (length, device), for rows without documents
        if not self.output.weight.is_meta:  # a model built on "meta" is initialized after placement
            self.init_weights()

    def tie_weights(self) -> None:
        """With tie_embeddings, the head's weight is the embedding's (one parameter). Called again by levers that
        replace parameters one by one (tensor parallelism, and placement of a model built on "meta" outside FSDP2,
        whose to_empty makes each module's parameter anew)."""
        if self.args.tie_embeddings and self.output.weight is not self.tok_embeddings.weight:
            self.output.weight = self.tok_embeddings.weight

    @torch.no_grad()
    def init_rope(self) -> None:
        """The rotary tables (buffers not kept in checkpoints), once the model is placed; and the buffers that start
        at a fixed value (a sigmoid router's expert bias: zero until a checkpoint's replaces it)."""
        cos, sin = rope_tables(self.args.head_dim, self.args.max_seq_len, self.args.rope_theta, self.rope_cos.device,
                               self.args.rope_scaling)
        self.rope_cos.copy_(cos)
        self.rope_sin.copy_(sin)
        for moe in self.moe_modules().values():
            moe.reset_buffers()

    @torch.no_grad()
    def init_weights(self, seed: int | None = None) -> None:
        """Normal(0, 0.02); projections into the residual stream scaled by 1/sqrt(2 * n_layers).

        Values are drawn on the CPU, each parameter whole from its own generator (seeded by the run's seed and
        the parameter's name), whatever the device or sharding: a model sharded over any number of ranks starts
        from the same weights as a whole one. One generator per parameter lets the draws run on all host cores
        (a 7B is 6.7 G values: about 40 s on one core), a bounded window of them at a time.
        """
        std = 0.02
        residual_std = std / math.sqrt(2 * self.args.n_layers)

        def draw(name: str, p: torch.Tensor) -> torch.Tensor | None:
            """The parameter's values: drawn straight into a whole fp32 parameter on the host (None returned),
            else into a temporary that is returned, to be copied in."""
            in_place = type(p) is nn.Parameter and p.device.type == "cpu" and p.dtype == torch.float32
            full = p.data if in_place else torch.empty(p.shape, dtype=torch.float32)
            if name.endswith("norm.weight"):
                full.fill_(1.0)
            elif name.endswith(".bias"):
                full.zero_()
            else:
                generator = None
                if seed is not None:
                    # The plain model's name: wrappers (activation checkpointing, compile) do not change the weights.
                    plain = name.replace("._checkpoint_wrapped_module", "").replace("._orig_mod", "")
                    generator = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(plain.encode())) % 2**63)
                full.normal_(0.0, residual_std if name.endswith(RESIDUAL_OUTPUTS) else std,
                             generator=generator)
            return None if in_place else full

        params = list(self.named_parameters())
        workers = max(1, min(torch.get_num_threads(), os.cpu_count() or 1, 32))
        with ThreadPoolExecutor(workers) as pool, _single_threaded_ops():
            pending: deque = deque()
            for name, p in params:
                pending.append((p, pool.submit(draw, name, p)))
                if len(pending) >= 2 * workers:  # bounded: at most 2 x workers whole tensors in flight
                    _copy_drawn(pending.popleft())
            while pending:
                _copy_drawn(pending.popleft())
        self.init_rope()

    def layer_roles(self) -> dict[str, tuple]:
        """The modules this model holds, by path (a "*" for every block's index), with the role a lever gives them
        (tensor parallelism's plan): ("embedding",), ("head",), ("norm",) for an RMSNorm (the per-head q/k norms
        too), ("input_group", method, linears) for linears that read one input, returned together by `method`, and
        ("row",) for the linear that writes back into the residual stream."""
        if self.moe_modules():
            raise ConfigError(f"model.n_experts = {self.args.n_experts}: tensor parallelism does not split a "
                              "mixture-of-experts feed-forward yet; set parallel.tp = 1")
        roles = {name: role for name, role in (("tok_embeddings", ("embedding",)), ("norm", ("norm",)),
                                               ("output", ("head",))) if getattr(self, name) is not None}
        block = next(iter(self.layers.values()), None)
        for path, module in block.named_modules() if block is not None else ():
            if isinstance(module, RMSNorm):
                roles[f"layers.*.{path}"] = ("norm",)
            group = getattr(module, "input_group", None)
            if group is not None:
                roles[f"layers.*.{path}"] = ("input_group", *group)
                roles[f"layers.*.{path}.{module.output_linear}"] = ("row",)
        return roles

    def keep_units(self, first_unit: int, last_unit: int) -> Decoder:
        """Prunes this model to a pipeline stage of units first_unit..last_unit (unit 0: the embedding, 1..n_layers:
        the blocks, n_layers + 1: the final norm and the head); the blocks keep their names. Returns self."""
        if first_unit > 0:
            self.tok_embeddings = None
        for key in list(self.layers.keys()):
            if not first_unit <= int(key) + 1 <= last_unit:
                del self.layers[key]
        if last_unit <= self.args.n_layers:
            self.norm = None
            self.output = None
            if self.moe_modules() and (self.args.moe_aux_loss_coef or self.args.router_z_loss_coef):
                raise ConfigError("model.moe_aux_loss_coef / model.router_z_loss_coef > 0 reach the loss from the "
                                  "last pipeline stage's blocks only: set them to 0 or parallel.pp = 1")
        self.pipeline_stage = True
        return self

    def moe_modules(self) -> dict[str, MoE]:
        """The mixture-of-experts feed-forwards this model holds, by block index (wrappers seen through)."""
        return {key: m for key, block in self.layers.items() for m in block.modules() if isinstance(m, MoE)}

    def expert_load(self) -> torch.Tensor | None:
        """Token copies per expert of each MoE block in the last forward [MoE blocks, n_experts] (detached), or
        None before one (or in a dense model)."""
        loads = [m.last_load for m in self.moe_modules().values()]
        return torch.stack(loads) if loads and all(t is not None for t in loads) else None

    def update_router_bias(self, rate: float) -> None:
        """A sigmoid router's balancing step on every MoE block, from its last forward's load (MoE.update_bias)."""
        for m in self.moe_modules().values():
            m.update_bias(rate)

    def tile_feed_forward(self, tiles: int) -> None:
        """The memory lever's sequence tiling: each block's dense feed-forward runs its sequence in `tiles` pieces,
        each recomputed in backward from its input (parts.FeedForward; a mixture of experts is not tiled)."""
        for block in self.layers.values():
            for module in block.modules():
                if isinstance(module, FeedForward) and not any(isinstance(m, MoE) for m in block.modules()):
                    module.sequence_tiles = tiles

    def compile_regions(self) -> None:
        """Regional compilation: each block (identical code, compiled once) and the loss head (the whole loss, or the
        unit of a chunked one). Keeps parameter names, composes with FSDP2's per-block hooks, compiles in seconds."""
        for block in self.layers.values():
            block.compile()
        if self.hooks.loss_chunk_tokens:
            self._loss_piece = torch.compile(self._loss_piece)
        else:
            self._whole_loss = torch.compile(self._whole_loss)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None,
                doc_ids: torch.Tensor | None = None) -> torch.Tensor:
        """tokens: [B, T] int64 (on a pipeline stage without the embedding: the hidden state [B, T / sequence_shards,
        dim]). Returns logits [B, T, V], or the mean cross-entropy if targets are given (positions where targets are
        -100 are ignored); on a pipeline stage, the hidden state after its blocks.

        doc_ids: optional [B, T] int64, non-decreasing along T, the document of each token in a packed row.
        With it, positions restart at every document and no token attends across documents.
        """
        T = tokens.shape[1] * (1 if self.tok_embeddings is not None else self.hooks.sequence_shards)
        weight = None
        if self.hooks.sequence is not None:
            # This rank's share of the sequence, its positions, and the attention that spans the group.
            tokens, targets, pos, mask, weight = self.hooks.sequence.split(tokens, targets, doc_ids, T)
            cos, sin = self.rope_cos[pos], self.rope_sin[pos]
        else:
            if doc_ids is None:
                cos, sin = self.rope_cos[:T], self.rope_sin[:T]
            else:
                pos = doc_positions(doc_ids)
                cos, sin = self.rope_cos[pos], self.rope_sin[pos]  # [B, T, D]
            # Shared by every block: built once per forward, or once per run where only the length decides it.
            mask = (attention_mask(doc_ids, self.args.sliding_window, T, tokens.device) if doc_ids is not None
                    else self._fixed_mask(T, tokens.device))
        h = tokens if self.tok_embeddings is None else self.tok_embeddings(tokens)
        if torch.is_autocast_enabled(h.device.type):
            # Carry the residual stream in the autocast dtype (bf16), as FSDP2's bf16 parameters do:
            # every norm and residual add then moves half the bytes.
            h = h.to(torch.get_autocast_dtype(h.device.type))
        if self.hooks.run_blocks is None:
            for block in self.layers.values():
                h = block(h, cos, sin, mask)
        else:
            h = self.hooks.run_blocks(list(enumerate(self.layers.values())), h, cos, sin, mask)
        if self.pipeline_stage:
            return h
        if targets is None:
            return self.output(self.norm(h))
        loss = self.loss(h, targets)
        # Under context parallelism: this rank's mean, weighted so that the group's gradients average to the
        # sequence's mean over all its targets.
        return loss if weight is None else loss * weight

    @torch.no_grad()
    def decode(self, tokens: torch.Tensor, cache: KVCache, position: torch.Tensor | None = None) -> torch.Tensor:
        """Generation: the logits [B, 1, V] of the last of `tokens` [B, n], which continue the positions `cache`
        holds (the prompt at first, then one token at a time); their keys and values join the cache. `position`:
        None, the cache's own count (attending over the positions filled; the cache advances), or a device tensor []
        where `tokens` start (attending over the whole cache under the mask: the same shapes at every position, as a
        CUDA graph of the step needs, kvcache.TokenSteps; the caller advances the cache)."""
        n, device = tokens.shape[1], tokens.device
        if position is None:
            start = cache.length
            query, key = torch.arange(start, start + n, device=device), torch.arange(start + n, device=device)
            cos, sin = self.rope_cos[start:start + n], self.rope_sin[start:start + n]
        else:
            query, key = position + torch.arange(n, device=device), torch.arange(cache.capacity, device=device)
            cos, sin = self.rope_cos[query], self.rope_sin[query]
            cache.writing = query
        mask = key[None, :] <= query[:, None]
        if self.args.sliding_window:
            mask &= query[:, None] - key[None, :] < self.args.sliding_window
        h = self.tok_embeddings(tokens).to(self.output.weight.dtype)
        for i, block in enumerate(self.layers.values()):
            h = block(h, cos, sin, mask[None, None], cache.layers[i])
        if position is None:
            cache.length += n
        cache.writing = None
        return self.output(self.norm(h[:, -1:]))

    def _fixed_mask(self, T: int, device: torch.device):
        """The mask of rows without documents: None (plain causal), or the sliding window's, made once per length."""
        if not self.args.sliding_window:
            return None
        key = (T, device)
        if key not in self._masks:
            self._masks[key] = attention_mask(None, self.args.sliding_window, T, device)
        return self._masks[key]

    def loss(self, h: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Final norm, output head and mean cross-entropy (in fp32) over targets other than -100.

        With the loss_chunk_tokens hook > 0 and more tokens than that, the norm, the head and the cross-entropy are
        fused and taken in pieces of that many tokens (model/head.py): the fp32 logits of only one piece exist at a
        time, in forward and backward, and nothing is recomputed (a 1.4b's micro-batch of 16 x 2048 tokens: ~10 GB
        less).
        The result is the same mean. Tensor parallelism installs its own (the loss hook).
        """
        if self.hooks.loss is not None:
            return self._with_aux(self.hooks.loss(h, targets))
        h, targets = h.flatten(0, 1), targets.flatten(0, 1)
        n = self.hooks.loss_chunk_tokens
        if n <= 0 or h.shape[0] <= n:
            return self._with_aux(self._whole_loss(h, targets))
        total, count = fused_linear_cross_entropy(h, self.output.weight, targets, n, self._loss_piece,
                                                  norm=(self.norm.weight, self.norm.with_weight))
        return self._with_aux(total / count.clamp(min=1))

    def _with_aux(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss with the MoE blocks' auxiliary terms of this forward (moe_aux_loss_coef, router_z_loss_coef > 0)
        in its gradient, not in its value: loss + (aux - aux.detach()). The value stays the cross-entropy (an eval,
        which runs this same forward, and the logged loss compare with a dense model's); backward differentiates
        cross-entropy + aux, scaled as the loss is (gradient accumulation, context parallelism's weight). Each
        block's term is consumed (cleared) here; its value is in MoE.last_aux."""
        terms = []
        for moe in self.moe_modules().values():
            if moe.aux_loss is not None:
                terms.append(moe.aux_loss)
                moe.aux_loss = None
        if not terms:
            return loss
        aux = torch.stack(terms).sum().to(loss.dtype)
        return loss + (aux - aux.detach())

    def _loss_sum_mean(self, h: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        total, count = self.loss_sum(h, targets)
        # A micro-batch with no target (a chat sample whose assistant turns fall elsewhere) adds zero, not NaN.
        return total / count.clamp(min=1)

    def loss_sum(self, h: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(sum of the cross-entropies, number of targets other than -100) of tokens h [N, D]: the unit that is
        compiled into few kernels."""
        logits = self.output(self.norm(h))
        total = F.cross_entropy(logits.float(), targets, ignore_index=-100, reduction="sum")
        return total, (targets != -100).sum()


def dense_block(args: ModelArgs, layer: int = 0) -> Block:
    """The block every family has so far: attention (with whatever q/k norm, biases and window `args` switch on) and
    the SwiGLU feed-forward, or the mixture of experts where `args` puts one at this depth (args.moe_layer)."""
    return Block(args, Attention(args), MoE(args) if args.moe_layer(layer) else FeedForward(args))


def build_dense(args: ModelArgs) -> Decoder:
    """The decoder of dense_block: the dense families', and the mixture-of-experts families' (args.n_experts > 0)."""
    return Decoder(args, dense_block)


def _copy_drawn(item) -> None:
    param, future = item
    full = future.result()
    if full is not None:  # None: drawn in place
        _copy_full_into(param, full)


@contextlib.contextmanager
def _single_threaded_ops():
    """Intra-op threads off while a pool of threads does the parallel work (no oversubscription)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _copy_full_into(param: torch.Tensor, full: torch.Tensor) -> None:
    """Copy a whole (unsharded) tensor into a parameter, which may be a DTensor shard (FSDP2)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(param, DTensor):
        # src_data_rank=None: every rank holds the same full tensor and keeps its own slice, no communication.
        full = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
    param.copy_(full)


def num_params(model: nn.Module, exclude_embedding: bool = False) -> int:
    n = sum(p.numel() for p in model.parameters())
    if exclude_embedding:
        n -= model.tok_embeddings.weight.numel()
    return n

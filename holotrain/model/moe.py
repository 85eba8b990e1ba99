"""The mixture-of-experts feed-forward (Qwen3-MoE, Mixtral; DeepSeek-V3's sigmoid router as an option): a router
picks n_active_experts of n_experts SwiGLU experts per token, the token's copies are sorted by expert, the experts
run as grouped GEMMs over the sorted rows (no token dropped, no capacity), and the outputs go back to their tokens,
summed with the routing weights.

The steps are separate methods, so that expert parallelism (parallel/ep.py) can replace the middle one alone:

    route        x [N, D] -> weights [N, k], experts [N, k], logits [N, E], scores [N, E]
    permute      the N * k token copies sorted by expert, the count per expert [E], the order that sorted them
    run_experts  the sorted rows through their experts (an expert-parallel wrapper: dispatch, the local experts'
                 grouped_swiglu over its weights' shard, combine)
    unpermute    the outputs back in token order, weighted and summed over each token's k experts

Each forward keeps what later metrics and the router-bias update read: `last_load` [E] (token copies per expert,
detached), `last_aux` [2] (the load-balancing and z-loss values, detached), `last_entropy` and `last_top_gate` (the
mean routing entropy and the mean share of a token's largest weight in its k), `last_scores` (with
router_bias_update "solve": up to SOLVE_ROWS rows of the scores the bias is added to, of a training forward,
detached), `last_bias` (with "batch": the bias that forward solved), and `aux_loss`, the weighted auxiliary term with its graph (when a coefficient is > 0), which the decoder's loss takes into the training gradient
(decoder.Decoder.loss) and clears. Expert weights are stacked 3-D parameters, w1 (gate) and w3 (up) [E, F, D] and
w2 (down) [E, D, F], as Hugging Face's per-expert linears stacked (model/hf.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from holotrain.model.args import ModelArgs
from holotrain.model.parts import FeedForward

ROUTERS = ("softmax", "sigmoid")
# How a router's balancing bias moves (model.router_bias_update): after each step by the sign rule or solved from the
# step's scores (train/routing.py), or solved within each training forward on that forward's own scores ("batch").
BIAS_UPDATES = ("sign", "solve", "batch")
# A solved bias reads at most this many token rows of a forward's scores (evenly spaced over the batch's sequences).
SOLVE_ROWS = 4096
# A bias solved within a forward starts from the step's bias (last step's solution): this many rounds of
# balancing_bias, each halving every expert's distance to its balancing bias.
BATCH_ROUNDS = 16


def moe_problem(args: ModelArgs) -> str | None:
    """What is wrong with the arguments' mixture-of-experts fields (one line), or None."""
    if not args.n_experts:
        return None
    if args.n_experts < 0:
        return f"model.n_experts must be >= 0, got {args.n_experts}"
    if not 1 <= args.n_active_experts <= args.n_experts:
        return (f"model.n_active_experts = {args.n_active_experts} must be between 1 and model.n_experts = "
                f"{args.n_experts}")
    if args.moe_ffn_dim <= 0:
        return f"model.moe_ffn_dim must be positive, got {args.moe_ffn_dim}"
    if args.shared_ffn_dim < 0:
        return f"model.shared_ffn_dim must be >= 0 (0: no shared experts), got {args.shared_ffn_dim}"
    if args.router not in ROUTERS:
        return f"model.router must be one of {', '.join(ROUTERS)}, got {args.router!r}"
    if args.router_bias_weights and not (args.router == "softmax" and args.router_bias):
        return ("model.router_bias_weights = true needs the softmax router with its balancing bias "
                "(model.router = 'softmax', model.router_bias = true)")
    if args.moe_every < 1:
        return f"model.moe_every must be >= 1, got {args.moe_every}"
    if any(not 0 <= i < args.n_layers for i in args.dense_layers):
        return f"model.dense_layers {list(args.dense_layers)} must be block indices below {args.n_layers}"
    for key in ("moe_aux_loss_coef", "router_z_loss_coef"):
        if getattr(args, key) < 0:
            return f"model.{key} must be >= 0, got {getattr(args, key)}"
    return None


class Router(nn.Module):
    """The router's linear (dim -> n_experts, no bias). Not an nn.Linear: the FP8 lever leaves it in the compute
    dtype (a routing decision is not worth an FP8 cast)."""

    def __init__(self, dim: int, n_experts: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_experts, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


def grouped_swiglu(x: torch.Tensor, counts: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor,
                   grouped: bool | None = None, mm=None) -> torch.Tensor:
    """Rows x [M, D] sorted by expert, counts [E] rows per expert (summing to M), through each expert's SwiGLU
    w2[e] (silu(w1[e] x) * w3[e] x): [M, D]. `grouped` (None: on CUDA in bf16) runs three grouped GEMMs over all
    experts with the row counts' offsets and no host synchronization: `mm(a, b_t, offs)`, torch._grouped_mm unless
    a lever gives another (the FP8 lever's scaled grouped GEMM); else the reference: a loop over the experts' row
    blocks (torch.split at the counts, read on the host). An `mm` with a `row_alignment` attribute (FP8's GEMMs
    want each expert's rows a multiple of 16) gets the rows padded once for the three GEMMs (pad_groups)."""
    if grouped is None:
        grouped = x.is_cuda and x.dtype == torch.bfloat16
    # In x's dtype whatever autocast says (it would run the grouped GEMMs in fp32): the weights cast to it.
    with torch.autocast(x.device.type, enabled=False):
        w1, w3, w2 = (w.to(x.dtype) for w in (w1, w3, w2))
        if grouped:
            mm = mm or _grouped_mm
            align = getattr(mm, "row_alignment", 1)
            rows = None
            if align > 1:
                x, counts, rows = pad_groups(x, counts, align)
            offs = counts.cumsum(0).to(torch.int32)
            gate = mm(x, w1.transpose(-2, -1), offs)
            up = mm(x, w3.transpose(-2, -1), offs)
            out = mm(F.silu(gate) * up, w2.transpose(-2, -1), offs)
            return out if rows is None else out[rows]
        parts = [F.linear(F.silu(F.linear(rows, a)) * F.linear(rows, b), c)
                 for rows, a, b, c in zip(x.split(counts.tolist()), w1, w3, w2)]
        return torch.cat(parts) if parts else x.new_zeros(0, w2.shape[1])


def pad_groups(x: torch.Tensor, counts: torch.Tensor, align: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows x [M, D] sorted into groups of `counts` rows, each group moved to start at a multiple of `align` with
    zero rows after it: (the padded rows, the padded counts, each original row's index in the padded rows, with
    which padded[rows] is x again). The padded tensor has a static size, M + E * (align - 1) rounded up to a multiple
    of `align` (the weight gradient's GEMM reads the rows transposed: its row stride is that size), so nothing is
    read on the host; the rows past the last group are zeros that no GEMM reads. Zero rows add nothing to a
    weight's gradient and their outputs are dropped."""
    n_rows, n_groups = x.shape[0], counts.numel()
    padded = (counts + align - 1) // align * align
    group = torch.repeat_interleave(torch.arange(n_groups, device=x.device), counts, output_size=n_rows)
    shift = (padded.cumsum(0) - padded) - (counts.cumsum(0) - counts)
    rows = torch.arange(n_rows, device=x.device) + shift[group]
    size = -(-(n_rows + n_groups * (align - 1)) // align) * align
    out = x.new_zeros(size, x.shape[1]).index_put((rows,), x)
    return out, padded, rows


def _grouped_mm(a: torch.Tensor, b_t: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    return torch._grouped_mm(a, b_t, offs=offs)


def load_balance_loss(scores: torch.Tensor, counts: torch.Tensor, router: str = "softmax") -> torch.Tensor:
    """Switch Transformer's load-balancing loss, E * sum_e f_e * P_e: f_e the share of the token copies routed to
    expert e (counts / their sum, no gradient), P_e the mean over tokens of e's routing probability (the softmax; a
    sigmoid router's scores normalized per token). 1 when both are uniform."""
    probs = scores if router == "softmax" else scores / scores.sum(-1, keepdim=True)
    share = counts.float() / counts.sum().clamp(min=1)
    return scores.shape[-1] * (share * probs.float().mean(0)).sum()


def balancing_bias(scores: torch.Tensor, bias: torch.Tensor, k: int, rounds: int = 16) -> torch.Tensor:
    """The per-expert bias [E] with which each row's top k of scores + bias (scores [N, E]) gives every expert N * k / E
    rows, found from `bias` as the start: in each round, every expert's bias moves halfway to the one at which that
    share of rows would take it, the others' held (for each row, the bias it needs to enter the row's top k: the k-th
    largest of the row's other biased scores less its own score; the expert's new bias lies between the share's and
    the next order statistic of those). Reads only per-row and per-expert order statistics, so the rows' order does
    not matter. Centered (a shift of every bias changes no choice). Unchanged when there are too few rows.
    Batched over leading dimensions: scores [..., N, E] and bias [..., E] (several blocks' in one pass: each round is
    a few kernels whatever the count, which matters when it runs after every step)."""
    n_rows, n_experts = scores.shape[-2:]
    share = n_rows * k // n_experts
    if share < 1 or share >= n_rows or k >= n_experts:
        return bias.clone()
    scores, bias = scores.float(), bias.float().clone()
    for _ in range(rounds):
        biased = scores + bias.unsqueeze(-2)
        top = biased.topk(k + 1, dim=-1).values
        kth, next_ = top[..., k - 1:k], top[..., k:k + 1]
        # A chosen expert's rivals' k-th largest is the row's (k+1)-th; an unchosen one's, the row's k-th.
        needed = torch.where(biased >= kth, next_, kth) - scores
        low = needed.topk(share + 1, dim=-2, largest=False).values  # ascending: the share-th and the next
        bias += 0.5 * (0.5 * (low[..., share - 1, :] + low[..., share, :]) - bias)
        bias -= bias.mean(-1, keepdim=True)
    return bias


def router_z_loss(logits: torch.Tensor) -> torch.Tensor:
    """ST-MoE's router z-loss: the mean over tokens of logsumexp(logits)^2 (keeps the logits small)."""
    return torch.logsumexp(logits.float(), dim=-1).square().mean()


class MoE(nn.Module):
    """The mixture-of-experts feed-forward of one block (see the module's docstring)."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        E, F_, D = args.n_experts, args.moe_ffn_dim, args.dim
        self.n_experts, self.top_k, self.router_kind = E, args.n_active_experts, args.router
        self.norm_topk_prob = args.norm_topk_prob
        self.aux_coef, self.z_coef = args.moe_aux_loss_coef, args.router_z_loss_coef
        self.router = Router(D, E)
        self.w1 = nn.Parameter(torch.empty(E, F_, D))  # gate
        self.w3 = nn.Parameter(torch.empty(E, F_, D))  # up
        self.w2 = nn.Parameter(torch.empty(E, D, F_))  # down
        self.shared = (FeedForward(ModelArgs(dim=D, ffn_dim=args.shared_ffn_dim, n_heads=0))
                       if args.shared_ffn_dim else None)
        if args.router == "sigmoid" or args.router_bias:
            # DeepSeek-V3's auxiliary-loss-free balancing: added to the scores (a softmax router's logits) for the
            # choice only; moved by the trainer after each step, or solved in each training forward ("batch").
            self.register_buffer("expert_bias", torch.zeros(E, dtype=torch.float32))
        else:
            self.expert_bias = None
        self.bias_update = args.router_bias_update
        self.bias_weights = args.router_bias_weights
        if self.expert_bias is not None and self.bias_update == "batch":
            # Whether a grad-mode forward chooses with the bias it solves on its tokens (a training forward), or with
            # expert_bias (an evaluation: it runs in grad mode too, to reuse training's compiled graphs). A tensor,
            # not a Python flag, so that compiled code reads it without a guard; train/routing.py sets it around
            # each step. Not saved.
            self.register_buffer("balancing", torch.ones((), dtype=torch.bool), persistent=False)
        self.hooks = None  # the decoder's Hooks (its `experts` slot: expert parallelism), set by the decoder
        self.copies: tuple[torch.Tensor, ...] | None = None  # bf16 w1, w3, w2 held over a step (ExpertCopies)
        self.grouped: bool | None = None  # grouped_swiglu's path (None: grouped GEMMs on CUDA in bf16)
        # Of the last forward: token copies per expert [E], (load balance, z-loss) values, the mean over tokens of
        # the routing distribution's entropy (nats; the trainer's routing metrics), the weighted aux term.
        self.last_load: torch.Tensor | None = None
        self.last_aux: torch.Tensor | None = None
        self.last_entropy: torch.Tensor | None = None
        self.last_top_gate: torch.Tensor | None = None
        self.last_scores: torch.Tensor | None = None
        self.last_bias: torch.Tensor | None = None  # the bias a "batch" forward solved and chose with
        self.aux_loss: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        weights, experts, logits, scores = self.route(x)
        rows, counts, order = self.permute(x, experts)
        # Weights shaped as the input's tokens, so that the output is made in x's shape (not a view of another
        # tensor: FSDP2 warns of a wrapped module's view outputs).
        out = self.unpermute(self.run_experts(rows, counts), order, weights.view(*shape[:-1], self.top_k))
        if self.shared is not None:
            out = out + self.shared(x).view(shape)
        self.record(logits, scores, counts, weights)
        return out

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Each token's k experts [N, k] and their weights [N, k] (x's dtype), with the router's logits [N, E] and
        scores [N, E] (fp32: softmax probabilities, or sigmoid scores) for the auxiliary losses. With a balancing
        bias the choice is the top k of the scores (a softmax router's logits) + the bias, the weights the scores of
        the chosen experts (router_bias_weights: the softmax of the biased logits)."""
        logits = self.router(x)
        if self.router_kind == "softmax":
            # Mixtral's softmax over the top-k logits is this with norm_topk_prob.
            scores = logits.float().softmax(dim=-1)
            biased = logits.float()  # the softmax's order, on a scale where a bias means the same for every token
        else:
            scores = logits.float().sigmoid()
            biased = scores
        if self.expert_bias is None:
            weights, experts = scores.topk(self.top_k, dim=-1)
        else:
            bias = self.expert_bias
            if torch.is_grad_enabled():  # a training forward (or its recomputation: the same bias again)
                sample = biased.detach()
                stride = -(-sample.shape[0] // SOLVE_ROWS)
                if self.bias_update == "solve":  # kept for the solve after the step (train/routing.py)
                    self.last_scores = sample[::stride].contiguous() if stride > 1 else sample
                elif self.bias_update == "batch":
                    # This forward's own tokens balanced, from the step's bias: the trainer keeps the solution
                    # for evaluation, generation and the next step's start.
                    self.last_bias = balancing_bias(sample[::stride], bias, self.top_k, BATCH_ROUNDS)
                    bias = torch.where(self.balancing, self.last_bias, bias)
            chosen_by = biased + bias
            experts = chosen_by.topk(self.top_k, dim=-1).indices
            # With router_bias_weights the balanced choice is weighted by the biased logits' softmax.
            weights = (chosen_by.softmax(dim=-1) if self.bias_weights else scores).gather(-1, experts)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), experts, logits, scores

    def permute(self, x: torch.Tensor, experts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The N * k token copies sorted by expert [N * k, D] (stable: each expert's in token order), the count per
        expert [E], and `order`: the copy (token * k + slot) each sorted row is."""
        flat = experts.flatten()
        order = flat.argsort(stable=True)
        counts = torch.zeros(self.n_experts, dtype=torch.int64, device=x.device)
        counts.scatter_add_(0, flat, torch.ones_like(flat))
        return x[order // self.top_k], counts, order

    def run_experts(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """The sorted rows through their experts: here, or under expert parallelism (the decoder's `experts` hook,
        parallel/ep.py) sent to the ranks holding their experts, run there by `local` with that rank's share of the
        weights (a DTensor's local shard: the experts of that rank), and sent back."""
        if self.copies is not None:
            w1, w3, w2 = self.copies
        else:
            w1, w3, w2 = (w.to_local() if isinstance(w, DTensor) else w for w in (self.w1, self.w3, self.w2))

        mm = self.hooks.grouped_mm if self.hooks is not None else None

        def local(rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
            return grouped_swiglu(rows, counts, w1, w3, w2, self.grouped, mm)

        exchange = self.hooks.experts if self.hooks is not None else None
        return local(rows, counts) if exchange is None else exchange(rows, counts, local)

    def unpermute(self, out: torch.Tensor, order: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """The experts' outputs [N * k, D] (sorted as permute left them) back in token order, each token's k summed
        with their weights [..., k] (the N tokens in any shape): [..., D]."""
        copies = torch.empty_like(out).index_copy(0, order, out).view(*weights.shape, -1)
        # Summed in fp32, returned in the experts' dtype whatever autocast says: CUDA's autocast runs a sum in fp32
        # and returns fp32, which would take the residual stream out of bf16 from this block on (and every later
        # block's experts off the grouped GEMMs).
        with torch.autocast(out.device.type, enabled=False):
            return (copies * weights.unsqueeze(-1).to(out.dtype)).sum(dim=-2, dtype=torch.float32).to(out.dtype)

    def record(self, logits: torch.Tensor, scores: torch.Tensor, counts: torch.Tensor, weights: torch.Tensor) -> None:
        """This forward's load, auxiliary losses, routing entropy and top gate share (see the module's docstring);
        nothing of them under no_grad (generation) but the load."""
        self.last_load = counts.detach()
        self.aux_loss = None
        if not torch.is_grad_enabled():
            return
        weighted = self.aux_coef > 0 or self.z_coef > 0
        with torch.set_grad_enabled(weighted):
            balance = load_balance_loss(scores, counts, self.router_kind)
            z = router_z_loss(logits)
        self.last_aux = torch.stack([balance, z]).detach()
        with torch.no_grad():
            # The distribution the balance loss reads: softmax probabilities, or sigmoid scores normalized per token.
            probs = scores if self.router_kind == "softmax" else scores / scores.sum(-1, keepdim=True)
            self.last_entropy = -torch.xlogy(probs, probs).sum(-1).mean()
            # The largest of a token's k weights over their sum, averaged over tokens: 1/k when the k experts count
            # alike in the output, near 1 when one expert makes it (the others chosen but hardly weighted).
            w = weights.float()
            self.last_top_gate = (w.max(-1).values / w.sum(-1).clamp(min=1e-30)).mean()
        if weighted:
            self.aux_loss = self.aux_coef * balance + self.z_coef * z

    @torch.no_grad()
    def update_bias(self, rate: float, load: torch.Tensor | None = None) -> None:
        """The sigmoid router's balancing step (DeepSeek-V3), for the trainer after an optimizer step:
        bias += rate * sign(mean load - load), over `load` [E] (default: the last forward's; a trainer sums its
        micro-batches' and its data-parallel ranks')."""
        if self.expert_bias is None:
            raise ValueError("update_bias: this router has no expert bias (model.router = 'sigmoid' or "
                             "model.router_bias = true has)")
        load = (self.last_load if load is None else load).float()
        self.expert_bias += rate * torch.sign(load.mean() - load)

    def shard_experts(self, mesh) -> None:
        """Expert parallelism (parallel/ep.py): the expert weights become DTensors split by expert (dim 0) over
        `mesh`, each rank keeping its E / ep (a model built on "meta": no values move)."""
        from torch.distributed.tensor import Shard, distribute_tensor

        for name in ("w1", "w3", "w2"):
            full = getattr(self, name)
            self.register_parameter(name, nn.Parameter(
                distribute_tensor(full.detach(), mesh, [Shard(0)], src_data_rank=None), full.requires_grad))

    @torch.no_grad()
    def reset_buffers(self) -> None:
        """The expert bias starts at zero (a model built on "meta" and placed holds garbage)."""
        if self.expert_bias is not None:
            self.expert_bias.zero_()
        if self.bias_update == "batch" and self.expert_bias is not None:
            self.balancing.fill_(True)


class ExpertCopies:
    """One device, bf16 autocast over fp32 weights: every MoE block's expert weights cast to bf16 once per optimizer
    step instead of at each micro-batch's forward, and their gradients summed over the step's micro-batches on those
    copies (in bf16, as autograd accumulates a leaf's), then handed to the fp32 weights once, before clipping and the
    optimizer. The experts hold most of a MoE model's weights, and the per-micro-batch cast, the gradient's cast
    back and its fp32 sum are memory passes over all of them at every micro-batch. With one micro-batch a step the
    numerics are those of the cast under autocast; with several, the gradient's sum rounds to bf16 at each one.

    Made when the trainer's step is built, after any checkpoint is loaded; the step calls `hand_over` before the
    optimizer and `refresh` after it, so that the copies hold the weights the next forward (an evaluation's too) must
    see. Code that changes the weights in place between steps calls `refresh`."""

    def __init__(self, blocks: list[MoE], dtype: torch.dtype = torch.bfloat16):
        self.blocks = blocks
        for moe in blocks:
            moe.copies = tuple(w.detach().to(dtype).requires_grad_() for w in (moe.w1, moe.w3, moe.w2))

    @staticmethod
    def applies(model: nn.Module) -> list[MoE]:
        """The blocks whose expert weights are plain fp32 parameters (not DTensors: sharded weights take FSDP2's
        or expert parallelism's path; not in bf16: nothing to cast)."""
        blocks = list(model.moe_modules().values()) if hasattr(model, "moe_modules") else []
        ok = all(isinstance(w, nn.Parameter) and not isinstance(w, DTensor) and w.dtype == torch.float32
                 for moe in blocks for w in (moe.w1, moe.w3, moe.w2))
        return blocks if ok else []

    @torch.no_grad()
    def refresh(self) -> None:
        for moe in self.blocks:
            for copy, w in zip(moe.copies, (moe.w1, moe.w3, moe.w2)):
                copy.copy_(w)

    def hand_over(self) -> None:
        """The copies' summed gradients onto the fp32 weights (added to any already there), one weight at a time."""
        for moe in self.blocks:
            for copy, w in zip(moe.copies, (moe.w1, moe.w3, moe.w2)):
                if copy.grad is None:
                    continue
                if w.grad is None:
                    w.grad = copy.grad.float()
                else:
                    w.grad.add_(copy.grad)
                copy.grad = None

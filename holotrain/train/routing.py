"""A mixture-of-experts model's routing, made visible, and the balancing bias's step (DeepSeek-V3's
auxiliary-loss-free bias update), for the training loop.

Each MoE block keeps its last forward's load, balance and z-loss values and routing entropy (model/moe.py). Here
they are taken, on the device, as each micro-batch's forward returns (a forward hook on each of this rank's stages:
under pipeline parallelism the schedule runs the micro-batches itself), added up after the step, then summed over the
ranks that hold the same blocks and route other tokens (data and context parallel): one collective, at every step
for a router with a balancing bias (its update needs the whole step's load, the same on every rank, so that the bias
buffers stay identical), else at logged steps only. A logged step gathers the pipeline stages' blocks and reads the table to the host once: the
row's moe.* fields (`metrics`). The load is in token copies: each token counts once for each of its k experts."""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from holotrain.model.moe import balancing_bias
from holotrain.parallel import DistEnv
from holotrain.parallel.dims import ParallelDims

# Columns after the E loads: the sums over forwards of the entropy, balance loss, z-loss and top gate share, and the
# forwards counted.
ENTROPY, BALANCE, Z, TOP_GATE, FORWARDS = range(5)


class Routing:
    """The moe.* fields and the bias update of a model with MoE blocks; does nothing for a dense one."""

    def __init__(self, model: torch.nn.Module, rate: float, env: DistEnv, dims: ParallelDims):
        args = model.args
        self.rate, self.biased, update = rate, args.router == "sigmoid" or args.router_bias, args.router_bias_update
        self.solve = self.biased and update == "solve"
        self.in_batch = self.biased and update == "batch"  # each forward solved its own bias (model/moe.py)
        self.scores: dict[int, list[torch.Tensor]] = {}  # per held MoE module (id): this step's sampled scores
        self.layers = [i for i in range(args.n_layers) if args.moe_layer(i)]  # every MoE block, on any stage
        self.n_experts = args.n_experts
        # One row per MoE block of the whole model: loads [E], then the ENTROPY.. FORWARDS columns. This rank fills
        # its stages' rows only.
        self.sums = torch.zeros(len(self.layers), self.n_experts + FORWARDS + 1, dtype=torch.float64, device=env.device)
        self.held: list[tuple[int, torch.nn.Module]] = []  # (row, MoE module) of this rank's stages
        self._handles = []
        self.taken: list[tuple[int, int, list[torch.Tensor]]] = []  # per stage: its rows lo..hi, this step's forwards'
        row_of = {layer: row for row, layer in enumerate(self.layers)}
        for stage in getattr(model, "stages", None) or [model]:
            moes = sorted(stage.moe_modules().items(), key=lambda kv: int(kv[0])) if self.layers else []
            if not moes:
                continue
            rows = [row_of[int(key)] for key, _ in moes]  # consecutive: a stage holds a range of blocks
            self.held += list(zip(rows, (m for _, m in moes)))
            self.taken.append((rows[0], rows[-1] + 1, []))
            self._handles.append(stage.register_forward_hook(
                functools.partial(self._take, self.taken[-1][2], [m for _, m in moes])))
        # A pipeline's first step runs each stage once more, first, to infer its shapes (torch.distributed.pipelining's
        # metadata inference, on empty tensors past the first stage): only a step's last n_microbatches count.
        self.micro_batches = getattr(getattr(model, "pipeline", None), "n_microbatches", None)
        self.collecting = False  # only the training step's forwards count (evals run the same forward)
        self.reduced = False
        self.world = env.world_size
        self.group = _replica_group(dims, env) if self.layers else None
        pp_mesh = getattr(model, "pp_mesh", None)  # parallel/pp.py's PipelineModel: the stages' ranks
        self.pp_group = pp_mesh.get_group() if pp_mesh is not None and self.layers else None

    def begin_step(self) -> None:
        if self.layers:
            self.collecting, self.reduced = True, False
            self._balance_in_forward(True)

    def end_step(self) -> None:
        """After the optimizer step: the step's figures added up, and each block's balancing bias moved: by rate *
        sign(mean - load), over the load of the step's micro-batches and ranks ("sign"), solved from the step's scores
        ("solve"), or to the last forward's own solution ("batch"), the same on every rank."""
        self.collecting = False
        self._balance_in_forward(False)  # evaluations between steps route with the kept bias
        for lo, hi, forwards in self.taken:
            kept = forwards[-self.micro_batches:] if self.micro_batches else forwards
            self.sums[lo:hi] = torch.stack(kept).sum(0) if kept else 0.0
            forwards.clear()
        if self.solve and self.held:
            self._solve_bias()
        elif self.in_batch and self.held:
            self._set_biases(torch.stack([moe.last_bias if moe.last_bias is not None else moe.expert_bias
                                          for _, moe in self.held]))
        elif self.biased and self.rate > 0 and self.held:
            self._reduce()
            for row, moe in self.held:
                moe.update_bias(self.rate, self.sums[row, :self.n_experts])

    def metrics(self) -> dict:
        """Collective (every rank, at a logged step): the logged step's moe.* fields, {} for a dense model."""
        if not self.layers:
            return {}
        self._reduce()
        E = self.n_experts
        table = self.sums.clone()
        table[:, E:E + FORWARDS] /= table[:, E + FORWARDS:].clamp(min=1)  # sums over forwards and ranks -> means
        for row, moe in self.held:  # the bias's spread, in the forwards column (read no more)
            table[row, E + FORWARDS] = moe.expert_bias.abs().max() if moe.expert_bias is not None else 0.0
        if self.pp_group is not None:
            dist.all_reduce(table, group=self.pp_group)  # each block's row is filled on one pipeline rank
        values = table.tolist()  # the one host synchronization
        loads = [v[:E] for v in values]
        ratios = [max(load) / (sum(load) / E) if sum(load) else None for load in loads]
        entropy, balance, z, top_gate = ([v[E + c] for v in values] for c in (ENTROPY, BALANCE, Z, TOP_GATE))
        row = {
            "moe.max_load": max((r for r in ratios if r is not None), default=None),  # the worst block's max / mean
            "moe.router_entropy": _mean(entropy),
            "moe.balance_loss": _mean(balance),
            "moe.z_loss": _mean(z),
            "moe.top_gate": _mean(top_gate),  # a token's largest weight over its k weights' sum, mean over tokens
            "moe.layers": self.layers,  # the blocks the per-layer lists below are of
            "moe.load_max_over_mean": ratios,
            "moe.router_entropy_by_layer": entropy,
            "moe.balance_loss_by_layer": balance,
            "moe.z_loss_by_layer": z,
            "moe.top_gate_by_layer": top_gate,
            "moe.tokens_per_expert": [[int(n) for n in load] for load in loads],
        }
        if self.biased:
            spread = [v[E + FORWARDS] for v in values]
            row.update({"moe.expert_bias_max_abs": max(spread), "moe.expert_bias_max_abs_by_layer": spread})
        return row

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _solve_bias(self) -> None:
        """`model.router_bias_update = "solve"`: each block's bias set to the one that would have balanced this step's
        routing (balancing_bias over the step's sampled scores, from the current bias), averaged over the ranks that
        route other tokens through the same blocks, so that every rank holds the same bias."""
        solved = torch.zeros(len(self.layers), self.n_experts, dtype=torch.float32, device=self.sums.device)
        by_shape: dict[tuple, list] = {}  # the blocks whose sampled scores have one shape, solved in one batch
        for row, moe in self.held:
            kept = self.scores.pop(id(moe), [])
            kept = kept[-self.micro_batches:] if self.micro_batches else kept
            if kept:
                scores = torch.cat(kept)
                by_shape.setdefault((tuple(scores.shape), moe.top_k), []).append((row, moe, scores))
            else:
                solved[row] = moe.expert_bias
        for (_, k), blocks in by_shape.items():
            rows = [row for row, _, _ in blocks]
            solved[rows] = balancing_bias(torch.stack([s for _, _, s in blocks]),
                                          torch.stack([moe.expert_bias for _, moe, _ in blocks]), k)
        self.scores.clear()
        self._set_biases(solved[[row for row, _ in self.held]])

    def _balance_in_forward(self, on: bool) -> None:
        if self.in_batch:
            for _, moe in self.held:
                moe.balancing.fill_(on)

    def _set_biases(self, biases: torch.Tensor) -> None:
        """The held blocks' biases [held, E] set to their mean over the ranks that route other tokens through the
        same blocks, so that every rank holds the same bias."""
        if self.world > 1:
            full = torch.zeros(len(self.layers), self.n_experts, dtype=torch.float32, device=self.sums.device)
            full[[row for row, _ in self.held]] = biases.float()
            dist.all_reduce(full, group=self.group)
            biases = full[[row for row, _ in self.held]] / dist.get_world_size(self.group)
        for (_, moe), bias in zip(self.held, biases):
            moe.expert_bias.copy_(bias)

    def _take(self, forwards: list, moes: list, module, inputs, output) -> None:
        """A stage's forward hook: its blocks' figures of this micro-batch [blocks, E + FORWARDS + 1], kept on the
        device."""
        if not self.collecting:
            return
        if self.solve and moes[0].last_scores is not None:
            for moe in moes:  # up to SOLVE_ROWS evenly spaced rows (model/moe.py)
                self.scores.setdefault(id(moe), []).append(moe.last_scores)
        loads = torch.stack([m.last_load for m in moes]).double()
        if moes[0].last_aux is None:  # recorded in grad mode only, as training's forwards run
            figures = loads.new_zeros(len(moes), FORWARDS)
        else:
            figures = torch.cat([torch.stack([m.last_entropy for m in moes])[:, None],
                                 torch.stack([m.last_aux for m in moes]),
                                 torch.stack([m.last_top_gate for m in moes])[:, None]], 1).double()
        forwards.append(torch.cat([loads, figures, loads.new_ones(len(moes), 1)], 1))

    def _reduce(self) -> None:
        """The step's sums over the ranks that hold the same blocks (once a step)."""
        if not self.reduced and self.world > 1:
            dist.all_reduce(self.sums, group=self.group)
        self.reduced = True


def _replica_group(dims: ParallelDims, env: DistEnv):
    """The ranks holding the same blocks as this one and routing other tokens: all of them (None: the default group)
    without pipeline parallelism, else those of this rank's pipeline index. new_group is collective: every rank makes
    every pipeline index's group."""
    if env.world_size == 1 or dims.pp == 1:
        return None
    groups = [dist.new_group([r for r in range(dims.world) if dims.pp_index(r) == i]) for i in range(dims.pp)]
    return groups[dims.pp_index(env.rank)]


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None

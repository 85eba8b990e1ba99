"""FP8 training as a lever: torchao's float8 linear layers swapped in from outside the model, before compilation
and FSDP2, for the layers a name filter admits (training.fp8_skip keeps the output head and any other named layer
in the compute dtype). The swapped layers keep their weights as ordinary parameters in the model's dtype, so
checkpoints do not change: a run resumes with FP8 switched on or off, and export writes normal weights.

Recipes (torchao): "tensorwise" scales each tensor by one number (with FSDP2 the weights are all-gathered in FP8);
"rowwise" scales each row, more accurate and slower at small shapes. Holotrain's own, "delayed" (precision/delayed.py),
scales each tensor by its recent maxima, so its casts fuse into the kernels that make the tensors. "auto" is resolved
before the model is built (precision/probe.py, train/resolve.py): FP8 only where this GPU's FP8 GEMMs, measured at
the layer's shapes, beat bf16; then delayed on one GPU where the memory plan fits it, else tensorwise."""

from __future__ import annotations

import dataclasses
import fnmatch
import functools
from typing import TYPE_CHECKING, Protocol

import torch

from holotrain.errors import ConfigError
from holotrain.precision import delayed

if TYPE_CHECKING:
    from holotrain.parallel import DistEnv

RECIPES = ("tensorwise", "rowwise", "delayed")

# FP8's cost terms, for the memory plan and the planner. Its blocks keep about this share of bf16's activations
# (float8 linears save their inputs cast) and no bf16 casts of their weights: fitted to the 1.4b's peaks on an H200
# at micro-batches 8 and 16, whole and chunked loss (memory/plan.py: activations).
FP8_ACTIVATIONS = 0.72
# The host issues this many times bf16's kernels per micro-batch (the casts and their scales): the 1.4b at micro-batch
# 1 on an H200, compiled (plan/cost.py: host_seconds).
FP8_HOST = 1.45


# The delayed recipe's step against tensorwise's, its casts fused into their producers: the 1.4b through `holotrain
# train` on an H200, 76.6k against 73.0k tokens/s in one call (bench/RESULTS.md), counted on the matmuls' time.
DELAYED_GAIN = 1.049


def matmul_time(bf16_s: float, recipe: str, gain: float | None) -> float:
    """A step's matmul time under `recipe`, from its bf16 time and FP8's measured gain (tensorwise's: the GEMM
    probe's prediction, or what a trial measured)."""
    if recipe == "none":
        return bf16_s
    return bf16_s / ((gain or 1.0) * (DELAYED_GAIN if recipe == "delayed" else 1.0))


def fp8_capable(device: torch.device) -> str | None:
    """Why `device` cannot run FP8 matmuls, or None when it can (compute capability 8.9 or later)."""
    if device.type != "cuda":
        return f"{device.type} has no FP8 matmuls"
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        return f"{torch.cuda.get_device_name(device)} (sm_{major}{minor}) has no FP8 matmuls (sm_89 or later)"
    return None


def admitted(module: torch.nn.Module, fqn: str, skip: list[str], tp: int = 1) -> bool:
    """A linear layer goes FP8 unless a training.fp8_skip pattern names it; FP8 GEMMs need both of its dimensions
    (each rank's share of them under tensor parallelism) to be multiples of 16."""
    if not isinstance(module, torch.nn.Linear):
        return False
    if any(fnmatch.fnmatchcase(fqn, pattern) for pattern in skip):
        return False
    return module.in_features % (16 * tp) == 0 and module.out_features % (16 * tp) == 0


def fp8_shapes(model: torch.nn.Module, skip: list[str]) -> dict[tuple[int, int], int]:
    """(in, out) -> how many linear layers of that shape would go FP8."""
    shapes: dict[tuple[int, int], int] = {}
    for fqn, module in model.named_modules():
        if admitted(module, fqn, skip):
            key = (module.in_features, module.out_features)
            shapes[key] = shapes.get(key, 0) + 1
    return shapes


class FP8Section(Protocol):
    """What the lever reads of the config's `training` section (the trainer's TrainingConfig)."""

    fp8: str
    fp8_skip: list[str]
    fp8_emulate: bool


class Precision:
    def __init__(self, section: FP8Section, env: DistEnv, data_parallel: int):
        self.recipe, self.skip, self.emulate = section.fp8, list(section.fp8_skip), section.fp8_emulate
        self.data_parallel = data_parallel
        if self.recipe == "auto":
            raise ValueError("training.fp8 = 'auto' must be resolved before the lever is built (train/resolve.py)")
        if self.recipe != "none" and not self.emulate:
            reason = fp8_capable(env.device)
            if reason is not None:
                raise ConfigError(f"training.fp8 = {self.recipe!r}: {reason}; set training.fp8 = 'none' or 'auto'")
        self.converted: list[str] = []
        self.gathers_fp8 = False  # FSDP2 all-gathers the converted weights in FP8
        self.experts = ""  # what became of a mixture-of-experts model's expert GEMMs (for describe)

    def apply(self, model: torch.nn.Module) -> None:
        """Swaps the admitted linear layers for FP8 ones (on the meta or real model, in place); a mixture-of-experts
        model's expert GEMMs go FP8 through the model's grouped_mm hook."""
        if self.recipe == "none":
            return
        self._apply_experts(model)
        if self.recipe == "delayed":
            self._apply_delayed(model)
            return
        try:
            from torchao.float8 import Float8LinearConfig, convert_to_float8_training
        except ImportError as e:
            raise ConfigError(f"training.fp8 = {self.recipe!r} needs torchao: pip install 'holotrain[fp8]' "
                              f"({e.__class__.__name__}: {e})") from None
        # FSDP2 all-gathers the weights already cast to FP8 (half the bytes of bf16), where torchao supports it.
        gather_fp8 = self.recipe == "tensorwise" and self.data_parallel > 1
        config = dataclasses.replace(Float8LinearConfig.from_recipe_name(self.recipe), emulate=self.emulate,
                                     enable_fsdp_float8_all_gather=gather_fp8)

        comm = model.hooks.tp_comm
        if comm is not None:
            self._apply_tp(model, comm.world, dataclasses.replace(config, enable_fsdp_float8_all_gather=False))
            return

        def admit(module: torch.nn.Module, fqn: str) -> bool:
            ok = admitted(module, fqn, self.skip)
            if ok:
                self.converted.append(fqn)
            return ok

        convert_to_float8_training(model, module_filter_fn=admit, config=config)
        if gather_fp8:
            from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

            # What torchao made of the weights: the FP8 all-gather is theirs to do.
            self.gathers_fp8 = any(isinstance(m.weight, WeightWithDynamicFloat8CastTensor) for m in model.modules()
                                   if hasattr(m, "weight"))

    def _apply_experts(self, model: torch.nn.Module) -> None:
        """The experts' grouped GEMMs with rowwise dynamic FP8 (torchao's moe_training: each row of the tokens and
        each column of an expert's weight scaled on its own, in forward and for both gradients), whatever the
        recipe of the linear layers: per-tensor scales over 128 experts' weights would lose the small ones. On CUDA
        only (no emulation of it): elsewhere the experts stay in the compute dtype, and describe() says so."""
        moe = getattr(model, "moe_modules", dict)()
        if not moe:
            return
        self.experts = f"{len(moe)} mixture-of-experts layers' experts in bf16 (FP8 grouped GEMMs need CUDA)"
        if self.emulate:
            return
        try:
            from torchao.prototype.moe_training.fp8_grouped_mm import _to_fp8_rowwise_then_scaled_grouped_mm
        except ImportError as e:
            self.experts = (f"{len(moe)} mixture-of-experts layers' experts in bf16 (FP8 grouped GEMMs need "
                            f"torchao's moe_training: {e.__class__.__name__})")
            return

        def fp8_grouped_mm(a: torch.Tensor, b_t: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
            return _to_fp8_rowwise_then_scaled_grouped_mm(a, b_t, offs, out_dtype=a.dtype,
                                                          pad_token_groups_for_grouped_mm=False)

        # The scaled grouped GEMM wants each expert's rows a multiple of 16 (its own padding is not built in
        # torchao 0.18): model/moe.py pads them once for the three GEMMs.
        fp8_grouped_mm.row_alignment = 16
        model.hooks.install("grouped_mm", fp8_grouped_mm, "precision")
        self.experts = f"the experts of {len(moe)} mixture-of-experts layers in FP8 rowwise grouped GEMMs"

    def _apply_delayed(self, model: torch.nn.Module) -> None:
        """Holotrain's delayed recipe: linears that read one input (a module's `input_group`, e.g. q, k and v) share
        the input's cast when all of them are admitted and bias-free; every other admitted linear casts its own."""
        grouped = set()
        for fqn, module in list(model.named_modules()):
            method, names = getattr(module, "input_group", (None, ()))
            fqns = [f"{fqn}.{n}" if fqn else n for n in names]
            linears = [getattr(module, n, None) for n in names]
            if names and all(admitted(lin, f, self.skip) and lin.bias is None for lin, f in zip(linears, fqns)):
                delayed.convert_group(module, method, linears)
                grouped.update(fqns)
                self.converted.extend(fqns)
        for fqn, module in model.named_modules():
            if fqn not in grouped and admitted(module, fqn, self.skip):
                delayed.convert(module)
                self.converted.append(fqn)

    def _apply_tp(self, model: torch.nn.Module, tp: int, config) -> None:
        """Under tensor parallelism the linears' forwards are parallel/tp.py's (communication and GEMM on local
        shards), so they are not swapped: each admitted linear is given an FP8 matmul that those forwards use in
        place of the bf16 GEMM (after a plain all-gather, before a plain reduce-scatter). The scales are each
        rank's: its shard of a weight, its gathered input."""
        matmul = Fp8Matmul(config)
        for fqn, module in model.named_modules():
            if admitted(module, fqn, self.skip, tp):
                module.fp8_matmul = matmul
                self.converted.append(fqn)

    def initialize(self, model: torch.nn.Module) -> None:
        """The recipe's own state, once the model holds values (it was built on "meta"). The delayed recipe's scales
        are refreshed after each backward: through the model's after_backward hook, which the training step calls."""
        if self.recipe == "delayed":
            linears = delayed.layers(model)
            delayed.reset(linears)
            model.hooks.install("after_backward", [functools.partial(delayed.refresh, linears)], "precision")

    def describe(self) -> str | None:
        if self.recipe == "none":
            return None
        return (f"fp8 {self.recipe} on {len(self.converted)} linear layers" + (" (emulated)" if self.emulate else "")
                + (", weights all-gathered in FP8" if self.gathers_fp8 else "")
                + (f"; {self.experts}" if self.experts else ""))


class Fp8Matmul:
    """x [M, K] @ w_t [K, N] with torchao's float8 casts and scaled GEMMs, in forward and for both gradients, as its
    Float8Linear computes them."""

    def __init__(self, config):
        from torchao.float8.float8_linear import LinearMMConfig, ScaledMMConfig

        self.config = config
        self.mm_config = LinearMMConfig(*(
            ScaledMMConfig(config.emulate, gemm.use_fast_accum, False, config.pad_inner_dim)
            for gemm in (config.gemm_config_output, config.gemm_config_grad_input, config.gemm_config_grad_weight)))

    def __call__(self, x: torch.Tensor, w_t: torch.Tensor) -> torch.Tensor:
        from torchao.float8.float8_linear import matmul_with_hp_or_float8_args

        return matmul_with_hp_or_float8_args.apply(x, w_t, self.mm_config, self.config)


def build(section: FP8Section, env: DistEnv, data_parallel: int) -> Precision:
    return Precision(section, env, data_parallel)

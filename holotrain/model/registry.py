"""The model families and the one way the rest of holotrain builds and reads a model.

A family is registered here by name; the config names it (`model.family`), and everything outside the model package
goes through `model_args`, `build` and `family_of`. Adding a family is one module under model/families/ and one line
in FAMILIES.
"""

from __future__ import annotations

from torch import nn

from holotrain.errors import ConfigError
from holotrain.model.args import FIELDS, SWITCHES, Family, ModelArgs
from holotrain.model.families import llama, mistral, mixtral, qwen2, qwen3, qwen3_moe
from holotrain.model.moe import moe_problem

FAMILIES: dict[str, Family] = {f.name: f for f in (llama.FAMILY, qwen2.FAMILY, qwen3.FAMILY, mistral.FAMILY,
                                                   qwen3_moe.FAMILY, mixtral.FAMILY)}
DEFAULT_FAMILY = llama.FAMILY.name  # a config that names none (and a run saved before families were named)


def family_of(name: str) -> Family:
    """The registered family called `name`, or a ConfigError listing them."""
    if name not in FAMILIES:
        raise ConfigError(f"model.family: unknown family {name!r} (known: {', '.join(FAMILIES)})")
    return FAMILIES[name]


def family_for_hf(model_type: str | None, where: str) -> Family:
    """The family that imports a config.json of this model_type."""
    for family in FAMILIES.values():
        if model_type in family.hf_model_types:
            return family
    known = [t for f in FAMILIES.values() for t in f.hf_model_types]
    raise ConfigError(f"{where}: model_type {model_type!r} is not supported (supported: {', '.join(known)})")


def preset(family: str, name: str) -> ModelArgs:
    presets = family_of(family).presets
    if name not in presets:
        raise ConfigError(f"model.preset: the {family} family has no preset {name!r} (its presets: "
                          f"{', '.join(presets)})")
    return presets[name]


def fix_switches(family: str, section) -> None:
    """Sets, in place on a model config section (or ModelArgs), the switches the family always has."""
    for key, value in family_of(family).fixed.items():
        setattr(section, key, value)


def check(args: ModelArgs) -> None:
    """One ConfigError naming the key, for arguments the family cannot build."""
    family = family_of(args.family)
    for key, value in family.fixed.items():
        if getattr(args, key) != value:
            raise ConfigError(f"model.{key} = {getattr(args, key)!r}: the {family.name} family has {key} = {value!r}")
    for key in SWITCHES:
        if key not in family.fixed and key not in family.allowed and getattr(args, key):
            owners = [f for f in FAMILIES.values() if key in f.allowed or f.fixed.get(key)]
            # The families of the same kind (dense or mixture of experts) first: mistral for a llama's window.
            owners = [f.name for f in owners if _moe(f) == _moe(family)] or [f.name for f in owners]
            raise ConfigError(f"model.{key} is not part of the {family.name} family"
                              + (f" ({', '.join(owners)} {'has' if len(owners) == 1 else 'have'} it: set "
                                 "model.family)" if owners else ""))
    problem = moe_problem(args) or family.check(args)
    if problem:
        raise ConfigError(problem)


def _moe(family: Family) -> bool:
    return any(shape.n_experts for shape in family.presets.values())


def parallel_problem(args: ModelArgs, tp: int = 1, cp: int = 1, pp: int = 1, ep: int = 1) -> str | None:
    """What these arguments cannot run with among the parallel sizes (one line naming the keys), or None, for the
    config's rules across sections: a mixture-of-experts model under tensor parallelism, for now (its blocks refuse
    it too, when the plan reads them: Decoder.layer_roles); expert parallelism on a dense model, over a number of
    ranks that does not divide the experts, or beside context or pipeline parallelism (not yet)."""
    if args.n_experts and tp > 1:
        return (f"parallel.tp = {tp}: tensor parallelism does not split a mixture-of-experts feed-forward yet "
                f"(model.n_experts = {args.n_experts}); set parallel.tp = 1")
    if ep > 1:
        if not args.n_experts:
            return (f"parallel.ep = {ep} splits a mixture-of-experts model's experts; this {args.family} model is "
                    "dense (model.n_experts = 0): set parallel.ep = 1")
        if args.n_experts % ep:
            return f"parallel.ep = {ep} must divide model.n_experts = {args.n_experts} (each rank holds n_experts / ep)"
        for key, n in (("cp", cp), ("pp", pp)):
            if n > 1:
                return f"parallel.ep = {ep} does not combine with parallel.{key} = {n} yet: set one of them to 1"
    return None


def model_args(section) -> ModelArgs:
    """The ModelArgs of a resolved config's model section (or of any object with its fields)."""
    values = {name: getattr(section, name) for name in FIELDS}
    values["family"] = values["family"] or DEFAULT_FAMILY
    return ModelArgs(**values)


def build(args: ModelArgs) -> nn.Module:
    """The model of these arguments (on the current default device: "meta" builds it without memory)."""
    return family_of(args.family).build(args)


"""The offload engine's checkpoint state: what DCP saves from and loads into, in place."""

from __future__ import annotations

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor


def engine_state(engine) -> dict:
    """An OffloadEngine's checkpoint: the model state dict with the fp32 masters in place of the offloaded working
    weights, the device optimizer's state, and the offloaded moments, all keyed by parameter name (DTensors of the
    local shards with several ranks, so the layout does not depend on the world size). The tensors are the
    engine's own buffers: DCP saves from them and loads into them in place."""
    engine.synchronize()
    optimizers = [engine.device_optimizer] if engine.device_optimizer is not None else []
    model_sd, optim_sd = get_state_dict(engine.model, optimizers)
    moments = {}
    for b in engine.buckets:
        for i, (p, fqn) in enumerate(zip(b.params, b.fqns)):
            views = [b.view(flat, i) for flat in (b.master, b.exp_avg, b.exp_avg_sq)]
            if isinstance(p, DTensor):
                views = [DTensor.from_local(v, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                                            stride=p.stride()) for v in views]
            if fqn not in model_sd:
                raise KeyError(f"offload: {fqn} is not in the model's state dict")
            model_sd[fqn] = views[0]
            moments[fqn] = {"exp_avg": views[1], "exp_avg_sq": views[2]}
    meta = {"step": torch.tensor(engine.step_count), "speculate": torch.tensor(int(engine.speculate_next))}
    return {"model": model_sd, "optim": optim_sd, "offload": {"state": moments, **meta}}


def load_engine_state(engine, state: dict) -> None:
    """After DCP loaded into engine_state()'s tensors: restores the rest and uploads the masters."""
    device_sd = {k: v for k, v in state["model"].items() if k not in engine.offloaded_fqns}
    optimizers = [engine.device_optimizer] if engine.device_optimizer is not None else []
    set_state_dict(engine.model, optimizers, model_state_dict=device_sd, optim_state_dict=state["optim"],
                   options=StateDictOptions(strict=False))
    engine.step_count = int(state["offload"]["step"])
    engine.speculate_next = bool(state["offload"]["speculate"])
    with torch.no_grad():
        for b in engine.buckets:
            b.version += 1
            engine._upload(b)
    engine.synchronize()

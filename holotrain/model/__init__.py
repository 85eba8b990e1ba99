"""The model interface: arguments (ModelArgs), families by name (registry), the decoder and its hooks, per-token
costs. Levers use these names only."""

from holotrain.model.args import ModelArgs
from holotrain.model.costs import flops_per_token
from holotrain.model.decoder import Decoder, Hooks, num_params
from holotrain.model.registry import FAMILIES, build, family_of, model_args

__all__ = ["FAMILIES", "Decoder", "Hooks", "ModelArgs", "build", "family_of", "flops_per_token", "model_args",
           "num_params"]

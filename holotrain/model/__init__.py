from holotrain.model.llama import PRESETS, Llama, LlamaArgs, flops_per_token, num_params

__all__ = ["PRESETS", "Llama", "LlamaArgs", "flops_per_token", "num_params"]

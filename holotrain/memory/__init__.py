from holotrain.memory.activation_checkpointing import apply_activation_checkpointing

__all__ = ["apply_activation_checkpointing"]

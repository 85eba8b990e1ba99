"""holotrain: a PyTorch-native LLM trainer."""

__version__ = "0.1.0"

from holotrain.train.resolve import model_args, resolve_job
from holotrain.train.step import lr_at
from holotrain.train.trainer import build_model, train

__all__ = ["build_model", "lr_at", "model_args", "resolve_job", "train"]

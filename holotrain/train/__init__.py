from holotrain.train.trainer import build_model, lr_at, model_args, train

__all__ = ["build_model", "lr_at", "model_args", "train"]

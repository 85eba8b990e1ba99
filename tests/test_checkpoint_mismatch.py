"""A checkpoint that is intact but not this job's (another model or setting) is reported as a mismatch naming the
first differing tensor, never as damage, and no message advises removing checkpoints that are intact."""

import re

import pytest
import torch

from holotrain.config import CheckpointConfig, TrainingConfig
from holotrain.errors import ConfigError
from holotrain.optim import AdamWHyper, DeviceAdamW
from holotrain.parallel import DistEnv
from holotrain.train.checkpoint import list_checkpoints, save_checkpoint
from holotrain.train.checkpointer import Checkpoints

CPU = DistEnv(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
FILES = {"data_state.json": "{}", "config.toml": "[model]\ndim = 64\n"}


class Net(torch.nn.Module):
    def __init__(self, width: int, extra: bool = False):
        super().__init__()
        self.inner = torch.nn.Linear(16, width)
        if extra:
            self.extra = torch.nn.Linear(width, 4)

    def forward(self, x):
        y = self.inner(x)
        return self.extra(y) if hasattr(self, "extra") else y


def _optimizer(model: torch.nn.Module) -> DeviceAdamW:
    """A StepOptimizer (as the trainer builds one on one device) after one step, so that its moments exist."""
    optimizer = DeviceAdamW(model, AdamWHyper.from_section(TrainingConfig()), 1e-3, sharded=False)
    model(torch.randn(2, 16)).sum().backward()
    optimizer.begin(1e-3, 1)
    optimizer.finish()
    return optimizer


def _restore(run_dir, optimizer):
    return Checkpoints(CheckpointConfig(), CPU, run_dir, total_steps=10).restore(optimizer)


@pytest.mark.parametrize("job, difference", [
    (lambda: Net(32), r"model\.inner\.weight is \[64, 16\] there, \[32, 16\] here"),
    (lambda: Net(64, extra=True), r"model\.extra\.weight is not in the checkpoint"),
])
def test_another_jobs_checkpoint_is_a_mismatch_not_damage(tmp_path, capsys, job, difference):
    """Two intact checkpoints of a model of width 64; a job whose model is narrower (or has a layer more) gets one
    ConfigError naming the newest, the first differing tensor and the way out, without trying the older one as if
    the newer were damaged, and without a word about removing them. Both stay as they were."""
    saved = _optimizer(Net(64))
    for step in (1, 2):
        save_checkpoint(tmp_path, step, saved, {"step": step}, keep=2, extra_files=FILES)
    newest = tmp_path / "checkpoints" / "step-2"
    with pytest.raises(ConfigError) as raised:
        _restore(tmp_path, _optimizer(job()))
    message = str(raised.value)
    assert "\n" not in message
    pattern = (rf"checkpoint {newest} does not match this job \({difference}\): {tmp_path} was trained with another "
               rf"model or setting\. Resume it with the config it was trained with \({newest / 'config.toml'}\), or "
               r"give this job another job\.run_dir")
    assert re.fullmatch(pattern, message), message
    assert "damaged" not in message + capsys.readouterr().out and "remove" not in message.lower()
    assert [step for step, _ in list_checkpoints(tmp_path)] == [1, 2]

    # The same job's optimizer loads it.
    assert _restore(tmp_path, _optimizer(Net(64)))[1] == {"step": 2}


def test_only_damaged_checkpoints_are_called_damaged_and_only_they_are_offered_for_removal(tmp_path, capsys):
    """The newest checkpoint damaged (a shard truncated), the older one another job's: the newest is reported as
    damaged, the older as a mismatch (not damaged). With both damaged, the error lists them and advises removing
    exactly those."""
    saved = _optimizer(Net(64))
    for step in (1, 2):
        save_checkpoint(tmp_path, step, saved, {"step": step}, keep=2, extra_files=FILES)
    ckpts = tmp_path / "checkpoints"
    shard = next((ckpts / "step-2").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:10])
    with pytest.raises(ConfigError, match=rf"checkpoint {ckpts / 'step-1'} does not match this job"):
        _restore(tmp_path, _optimizer(Net(32)))
    assert f"checkpoint {ckpts / 'step-2'} is damaged" in capsys.readouterr().out

    shard = next((ckpts / "step-1").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:10])
    with pytest.raises(ConfigError) as raised:
        _restore(tmp_path, _optimizer(Net(64)))
    assert str(raised.value).startswith(f"no intact checkpoint of {tmp_path}: checkpoint {ckpts / 'step-2'} (")
    assert str(raised.value).endswith(f"To go on: remove the damaged checkpoints ({ckpts / 'step-2'}, "
                                      f"{ckpts / 'step-1'}) to start over, or choose another job.run_dir")

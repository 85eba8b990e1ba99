"""GPU paths: bf16 autocast, compiled blocks, attention kernels. Skipped without CUDA."""

import pytest
import torch

from tests.conftest import read_metrics, run_cli, tiny_args

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_gpu_bf16_compiled_training(tmp_path):
    run_cli("train", *tiny_args(tmp_path, **{"job.device": "cuda", "training.compile": True, "training.steps": 30,
                                             "training.lr": 3e-3, "checkpoint.every": 10}))
    rows = read_metrics(tmp_path)
    assert rows[-1]["loss"] < rows[0]["loss"] - 0.5
    assert rows[-1]["mem.peak_gb"] > 0
    if "H200" in torch.cuda.get_device_name() or "H100" in torch.cuda.get_device_name():
        assert rows[-1]["mfu"] is not None and 0 < rows[-1]["mfu"] < 1


def test_gpu_resume_continues(tmp_path):
    args = tiny_args(tmp_path, **{"job.device": "cuda", "training.steps": 20, "checkpoint.every": 10})
    run_cli("train", *args, env={"HOLOTRAIN_KILL_DURING_SAVE": "20"}, check=False)
    run_cli("train", *args)
    assert [r["step"] for r in read_metrics(tmp_path)] == list(range(1, 21))


@pytest.mark.parametrize("kernel", ["cudnn", "flash"])
def test_attention_kernels_agree_with_math(kernel):
    from holotrain.train.step import attention_kernels

    q, k, v = (torch.randn(2, 8, 256, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    ref = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True)
    with attention_kernels(kernel, torch.device("cuda")):
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert ((out.float() - ref).norm() / ref.norm()).item() < 1e-2


def test_gpu_checkpoint_copy_runs_behind_the_step_and_holds_the_saved_step():
    """A save's device-to-host copy is queued on a stream of its own and overlaps the next step; the optimizer's
    next update waits for it on the device. The copy holds the state of the step it was taken at, although the next
    update was queued before the copy was complete (0.8 GB of weights and moments, about 15 ms to copy)."""
    from holotrain.config import TrainingConfig
    from holotrain.optim import AdamWHyper, DeviceAdamW
    from holotrain.train.checkpoint import training_state
    from holotrain.train.checkpointer import HostSnapshot
    from holotrain.train.hostcopy import leaves

    device = torch.device("cuda", torch.cuda.current_device())  # as the trainer's: with its index
    model = torch.nn.Linear(8192, 8192, bias=False, device=device)
    optimizer = DeviceAdamW(model, AdamWHyper.from_section(TrainingConfig()), 1e-2, sharded=False)
    x = torch.randn(64, 8192, device=device)

    def step():
        optimizer.begin(1e-2, 1)
        model(x).square().mean().backward()
        optimizer.finish()

    step()
    snapshot = HostSnapshot(device)
    state = training_state(optimizer)
    expected = {path: t.detach().cpu().clone() for path, t in leaves(state) if isinstance(t, torch.Tensor)}
    try:
        copied = snapshot.take(state, optimizer)
        step()  # its update is queued at once, behind the copy
        snapshot.ready()
        got = {path: t for path, t in leaves(copied) if isinstance(t, torch.Tensor)}
        assert got.keys() == expected.keys()
        for path, want in expected.items():
            assert torch.equal(got[path].cpu(), want), path
        assert not torch.equal(model.weight.detach().cpu(), expected[("model", "weight")])  # the next step updated
    finally:
        snapshot.release()

"""The pieces of in-memory snapshots: the flat host layout, slots, checksums and the choice of peer."""

import json

import pytest
import torch

from holotrain.parallel import DistEnv
from holotrain.train.hostcopy import FlatLayout, copy_from, copy_into
from holotrain.train.snapshots import Slot, checksums, peers


def _state():
    return {"model": {"w": torch.randn(1000, 33), "b": torch.arange(7, dtype=torch.int64)},
            "optim": {"param_groups": [{"lr": 3e-4, "betas": (0.9, 0.95), "params": ["w", "b"]}],
                      "step": torch.tensor(5.0), "moments": torch.randn(64, 3)[:, :2]}}


def test_a_state_survives_the_flat_layout_and_its_json_description():
    state = _state()
    layout = FlatLayout.of(state)
    buf = torch.empty(layout.nbytes, dtype=torch.uint8)
    copied = copy_into(state, layout, buf, non_blocking=False)
    assert copied["optim"]["param_groups"][0]["betas"] == (0.9, 0.95)
    assert all(o % 64 == 0 for o, _, _ in layout.entries.values())
    again = FlatLayout.from_description(json.loads(json.dumps(layout.describe())), layout.nbytes)
    assert again == layout
    blank = {"model": {"w": torch.zeros(1000, 33), "b": torch.zeros(7, dtype=torch.int64)},
             "optim": {"param_groups": [{}], "step": torch.tensor(0.0), "moments": torch.zeros(64, 2)}}
    copy_from(blank, again, buf)
    for key in ("w", "b"):
        assert torch.equal(blank["model"][key], state["model"][key])
    assert torch.equal(blank["optim"]["moments"], state["optim"]["moments"])
    assert blank["optim"]["step"].item() == 5.0
    # A different shape is a different layout: a snapshot of another model is never loaded into this one.
    other = _state()
    other["model"]["w"] = torch.randn(1000, 34)
    assert FlatLayout.of(other) != layout


def test_a_slot_is_complete_only_with_its_header_and_checksums_catch_damage(tmp_path):
    slot = Slot(tmp_path / "rank-0" / "own", 0)
    buf = slot.map(3 * (64 << 20) + 5)
    buf.copy_(torch.randint(0, 256, (buf.numel(),), dtype=torch.uint8))
    sums = checksums(buf)
    assert len(sums) == 4 and slot.read_header() is None
    slot.publish({"step": 7, "crc32": sums})
    assert slot.read_header()["step"] == 7
    again = torch.from_file(str(slot.data), shared=False, size=buf.numel(), dtype=torch.uint8)
    assert checksums(again) == sums
    buf[(64 << 20) + 1] ^= 1  # one flipped bit in the second 64 MiB
    assert checksums(buf) != sums
    slot.invalidate()
    assert slot.read_header() is None
    slot.map(10)  # resized for another layout: the data no longer matches any header
    assert slot.data.stat().st_size == 10


@pytest.mark.parametrize("world,local,expected", [
    (1, 1, None),
    (2, 2, [(1, 1), (0, 0)]),  # one node: the next rank
    (4, 4, [(1, 3), (2, 0), (3, 1), (0, 2)]),
    (4, 2, [(2, 2), (3, 3), (0, 0), (1, 1)]),  # two nodes: the same local rank on the other node
    (6, 2, [(2, 4), (3, 5), (4, 0), (5, 1), (0, 2), (1, 3)]),
])
def test_each_rank_replica_goes_to_another_node_when_there_is_one(world, local, expected):
    got = [peers(DistEnv(rank=r, world_size=world, local_rank=r % local, device=torch.device("cpu"),
                         local_world_size=local)) for r in range(world)]
    assert got == (expected or [None])
    if expected:
        for r, (holder, source) in enumerate(got):
            assert holder // local != r // local or world == local  # another node's RAM
            assert got[holder][1] == r  # the holder knows whose replica it holds


def test_a_checkpoint_whose_host_copy_does_not_fit_is_written_while_training_waits(tmp_path, monkeypatch, capsys):
    """With no room in host RAM for the background writer's copy of the state, a save says so once and writes the
    checkpoint from the state itself, before training goes on (instead of allocating the copy and being killed)."""
    from holotrain.config import CheckpointConfig, TrainingConfig
    from holotrain.optim import AdamWHyper, DeviceAdamW
    from holotrain.train import checkpointer
    from holotrain.train.checkpoint import list_checkpoints

    monkeypatch.setattr(checkpointer, "host_available_bytes", lambda: 1000)
    env = DistEnv(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    model = torch.nn.Linear(64, 64)
    hyper = AdamWHyper.from_section(TrainingConfig())
    optimizer = DeviceAdamW(model, hyper, 1e-3, sharded=False)
    model(torch.randn(4, 64)).sum().backward()
    optimizer.begin(1e-3, 1)
    optimizer.finish()
    saver = checkpointer.Checkpointer(CheckpointConfig(), env, tmp_path)
    saver.prepare(optimizer)
    saver.save(1, optimizer, {"step": 1})
    assert saver._thread is None  # nothing left running: the write is done
    assert [step for step, _ in list_checkpoints(tmp_path)] == [1]
    assert "checkpoints are written while training waits" in capsys.readouterr().out
    saver.close()

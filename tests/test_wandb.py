"""Weights & Biases (profile.wandb, holotrain/profile/wandb_sink.py): a short CPU run logs its rows to an offline W&B
run in the run directory, under the TensorBoard writer's names and the run directory's run_id; without wandb
installed, profile.wandb = true is one line that says how to install it; the section's keys are checked."""

from __future__ import annotations

import json
import struct
import sys
from pathlib import Path

import pytest

from holotrain.errors import ConfigError
from tests.conftest import read_metrics, run_cli, tiny_args

INSTALL = 'pip install "holotrain[wandb]"'


def read_wandb_records(path: Path) -> list:
    """The records of a .wandb file (wandb's transaction log: a 7-byte header, then LevelDB-log framing in 32 KiB
    blocks, each record a wandb_internal_pb2.Record, possibly split across blocks)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B transaction log"
    block, pos, pending, records = 32768, 7, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # too little left in the block for a header: the rest is padding
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if length == 0 and kind == 0:
            break
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST
            record = pb.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def test_a_run_logs_its_rows_to_an_offline_wandb_run(tmp_path):
    pytest.importorskip("wandb")
    run = tmp_path / "run"
    home = tmp_path / "wandb-home"
    env = {"WANDB_DIR": str(home), "WANDB_CONFIG_DIR": str(home / "config"), "WANDB_CACHE_DIR": str(home / "cache"),
           "WANDB_DATA_DIR": str(home / "data"), "WANDB_SILENT": "true"}
    run_cli("train", *tiny_args(run, **{"training.steps": 4, "eval.every": 2, "eval.holdout": 0.05,
                                         "eval.sample_tokens": 0, "checkpoint.every": 0, "profile.wandb": True,
                                         "profile.wandb_mode": "offline"}), env=env)
    run_id = (run / "run_id").read_text().strip()
    found = list((run / "wandb").glob(f"offline-run-*-{run_id}"))
    assert len(found) == 1, f"one offline W&B run named by the run directory's run_id, got {found}"
    records = read_wandb_records(found[0] / f"run-{run_id}.wandb")

    (started,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    # named job.name (the embedded default job: "default"), with the run directory's run_id as its id
    assert started.run_id == run_id and started.display_name == "default" and started.project == "holotrain"
    config = {item.key: json.loads(item.value_json) for item in started.config.update}
    assert config["model"]["dim"] == 64  # the resolved config, section by section

    history = {}
    for r in records:
        if r.WhichOneof("record_type") == "history":
            items = {"/".join(i.nested_key) or i.key: json.loads(i.value_json) for i in r.history.item}
            history[items["_step"]] = items
    rows = read_metrics(run)
    assert sorted(history) == [r["step"] for r in rows] == [1, 2, 3, 4]
    for row in rows:
        logged = history[row["step"]]
        assert logged["loss"] == pytest.approx(row["loss"]) and logged["lr"] == pytest.approx(row["lr"])
        assert ("eval/loss" in logged) == (row.get("eval.loss") is not None) == (row["step"] in (2, 4))
        if row["step"] in (2, 4):
            assert logged["eval/loss"] == pytest.approx(row["eval.loss"])
            assert logged["eval/code/loss"] == pytest.approx(row["eval.code.loss"])  # TensorBoard's names
    (ended,) = [r.exit for r in records if r.WhichOneof("record_type") == "exit"]
    assert ended.exit_code == 0  # finished, not failed


def test_wandb_without_the_package_is_one_line(monkeypatch, tmp_path):
    """Without wandb (simulated: an import of it fails), both the startup check and the sink's factory say so in one
    line naming profile.wandb and the install command."""
    from holotrain.profile.config import ProfileConfig
    from holotrain.profile.wandb_sink import check_installed, open_sink

    monkeypatch.setitem(sys.modules, "wandb", None)
    for call in (check_installed, lambda: open_sink(ProfileConfig(wandb=True), tmp_path)):
        with pytest.raises(ConfigError) as e:
            call()
        message = str(e.value)
        assert "profile.wandb" in message and INSTALL in message and "\n" not in message, message


def test_scalars_take_the_tensorboard_names():
    from holotrain.profile.wandb_sink import scalars

    row = {"step": 5, "loss": 2.5, "lr": 1e-3, "eval.loss": 2.75, "eval.code.loss": 3.0, "time.forward": 0.1,
           "mfu": None, "eval.samples": [{"prompt": "a", "text": "b"}], "stragglers": [], "nonfinite": float("nan"),
           "flag": True, "tokens": 256}
    assert scalars(row) == {"loss": 2.5, "lr": 1e-3, "eval/loss": 2.75, "eval/code/loss": 3.0, "time/forward": 0.1,
                            "tokens": 256}


@pytest.mark.parametrize("arg, key", [("--profile.wandb_mode=cloud", "profile.wandb_mode"),
                                      ("--profile.wandb_project=a/b", "profile.wandb_project"),
                                      ("--profile.wandb_entity=team:x", "profile.wandb_entity")])
def test_the_wandb_keys_are_checked(arg, key):
    from holotrain.config import load_config, resolve

    with pytest.raises(ConfigError, match=key) as e:
        resolve(load_config(None, [arg]), tokenizer_vocab=512)
    assert "\n" not in str(e.value)

"""The data section's inputs checked before anything starts (holotrain.data.inputs.check_inputs), and skipped records
made visible during a run (holotrain.data.monitor.SkipMonitor): each problem one line naming the key and the file."""

import json
import os
from pathlib import Path

import numpy as np
import pytest

from holotrain.config import DataConfig
from holotrain.data.inputs import SAMPLE_RECORDS, check_inputs
from holotrain.data.monitor import MIN_JUDGED, SkipMonitor
from holotrain.data.sources import SourceConfig
from holotrain.errors import ConfigError
from tests.conftest import run_cli_here, tiny_args


def write_records(path: Path, good: int, bad_every: int = 0, field: str = "text") -> None:
    """`good` records; with bad_every = k, a malformed line after every k-th good one."""
    with open(path, "w") as f:
        for i in range(good):
            f.write(json.dumps({field: f"document {i} alpha beta"}) + "\n")
            if bad_every and (i + 1) % bad_every == 0:
                f.write('{"text": "cut short\n')


def section(*sources: SourceConfig, **keys) -> DataConfig:
    return DataConfig(sources=list(sources), **keys)


def test_half_malformed_jsonl_is_one_line_naming_the_file_and_line(tmp_path):
    write_records(tmp_path / "sft.jsonl", 300, bad_every=1)  # every other line is broken
    with pytest.raises(ConfigError) as e:
        check_inputs(section(SourceConfig(name="sft", path=str(tmp_path / "sft.jsonl"))))
    message = str(e.value)
    assert "\n" not in message
    assert message.startswith("data.sources[sft]: 300 of the first 600 records cannot be used, more than "
                              "data.max_skip_fraction = 0.01")
    assert f"(first: {tmp_path / 'sft.jsonl'}:2: " in message


def test_a_missing_text_field_counts_and_the_limit_is_a_share(tmp_path):
    write_records(tmp_path / "other.jsonl", 20, field="body")
    with pytest.raises(ConfigError, match=r"20 of the first 20 records .* not a JSON object with a string field"):
        check_inputs(section(SourceConfig(name="o", path=str(tmp_path / "other.jsonl"))))
    # One bad line in 400 (0.25%) is within the default 1%; over a limit of 0.1% it is not.
    write_records(tmp_path / "mostly.jsonl", 400, bad_every=400)
    src = SourceConfig(name="m", path=str(tmp_path / "mostly.jsonl"))
    check_inputs(section(src))
    with pytest.raises(ConfigError, match=r"1 of the first 401 records"):
        check_inputs(section(src, max_skip_fraction=0.001))


def test_only_the_first_records_are_sampled(tmp_path):
    path = tmp_path / "big.jsonl"
    write_records(path, SAMPLE_RECORDS)
    with open(path, "a") as f:
        f.write("not json\n" * 5000)  # past the sample: the loaders count these during the run
    check_inputs(section(SourceConfig(name="big", path=str(path))))


def test_paths_globs_and_home(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "corpus").mkdir()
    write_records(tmp_path / "corpus" / "a.jsonl", 10)
    check_inputs(section(SourceConfig(name="a", path="~/corpus/*.jsonl")))
    with pytest.raises(ConfigError, match=r"^data\.sources\[b\]\.path: no \.jsonl.* files at '~/korpus/\*\.jsonl'$"):
        check_inputs(section(SourceConfig(name="b", path="~/korpus/*.jsonl")))
    (tmp_path / "corpus" / "table.csv").write_text("a,b\n")
    with pytest.raises(ConfigError, match=r"^data\.sources\[c\]: unknown format of .*table\.csv"):
        check_inputs(section(SourceConfig(name="c", path=str(tmp_path / "corpus" / "table.csv"))))


def test_an_unreadable_file_is_named(tmp_path, monkeypatch):
    write_records(tmp_path / "a.jsonl", 10)
    (tmp_path / "a.jsonl").chmod(0)
    if os.access(tmp_path / "a.jsonl", os.R_OK):  # root reads any file: as another user would see it
        monkeypatch.setattr(os, "access", lambda path, mode: False)
    with pytest.raises(ConfigError, match=r"^data\.sources\[a\]\.path: cannot read .*a\.jsonl \(permission denied\)$"):
        check_inputs(section(SourceConfig(name="a", path=str(tmp_path / "a.jsonl"))))


def test_parquet_and_npy_are_checked_from_their_first_rows(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    # One row group of 5,000 rows, the bad ones after the sample's first rows.
    rows = [f"row {i}" for i in range(SAMPLE_RECORDS)] + [""] * 4000
    pq.write_table(pa.table({"text": rows}), tmp_path / "rows.parquet", row_group_size=5000)
    check_inputs(section(SourceConfig(name="p", path=str(tmp_path / "rows.parquet"))))
    pq.write_table(pa.table({"text": ["", "x"] * 50}), tmp_path / "half.parquet")
    with pytest.raises(ConfigError, match=r"50 of the first 100 records .*half\.parquet:row 0: missing or empty"):
        check_inputs(section(SourceConfig(name="h", path=str(tmp_path / "half.parquet"))))
    with pytest.raises(ConfigError, match=r"no column 'body'"):
        check_inputs(section(SourceConfig(name="p", path=str(tmp_path / "rows.parquet"), text_field="body")))
    (tmp_path / "fake.parquet").write_text("not parquet")
    with pytest.raises(ConfigError, match=r"^data\.sources\[f\]: .*fake\.parquet cannot be read as \.parquet"):
        check_inputs(section(SourceConfig(name="f", path=str(tmp_path / "fake.parquet"))))
    np.save(tmp_path / "tokens.npy", np.arange(10, dtype=np.uint16))
    check_inputs(section(SourceConfig(name="t", path=str(tmp_path / "tokens.npy"))))
    np.save(tmp_path / "grid.npy", np.zeros((2, 3), dtype=np.int32))
    with pytest.raises(ConfigError, match=r"grid\.npy is not a 1-D array of token ids"):
        check_inputs(section(SourceConfig(name="g", path=str(tmp_path / "grid.npy"))))


def test_tokenizer_and_chat_template(tmp_path):
    from holotrain.data.corpus import train_tokenizer

    write_records(tmp_path / "a.jsonl", 10)
    src = SourceConfig(name="a", path=str(tmp_path / "a.jsonl"))
    with pytest.raises(ConfigError, match=r"^data\.tokenizer: file not found: .*nope\.json$"):
        check_inputs(section(src, tokenizer=str(tmp_path / "nope.json")))
    (tmp_path / "broken.json").write_text("{")
    with pytest.raises(ConfigError, match=r"^data\.tokenizer: cannot load"):
        check_inputs(section(src, tokenizer=str(tmp_path / "broken.json")))
    train_tokenizer(["alpha beta"] * 10, 300).save(str(tmp_path / "tokenizer.json"))
    check_inputs(section(src, tokenizer=str(tmp_path / "tokenizer.json")))
    with pytest.raises(ConfigError, match=r"^data\.chat_template: file not found: .*missing\.jinja$"):
        check_inputs(section(src, chat_template=str(tmp_path / "missing.jinja")))
    # A chat source: its records rendered with the template, as the loaders render them.
    chats = tmp_path / "chats.jsonl"
    chats.write_text(json.dumps({"prompt": "hi", "response": "hello"}) + "\n"
                     + json.dumps({"messages": [{"role": "user", "content": "no answer"}]}) + "\n")
    chat = SourceConfig(name="chat", path=str(chats), format="chat")
    with pytest.raises(ConfigError, match=r"data\.tokenizer is empty"):  # a trained tokenizer has no template
        check_inputs(section(chat))
    with pytest.raises(ConfigError, match=r"1 of the first 2 records .*chats\.jsonl:2: no assistant message"):
        check_inputs(section(chat, chat_template="chatml"))


def test_no_sources_checks_no_sources():
    check_inputs(section())  # the embedded corpus: nothing to look at before it is built


def test_half_malformed_source_stops_train_in_one_line(tmp_path):
    """Through `holotrain train` (in this process: the check comes before anything starts)."""
    write_records(tmp_path / "web.jsonl", 200, bad_every=1)
    job = tmp_path / "job.toml"
    job.write_text(f'[[data.sources]]\nname = "web"\npath = "{tmp_path / "web.jsonl"}"\n')
    proc = run_cli_here("train", "--config", job, *tiny_args(tmp_path / "run"))
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "data.sources[web]: 200 of the first 400 records" in lines[0], proc.stderr
    assert f"{tmp_path / 'web.jsonl'}:2: " in lines[0]


# ---------------------------------------------------------------------------------------------
# During the run: the plane's per-source counts at each logged step


def counts(records: int, skipped: int, passes: int = 0, first: str | None = "/x/sft.jsonl:17: not valid JSON") -> dict:
    return {"records": records, "skipped": skipped, "passes": passes, "first": first if skipped else None}


def test_monitor_warns_once_per_new_skips_on_the_main_rank(capsys):
    main, other = SkipMonitor(0.05, is_main=True), SkipMonitor(0.05, is_main=False)
    for step in ([counts(480, 0)], [counts(480, 12)], [counts(480, 12)], [counts(960, 13)]):
        for monitor in (main, other):
            monitor.check({"sft": step[0], "web": counts(5000, 0)})
    out = capsys.readouterr().out.splitlines()
    assert out == [
        "holotrain: warning: data source 'sft': 12 of 480 records skipped so far (first: /x/sft.jsonl:17: not valid "
        "JSON)",
        "holotrain: warning: data source 'sft': 13 of 960 records skipped so far (first: /x/sft.jsonl:17: not valid "
        "JSON)",
    ]


def test_monitor_stops_a_source_over_the_limit_once_it_is_judged(capsys):
    monitor = SkipMonitor(0.01, is_main=True)
    monitor.check({"sft": counts(MIN_JUDGED - 100, 450)})  # too few read yet: a warning only
    assert "450 of 900" in capsys.readouterr().out
    with pytest.raises(ConfigError) as e:
        monitor.check({"sft": counts(MIN_JUDGED, 500)})
    assert str(e.value) == ("data source 'sft': 500 of 1000 records skipped so far (first: /x/sft.jsonl:17: not "
                            "valid JSON): more than data.max_skip_fraction = 0.01; fix or remove the file, or raise "
                            "data.max_skip_fraction")
    # A small source read through once is judged on what it holds.
    with pytest.raises(ConfigError, match="'tiny': 2 of 50 records"):
        SkipMonitor(0.01, is_main=False).check({"tiny": counts(50, 2, passes=1)})
    SkipMonitor(0.05, is_main=False).check({"tiny": counts(50, 2, passes=1)})  # 4%: within 5%

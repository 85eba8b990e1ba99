import pytest

from holotrain.config import Config, ConfigError, batch_layout, load_config, parse_overrides, resolve
from tests.conftest import run_cli_here


def test_defaults_resolve_from_preset():
    cfg = resolve(load_config(), tokenizer_vocab=4000)
    assert (cfg.model.dim, cfg.model.n_layers, cfg.model.n_heads) == (256, 4, 8)
    assert cfg.model.vocab_size == 4032  # rounded up to a multiple of 64
    assert cfg.model.max_seq_len == cfg.data.seq_len


def test_1_4b_preset_dims():
    cfg = resolve(load_config(None, ["--model.preset=1.4b", "--data.seq_len=2048"]), tokenizer_vocab=4096)
    m = cfg.model
    assert (m.dim, m.n_layers, m.n_heads, m.ffn_dim, m.vocab_size) == (2048, 24, 16, 5632, 32000)


def test_toml_then_overrides(tmp_path):
    path = tmp_path / "job.toml"
    path.write_text('[training]\nsteps = 7\nlr = 1\n[job]\nname = "x"\n')
    cfg = load_config(path, ["--training.steps=9", "--checkpoint.resume"])
    assert cfg.training.steps == 9
    assert cfg.training.lr == 1.0 and isinstance(cfg.training.lr, float)
    assert cfg.checkpoint.resume is True
    assert cfg.job.name == "x"


def test_resolved_config_round_trips(tmp_path):
    cfg = resolve(load_config(None, ["--training.steps=5"]), tokenizer_vocab=512)
    path = tmp_path / "config.toml"
    path.write_text(cfg.to_toml())
    assert load_config(path).to_dict() == cfg.to_dict()


@pytest.mark.parametrize(
    "args, key",
    [
        (["--training.bogus=1"], "training.bogus"),
        (["--nosuch.key=1"], "nosuch"),
        (["--training.steps=abc"], "training.steps"),
        (["--training.compile=maybe"], "training.compile"),
        (["--model.dim=100", "--model.n_heads=3"], "model.n_heads"),
        (["--model.n_kv_heads=3"], "model.n_kv_heads"),
        (["--training.steps=0"], "training.steps"),
        (["--training.lr=-1"], "training.lr"),
        (["--model.preset=13t"], "model.preset"),
        (["--profile.trace_steps=3,x"], "profile.trace_steps"),
        (["--profile.trace_steps=0"], "profile.trace_steps"),
        (["--hw.telemetry_hz=0"], "hw.telemetry_hz"),
        # changing a shared card's clocks needs the explicit opt-in
        (["--hw.lock_sm_clock_mhz=1500"], "hw.allow_clock_control"),
        (["--hw.power_limit_w=500"], "hw.allow_clock_control"),
        (["--hw.gpu_memory_gb=-1"], "hw.gpu_memory_gb"),
    ],
)
def test_bad_values_name_the_key(args, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        resolve(load_config(None, args), tokenizer_vocab=512)


def test_toml_unknown_key_and_wrong_type(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text("[model]\ndimm = 3\n")
    with pytest.raises(ConfigError, match=r"model\.dimm"):
        load_config(path)
    path.write_text('[training]\nsteps = "many"\n')
    with pytest.raises(ConfigError, match=r"training\.steps"):
        load_config(path)
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "missing.toml")


def test_batch_layout():
    cfg = Config()
    cfg.training.batch_size = 16
    assert batch_layout(cfg, 1) == (16, 1)
    assert batch_layout(cfg, 2) == (8, 1)
    cfg.training.micro_batch_size = 4
    assert batch_layout(cfg, 2) == (4, 2)
    cfg.training.micro_batch_size = 3
    with pytest.raises(ConfigError, match="training.batch_size"):
        batch_layout(cfg, 2)


def test_override_syntax():
    assert parse_overrides(["--a.b=1", "--c.d"]) == [("a", "b", "1"), ("c", "d", "true")]
    with pytest.raises(ConfigError):
        parse_overrides(["steps=3"])


@pytest.mark.parametrize(
    "args, key",
    [
        (["--model.n_heads=7"], "model.n_heads"),
        (["--training.stepz=3"], "training.stepz"),
        (["--training.steps=x"], "training.steps"),
        (["--hw.lock_sm_clock_mhz=1500"], "hw.allow_clock_control"),
        (["--hw.gpu_memory_gb=-1"], "hw.gpu_memory_gb"),
    ],
)
def test_cli_config_error_is_one_line_exit_2(tmp_path, args, key):
    proc = run_cli_here("train", f"--job.run_dir={tmp_path}", "--data.tokenizer_sample_mb=0.2", "--data.vocab_size=300",
                        *args)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert key in lines[0] and "Traceback" not in proc.stderr


def test_resolved_config_is_read_only():
    import dataclasses

    cfg = resolve(load_config(), tokenizer_vocab=4000).freeze()
    assert cfg.frozen
    with pytest.raises(AttributeError, match="read-only"):
        cfg.memory.offload = True
    with pytest.raises(AttributeError, match="read-only"):
        cfg.training = None
    changed = dataclasses.replace(cfg.memory, offload=True)  # what-if copies stay possible
    assert changed.offload and not cfg.memory.offload
    changed.offload_ratio = 0.5  # a copy is not frozen
    assert "[memory]" in cfg.to_toml()


def test_gpu_cap_bytes():
    from holotrain.memory.plan import gpu_cap_bytes

    card = 141_000_000_000
    assert gpu_cap_bytes(card, 0) == card  # 0 = the whole card
    assert gpu_cap_bytes(card, 24) == 24_000_000_000
    assert gpu_cap_bytes(card, 24.5) == 24_500_000_000
    assert gpu_cap_bytes(card, 200) == card  # never more than the card


def test_memory_plan_keeps_to_the_gpu_cap(monkeypatch):
    """The cap set on the allocator (torch.cuda.set_per_process_memory_fraction) bounds the plan's GPU capacity,
    however much the card has free. CUDA's queries are stood in for, so this runs on the CPU."""
    import torch

    from holotrain.memory.plan import GPU_USABLE_EXPANDABLE, gpu_available_bytes, plan_memory
    from holotrain.model import build
    from holotrain.train import model_args

    card, cap, reserved = 141e9, 24e9, 1e9
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (int(130e9), int(card)))
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda device=None: cap / card)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: int(reserved))
    cuda = torch.device("cuda", 0)
    assert gpu_available_bytes(cuda) == pytest.approx(cap - reserved, abs=1)
    cfg = resolve(load_config(None, ["--hw.gpu_memory_gb=24"]), tokenizer_vocab=512)
    with torch.device("meta"):
        model = build(model_args(cfg))
    plan = plan_memory(model, cfg, 1, cuda, 2, 1, host_capacity=100e9)
    # A capped run allocates with expandable segments: less is lost to fragmentation.
    assert plan.gpu_capacity == pytest.approx((cap - reserved) * GPU_USABLE_EXPANDABLE, abs=1)
    assert plan.gpu_capacity <= cap


def test_expandable_segments_reason():
    from holotrain.memory.plan import expandable_segments_reason

    plain = load_config()
    assert expandable_segments_reason(plain, {}) is None
    capped = load_config(None, ["--hw.gpu_memory_gb=24"])
    assert expandable_segments_reason(capped, {}) == "hw.gpu_memory_gb = 24"
    offload = load_config(None, ["--memory.offload=true", "--hw.gpu_memory_gb=24"])
    assert expandable_segments_reason(offload, {}) == "hw.gpu_memory_gb = 24 and memory.offload"
    # The user's own allocator settings are left alone.
    assert expandable_segments_reason(offload, {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"}) is None
    assert expandable_segments_reason(offload, {"PYTORCH_ALLOC_CONF": "max_split_size_mb:512"}) is None
    # The long-sequence levers, set by the user or by "auto" (the trainer asks again once it is resolved).
    for lever in ("ffn_tiles=8", "activation_offload_blocks=2", "activation_checkpointing_segment=2"):
        long = load_config(None, ["--memory.activation_checkpointing=full", f"--memory.{lever}"])
        assert expandable_segments_reason(long, {}) == "the long-sequence memory levers", lever

    from holotrain.memory.plan import GPU_USABLE, GPU_USABLE_EXPANDABLE, GPU_USABLE_LONG_SEQUENCE, gpu_usable_share

    assert gpu_usable_share(plain, {}) == GPU_USABLE and gpu_usable_share(offload, {}) == GPU_USABLE_EXPANDABLE
    # At the memory limit of one long sequence the plan keeps its own error in hand.
    assert gpu_usable_share(long, {}) == GPU_USABLE_LONG_SEQUENCE < GPU_USABLE_EXPANDABLE
    assert gpu_usable_share(plain, {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}) == GPU_USABLE_EXPANDABLE
    assert gpu_usable_share(offload, {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:512"}) == GPU_USABLE


def test_gpu_memory_set_up(monkeypatch, capsys):
    """A CUDA run's start: the cap becomes the allocator's fraction of the card, expandable segments are switched on
    with one line, and a cap larger than the card is ignored with one warning. CUDA's calls are stood in for."""
    import torch

    from holotrain.parallel import DistEnv
    from holotrain.train import trainer

    card = 80e9
    fractions, settings = [], []
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device: type("Props", (), {"total_memory": int(card)})())
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda f, device=None: fractions.append(f))
    monkeypatch.setattr(torch._C, "_accelerator_setAllocatorSettings", settings.append, raising=False)
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    env = DistEnv(rank=0, world_size=1, local_rank=0, device=torch.device("cuda", 0), local_world_size=1)

    trainer._set_up_gpu_memory(load_config(None, ["--hw.gpu_memory_gb=24"]), env)
    assert fractions == [pytest.approx(24e9 / card)] and settings == ["expandable_segments:True"]
    out = capsys.readouterr().out.splitlines()
    assert out == ["holotrain: CUDA allocator: expandable segments (for hw.gpu_memory_gb = 24, against "
                   "fragmentation; PYTORCH_CUDA_ALLOC_CONF chooses otherwise)"]

    fractions.clear()
    trainer._set_up_gpu_memory(load_config(None, ["--hw.gpu_memory_gb=100"]), env)
    assert fractions == [1.0]
    warnings = [line for line in capsys.readouterr().out.splitlines() if "warning" in line]
    assert len(warnings) == 1 and warnings[0].startswith("holotrain: warning: hw.gpu_memory_gb = 100 is larger")

    # Once "auto" has chosen the long-sequence levers, the second ask switches them on.
    settings.clear()
    assert not trainer._set_up_gpu_memory(load_config(), env) and settings == []
    assert trainer._expandable_segments(load_config(None, ["--memory.ffn_tiles=8"]), env)
    assert settings == ["expandable_segments:True"] and "long-sequence" in capsys.readouterr().out

    fractions.clear()
    settings.clear()
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:False")
    trainer._set_up_gpu_memory(load_config(None, ["--memory.offload=true"]), env)
    assert fractions == [] and settings == [] and capsys.readouterr().out == ""


def test_help_lists_every_key_with_its_default_and_comment():
    import dataclasses
    import typing

    from holotrain.config_help import config_reference

    proc = run_cli_here("train", "--help")
    assert proc.returncode == 0, proc.stderr
    text = " ".join(proc.stdout.split())  # comments wrap over lines
    assert "training.steps = 150" in text
    assert 'training.batch_size = 16 global: sequences per optimizer step, over all ranks and micro-batches' in text
    for section, cls in typing.get_type_hints(Config).items():
        for f in dataclasses.fields(cls):
            assert f"{section}.{f.name} = " in text
    # The [[data.sources]] tables' keys, from SourceConfig, with their comments.
    assert "[[data.sources]]" in text and 'path = ""' in text
    assert "weight_schedule = [] Piecewise-linear weight over optimizer steps" in text
    assert all(len(line) <= 100 for line in config_reference().splitlines())

    one = run_cli_here("plan", "--help", "data")
    assert one.returncode == 0 and "data.seq_len = 256" in one.stdout and "training.steps" not in one.stdout
    wrong = run_cli_here("train", "--help", "trainig")
    assert wrong.returncode == 2 and "did you mean training?" in wrong.stderr


@pytest.mark.parametrize(
    "args, message",
    [
        (["--training.stpes=5"], "unknown config key training.stpes (did you mean training.steps?)"),
        (["--trainig.steps=5"], "unknown config section trainig in trainig.steps (did you mean training.steps?)"),
        (["--training.seq_len=64"], "unknown config key training.seq_len (did you mean data.seq_len?)"),
        (["--confg", "x.toml"], "unrecognized argument '--confg' (did you mean --config?)"),
        (["--steps=5"], "unrecognized argument '--steps=5' (did you mean --training.steps?)"),
        (["--training.steps", "5"], "(a value goes after '=': --training.steps=5)"),
    ],
    ids=["key", "section", "wrong-section", "option", "bare-key", "space-for-equals"],
)
def test_a_misspelt_name_gets_the_closest_known_one(args, message):
    proc = run_cli_here("train", *args)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], proc.stderr


@pytest.mark.parametrize(
    "toml, message",
    [
        ("[training]\nstpes = 5\n", "unknown config key training.stpes (did you mean training.steps?)"),
        ("[trainig]\nsteps = 5\n", "(did you mean training.steps?)"),
        ('[[data.sources]]\nname = "a"\npth = "a.jsonl"\n',
         "unknown config key data.sources[0].pth (did you mean data.sources[0].path?)"),
        ("steps = 5\n", "(did you mean steps in [training]?)"),
        ('[training]\nsteps = "many"\n', "training.steps: expected int"),
    ],
    ids=["key", "section", "source-key", "key-outside-a-section", "value"],
)
def test_a_toml_mistake_names_the_file_and_the_closest_key(tmp_path, toml, message):
    path = tmp_path / "job.toml"
    path.write_text(toml)
    proc = run_cli_here("train", "--config", path)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"holotrain: error: {path}: ") and message in lines[0], proc.stderr


def test_relative_paths_in_a_toml_are_relative_to_its_folder(tmp_path, monkeypatch):
    jobs, here, home = tmp_path / "jobs", tmp_path / "here", tmp_path / "home"
    for folder in (jobs, here, home):
        folder.mkdir()
    jobs, here, home = jobs.resolve(), here.resolve(), home.resolve()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(here)
    (jobs / "sft.toml").write_text(
        '[job]\nrun_dir = "runs/sft"\n'
        '[model]\ninit_from = "../models/base"\n'
        '[data]\ntokenizer = "tok/tokenizer.json"\nchat_template = "chat.jinja"\ncache_dir = "cache"\n'
        '[[data.sources]]\nname = "web"\npath = "data/*.jsonl"\n'
        '[[data.sources]]\nname = "mine"\npath = "~/corpus/*.jsonl"\n'
        f'[[data.sources]]\nname = "abs"\npath = "{tmp_path / "abs.jsonl"}"\n'
    )
    cfg = load_config("../jobs/sft.toml")
    assert [s.path for s in cfg.data.sources] == [str(jobs / "data" / "*.jsonl"), str(home / "corpus" / "*.jsonl"),
                                                 str(tmp_path / "abs.jsonl")]
    assert cfg.data.tokenizer == str(jobs / "tok" / "tokenizer.json")
    assert cfg.data.chat_template == str(jobs / "chat.jinja")
    assert cfg.model.init_from == str(tmp_path.resolve() / "models" / "base")
    # Output folders stay relative to the current directory.
    assert cfg.job.run_dir == "runs/sft" and cfg.run_dir.resolve() == here / "runs" / "sft"
    assert cfg.data.cache_dir == str(here / "cache")
    assert cfg.job.name == "sft"

    # On the command line, relative to the current directory; a template's name is not a path.
    cli = load_config("../jobs/sft.toml", ["--data.tokenizer=t.json", "--model.init_from=base",
                                           "--data.chat_template=chatml", "--job.run_dir=~/runs/x"])
    assert (cli.data.tokenizer, cli.model.init_from) == (str(here / "t.json"), str(here / "base"))
    assert cli.data.chat_template == "chatml" and cli.job.run_dir == str(home / "runs" / "x")

    # The saved config means the same wherever it is read from.
    saved = tmp_path / "elsewhere" / "config.toml"
    saved.parent.mkdir()
    saved.write_text(cfg.to_toml())
    assert load_config(saved).to_dict() == cfg.to_dict()

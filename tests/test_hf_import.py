"""model.init_from: Hugging Face models (made here with transformers, random weights) imported into holotrain's
Llama: logits equal transformers', sharded imports equal one rank's, export -> import is bit-identical, and a bad
directory is one error line."""

import json
import shutil

import pytest
import torch

from tests.conftest import REPO, run_cli_here
from tests.hf_models import KINDS, VOCAB, make_hf_model

TOKENS = torch.randint(0, VOCAB, (2, 32), generator=torch.Generator().manual_seed(0))


def _imported(directory, *overrides):
    from holotrain.config import load_config, resolve
    from holotrain.parallel import DistEnv
    from holotrain.train.trainer import build_model

    cfg = resolve(load_config(None, [f"--model.init_from={directory}", "--data.seq_len=32", "--job.device=cpu",
                                     *overrides]), tokenizer_vocab=VOCAB)
    env = DistEnv(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    return build_model(cfg, env, torch.float32).eval()


@pytest.mark.parametrize("kind", ["llama", "gqa_tied", "qwen2"])  # the families at T = 256: tests/test_families.py
def test_imported_logits_match_transformers(kind, tmp_path):
    hf = make_hf_model(tmp_path, kind, shard=kind == "llama")
    model = _imported(tmp_path)
    assert model.args.tie_embeddings == KINDS[kind]["tie_word_embeddings"]
    assert (model.output.weight is model.tok_embeddings.weight) == model.args.tie_embeddings
    with torch.no_grad():
        diff = (model(TOKENS) - hf(TOKENS).logits).abs().max().item()
    assert diff <= 1e-4, diff
    # The same network from random weights is far from it: the comparison can fail.
    with torch.no_grad():
        model.init_weights(seed=0)
        assert (model(TOKENS) - hf(TOKENS).logits).abs().max().item() > 1e-2


def test_a_bad_directory_is_one_error_line(tmp_path):
    from holotrain.errors import ConfigError

    good = tmp_path / "good"
    make_hf_model(good, "llama", shard=True)

    def broken(name, change):
        d = tmp_path / name
        shutil.copytree(good, d)
        change(d)
        return d

    def edit_config(d, **keys):
        config = json.loads((d / "config.json").read_text())
        config.update(keys)
        (d / "config.json").write_text(json.dumps(config))

    missing_shard = broken("missing", lambda d: (d / "model-00002-of-00006.safetensors").unlink())
    with pytest.raises(ConfigError, match="model-00002-of-00006.safetensors.*missing"):
        _imported(missing_shard)
    gpt2 = broken("gpt2", lambda d: edit_config(d, model_type="gpt2"))
    with pytest.raises(ConfigError, match="model_type 'gpt2' is not supported"):
        _imported(gpt2)
    wider = broken("wider", lambda d: edit_config(d, intermediate_size=192))
    with pytest.raises(ConfigError, match=r"mlp\.gate_proj\.weight has shape \[160, 64\], the model expects \[192, 64\]"):
        _imported(wider)
    with pytest.raises(ConfigError, match=r"model\.n_layers = 3 differs from model\.init_from's 2"):
        _imported(good, "--model.n_layers=3")
    no_weights = broken("none", lambda d: [p.unlink() for p in d.glob("model*.safetensors*")])
    with pytest.raises(ConfigError, match="no model.safetensors"):
        _imported(no_weights)
    # Through the command line: one line naming the file, no traceback.
    proc = run_cli_here("train", f"--model.init_from={gpt2}", f"--job.run_dir={tmp_path / 'run'}")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "config.json" in proc.stderr


def _jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


@pytest.mark.slow
def test_import_train_export_import_round_trip(tmp_path):
    """Continue training an imported Qwen2-style model (biases, tied head) on a text and a chat source, export it:
    transformers loads the export with the same logits, and init_from reads it back bit for bit."""
    import transformers

    from holotrain.config import load_config
    from holotrain.errors import ConfigError
    from holotrain.export import export_hf
    from holotrain.model import build
    from holotrain.train.checkpoint import latest_checkpoint, load_model_weights
    from holotrain.train.resolve import model_args
    from holotrain.train.trainer import train

    hf_dir, run_dir, out = tmp_path / "hf", tmp_path / "run", tmp_path / "export"
    make_hf_model(hf_dir, "qwen2")
    text = _jsonl(tmp_path / "text.jsonl", [{"text": f"the quick brown fox {i} jumps over the lazy dog"} for i in range(200)])
    chat = _jsonl(tmp_path / "chat.jsonl", [{"messages": [{"role": "user", "content": f"what is {i}?"},
                                                          {"role": "assistant", "content": f"{i} is a number"}]}
                                            for i in range(200)])
    toml = tmp_path / "job.toml"
    toml.write_text(f'[[data.sources]]\nname = "text"\npath = "{text}"\n\n'
                    f'[[data.sources]]\nname = "chat"\npath = "{chat}"\nformat = "chat"\n')
    cfg = load_config(toml, [f"--model.init_from={hf_dir}", f"--job.run_dir={run_dir}", "--job.device=cpu",
                             "--data.seq_len=32", "--data.workers=1", "--training.batch_size=4", "--training.steps=3",
                             "--training.log_every=1", "--checkpoint.every=3", "--profile.tensorboard=false",
                             "--profile.progress=false", "--profile.report=false", "--hw.telemetry=false"])
    rows = train(cfg)
    assert [r["step"] for r in rows] == [1, 2, 3]  # a new run from imported weights: step 0, fresh optimizer
    assert all(r["loss"] == r["loss"] for r in rows)
    saved = load_config(run_dir / "config.toml")
    assert saved.model.tie_embeddings and saved.model.qkv_bias and saved.data.tokenizer == str(hf_dir / "tokenizer.json")
    assert (run_dir / "tokenizer_config.json").is_file()

    trained = build(model_args(saved))
    load_model_weights(latest_checkpoint(run_dir), trained)
    export_hf(run_dir, out)
    assert json.loads((out / "config.json").read_text())["architectures"] == ["Qwen2ForCausalLM"]
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        assert (trained.eval()(TOKENS) - hf(TOKENS).logits).abs().max().item() <= 1e-4
    again, ours = _imported(out), _imported(run_dir)  # the export, and the run itself (its newest DCP checkpoint)
    for name, value in trained.state_dict().items():
        assert torch.equal(again.state_dict()[name], value), name
        assert torch.equal(ours.state_dict()[name], value), name
    with pytest.raises(ConfigError, match=r"model\.dim = 128 differs from model\.init_from's 64"):
        _imported(run_dir, "--model.dim=128")
    # The trained weights moved away from the imported ones (the comparison above is not of the import itself).
    assert not torch.equal(trained.state_dict()["layers.0.attention.wq.bias"],
                           _imported(hf_dir).state_dict()["layers.0.attention.wq.bias"])


@pytest.mark.slow
def test_sharded_imports_match_one_rank(tmp_path):
    """Two gloo ranks: FSDP2 (dp=2) and tensor parallelism (tp=2) each import the same directories and give one
    rank's logits (one launch, both layouts, two model families)."""
    for kind in ("llama", "qwen2"):
        make_hf_model(tmp_path / kind, kind, shard=kind == "llama")
    out = torchrun_script(2, REPO / "tests" / "hf_import_worker.py", str(tmp_path / "llama"), str(tmp_path / "qwen2"))
    assert "HF IMPORT WORKER OK" in out


def torchrun_script(nproc, script, *args):
    import os
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", str(script),
           *args]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, f"{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
    return proc.stdout



def test_every_lever_starts_from_the_imported_weights(tmp_path):
    """Offload engine (host master weights from the shards), activation checkpointing and FP8 (emulated) each train
    their first step from the imported weights: its loss is transformers' loss on the batch, and offload's second
    step equals plain AdamW's."""
    from holotrain.config import load_config, resolve
    from holotrain.parallel import DistEnv
    from holotrain.train.trainer import TrainStep, build_model, build_optimizer

    hf = make_hf_model(tmp_path, "gqa_tied")
    g = torch.Generator().manual_seed(3)
    batches = [(torch.randint(0, VOCAB, (2, 32), generator=g), torch.randint(0, VOCAB, (2, 32), generator=g))
               for _ in range(2)]
    with torch.no_grad():
        want = torch.nn.functional.cross_entropy(hf(batches[0][0]).logits.flatten(0, 1), batches[0][1].flatten()).item()

    def two_steps(*overrides):
        cfg = resolve(load_config(None, [f"--model.init_from={tmp_path}", "--data.seq_len=32", "--job.device=cpu",
                                         *overrides]), tokenizer_vocab=VOCAB)
        env = DistEnv(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
        model = build_model(cfg, env, torch.float32)
        opt = build_optimizer(model, cfg, env, torch.float32)
        step = TrainStep(model, opt, cfg, env, torch.float32)
        try:
            return [step(lambda m, b=b: b, 1, 1e-3)[0].item() for b in batches]
        finally:
            opt.close()

    plain = two_steps()
    offload = two_steps("--memory.offload=true", "--memory.offload_kernel=torch")
    checkpointed = two_steps("--memory.activation_checkpointing=full")
    fp8 = two_steps("--training.fp8=tensorwise", "--training.fp8_emulate=true")
    for losses in (plain, offload, checkpointed):
        assert abs(losses[0] - want) <= 1e-4 * want, (losses, want)
    assert abs(offload[1] - plain[1]) <= 1e-4 * plain[1] and abs(checkpointed[1] - plain[1]) <= 1e-4 * plain[1]
    assert abs(fp8[0] - want) <= 0.02 * want, (fp8, want)  # FP8's rounding, from the same weights
    assert plain[1] != plain[0]



def test_the_planner_reads_the_job_from_init_from(tmp_path):
    from holotrain.plan.planner import job_config

    make_hf_model(tmp_path, "qwen2")
    cfg = job_config(None, [f"--model.init_from={tmp_path}", "--data.seq_len=32"])
    assert (cfg.model.dim, cfg.model.vocab_size, cfg.model.qkv_bias, cfg.model.tie_embeddings) == (64, VOCAB, True, True)
    assert cfg.data.tokenizer == str(tmp_path / "tokenizer.json")


def test_a_chat_template_in_its_own_file_is_the_tokenizers(tmp_path):
    from holotrain.data.corpus import tokenizer_config

    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    assert "chat_template" not in tokenizer_config(tmp_path / "tokenizer.json")
    (tmp_path / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
    config = tokenizer_config(tmp_path / "tokenizer.json")
    assert config == {"eos_token": "</s>", "chat_template": "{{ messages[0]['content'] }}"}

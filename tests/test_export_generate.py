"""Exports that generate: a chat fine-tune, exported and loaded by transformers alone, answers a prompt and stops at
the chat template's end-of-turn token with no generation arguments; special ids outside the vocabulary are refused."""

import json
import random
import shutil

import pytest
import torch

from tests.conftest import run_cli, run_cli_here, tiny_args

SPECIALS = ["<|endoftext|>", "<|pad|>", "<|im_start|>", "<|im_end|>"]
USER_WORDS = ["why", "how", "when", "where", "which", "who", "whose", "whom", "what"]
ANSWER = "Sure, done."  # every answer: a tiny model learns it, and the end-of-turn token after it, in a few steps


@pytest.fixture(scope="module")
def chat_export(tmp_path_factory):
    """A tiny chat fine-tune through the CLI (a BPE with ChatML's special tokens and no tokenizer_config.json;
    data.chat_template = "chatml"), and its export. Returns (run_dir, export_dir)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    root = tmp_path_factory.mktemp("chat_export")
    rng = random.Random(0)
    prompts = [" ".join(rng.choice(USER_WORDS) for _ in range(rng.randint(1, 6))) for _ in range(300)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(prompts + [ANSWER, "user assistant"] * 20, trainer=trainer)
    tok.save(str(root / "tokenizer.json"))
    data = root / "chats.jsonl"
    data.write_text("".join(json.dumps({"prompt": p, "response": ANSWER}) + "\n" for p in prompts))
    job = root / "job.toml"
    job.write_text(f'[[data.sources]]\nname = "sft"\npath = "{data}"\nformat = "chat"\n')
    run_dir, out = root / "run", root / "hf"
    run_cli("train", "--config", str(job), *tiny_args(run_dir, **{
        "data.tokenizer": root / "tokenizer.json", "data.chat_template": "chatml", "data.seq_len": 64,
        "data.workers": 1, "training.steps": 30, "training.lr": 1e-2, "training.log_every": 10,
        "checkpoint.every": 0, "profile.report": False, "hw.telemetry": False}))
    run_cli("export", str(run_dir), str(out))
    return run_dir, out


def test_chat_export_generate_stops_at_the_end_of_turn(chat_export):
    """transformers alone (AutoModelForCausalLM, AutoTokenizer from the export): the chat template renders the
    prompt, generate() with nothing but the inputs answers greedily and ends at <|im_end|>, not at its length limit."""
    transformers = pytest.importorskip("transformers")
    _, out = chat_export
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    im_end, eos = tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.convert_tokens_to_ids("<|endoftext|>")
    generation = json.loads((out / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [eos, im_end] and generation["do_sample"] is False
    assert model.generation_config.eos_token_id == [eos, im_end]

    for prompt in ("why how", "where", "who whose what when"):
        inputs = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                               return_tensors="pt", return_dict=True)
        assert tokenizer.decode(inputs["input_ids"][0]).endswith("<|im_start|>assistant\n")
        with torch.no_grad():
            output = model.generate(**inputs)
        answer = output[0, inputs["input_ids"].shape[1]:].tolist()
        # Stopped by the end-of-turn token: the last token, the only one, and far inside transformers' default of
        # 20 new tokens (a model that stopped only at end-of-text would run on past it to the limit).
        assert answer[-1] == im_end and answer.count(im_end) == 1 and len(answer) < 10, tokenizer.decode(answer)
        assert tokenizer.decode(answer) == ANSWER + "<|im_end|>"


def test_holotrain_generate_answers_from_the_run_and_from_its_export(chat_export):
    """`holotrain generate` on the run (its newest checkpoint) and on the export (a Hugging Face directory): the
    prompt rendered as a chat turn, the answer greedy and stopped at <|im_end|>, the same from both. A bad argument
    is one line, exit 2."""
    run_dir, out = chat_export
    for source in (run_dir, out):
        proc = run_cli("generate", str(source), "--chat", "--prompt", "who whose what when", "--max-new-tokens", "30")
        assert proc.stdout.strip() == ANSWER, (source, proc.stdout, proc.stderr[-2000:])
    proc = run_cli("generate", str(run_dir), "--prompt", "why", "--temperature", "-1", check=False)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1].startswith("holotrain: error: --temperature")


def test_chat_export_files_carry_the_runs_tokens_and_template(chat_export):
    from tokenizers import Tokenizer

    from holotrain.data.chat import template_source

    run_dir, out = chat_export
    tok = Tokenizer.from_file(str(run_dir / "tokenizer.json"))
    ids = {t: tok.token_to_id(t) for t in SPECIALS}
    config = json.loads((out / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (
        None, ids["<|endoftext|>"], ids["<|pad|>"])
    assert max(ids.values()) < config["vocab_size"]
    tok_config = json.loads((out / "tokenizer_config.json").read_text())
    assert tok_config["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert (tok_config["eos_token"], tok_config["pad_token"], tok_config["bos_token"]) == (
        "<|endoftext|>", "<|pad|>", None)
    assert tok_config["model_max_length"] == config["max_position_embeddings"] == 64
    assert tok_config["chat_template"] == template_source("chatml", run_dir / "tokenizer.json")
    assert not (out / "chat_template.jinja").exists()


def test_a_special_id_outside_the_vocabulary_is_one_error_line(chat_export, tmp_path):
    """A tokenizer whose end-of-text token lies past the model's embedding: the export refuses it, naming the file,
    and writes nothing."""
    from tokenizers import Tokenizer

    run_dir, _ = chat_export
    copy, out = tmp_path / "run", tmp_path / "hf"
    shutil.copytree(run_dir, copy)
    tok = Tokenizer.from_file(str(copy / "tokenizer.json"))
    tok.add_special_tokens([f"<|extra_{i}|>" for i in range(64)])
    tok.save(str(copy / "tokenizer.json"))
    (copy / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|extra_63|>"}))
    proc = run_cli_here("export", copy, out)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "tokenizer.json" in lines[0] and "'<|extra_63|>'" in lines[0], proc.stderr
    assert "outside the model's vocabulary (config.json vocab_size = 320)" in lines[0]
    assert not out.exists()


def test_the_end_of_turn_token_of_each_template(tmp_path):
    """The token that closes an assistant turn: ChatML's <|im_end|>, Llama 3's <|eot_id|>; none where the template
    ends a turn with text, or where the tokenizer has no special token for the template's end (a BPE without it)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    from holotrain.data.chat import end_of_turn, template_source

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|begin_of_text|>", "<|start_header_id|>",
                "<|end_header_id|>", "<|eot_id|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["Hi Hello user assistant"] * 10, trainer=trainer)
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<|begin_of_text|>"}))
    assert end_of_turn(template_source("chatml", path), path, tok) == tok.token_to_id("<|im_end|>")
    assert end_of_turn(template_source("llama3", path), path, tok) == tok.token_to_id("<|eot_id|>")
    plain = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n\n{% endfor %}"
    assert end_of_turn(plain, path, tok) is None
    bare = Tokenizer(models.BPE())  # holotrain's own BPE: <|im_end|> is bytes to it, not one token
    bare.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bare.train_from_iterator(["Hi Hello"], trainer=trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    assert end_of_turn(template_source("chatml", path), path, bare) is None

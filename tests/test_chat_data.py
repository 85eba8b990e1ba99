"""Chat fine-tuning data (data.sources format = "chat"): rendering as transformers does, the mask of assistant tokens
through loaders, packing, state and the Ray backend, bad records and config errors, and one training run whose
targets are exactly the assistant tokens."""

import json
import math
import random
from pathlib import Path

import numpy as np
import pytest

from holotrain.config import load_config, resolve
from holotrain.data.chat import ChatReader, ChatTemplate, reader_for, special_tokens, template_source
from holotrain.data.packing import Packer, mask_runs, runs_mask, sample_arrays
from holotrain.data.plane import Constructor, LoaderPool, PlaneSpec, SourceStream
from holotrain.data.sources import SourceConfig, plan_chunks, read_chunk, source_files
from holotrain.data.worker import tokenize_chunk
from holotrain.errors import ConfigError
from tests.conftest import tiny_args

# The ChatML template as Hugging Face tokenizer_config.json files hold it.
CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>'"
          " + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
# Meta-Llama-3-8B-Instruct's.
LLAMA3 = ("{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + "
          "message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
          "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}"
          "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")
SPECIALS = ["<|endoftext|>", "<|pad|>", "<|im_start|>", "<|im_end|>"]
# Disjoint vocabularies, so that decoded targets show whose words they are.
SYSTEM_WORDS = "be brief kind exact polite".split()
USER_WORDS = "why how when where which who whose whom".split()
ASSISTANT_WORDS = "alpha beta gamma delta epsilon zeta eta theta".split()


def _words(rng, vocab, lo=1, hi=8) -> str:
    return " ".join(rng.choice(vocab) for _ in range(rng.randint(lo, hi)))


def conversation(rng, turns: int) -> list[dict]:
    messages = [{"role": "system", "content": _words(rng, SYSTEM_WORDS)}] if rng.random() < 0.5 else []
    for _ in range(turns):
        messages += [{"role": "user", "content": _words(rng, USER_WORDS)},
                     {"role": "assistant", "content": _words(rng, ASSISTANT_WORDS)}]
    return messages


def write_chats(path: Path, n: int, seed: int, max_turns: int = 3) -> None:
    """Conversations as `messages` lists, every fourth as a prompt/response pair."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for i in range(n):
            if i % 4 == 3:
                record = {"prompt": _words(rng, USER_WORDS), "response": _words(rng, ASSISTANT_WORDS)}
            else:
                record = {"messages": conversation(rng, rng.randint(1, max_turns))}
            f.write(json.dumps(record) + "\n")


def messages_of(record: dict) -> list[dict]:
    if "messages" in record:
        return record["messages"]
    return [{"role": "user", "content": record["prompt"]}, {"role": "assistant", "content": record["response"]}]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    """A byte-level BPE with ChatML's special tokens, and a tokenizer_config.json with the ChatML template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    d = tmp_path_factory.mktemp("tokenizer")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    rng = random.Random(0)
    texts = [json.dumps(conversation(rng, 2)) for _ in range(200)]
    tok.train_from_iterator(texts + ["system user assistant"] * 20, trainer=trainer)
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": CHATML, "eos_token": "<|endoftext|>", "pad_token": "<|pad|>", "bos_token": "<|endoftext|>"}))
    return d


@pytest.fixture(scope="module")
def hf_tok(tok_dir):
    transformers = pytest.importorskip("transformers")
    return transformers.PreTrainedTokenizerFast(tokenizer_file=str(tok_dir / "tokenizer.json"), chat_template=CHATML,
                                                eos_token="<|endoftext|>", bos_token="<|endoftext|>")


def hf_document(hf_tok, messages: list[dict], eos_id: int) -> tuple[np.ndarray, np.ndarray]:
    """A conversation as the data plane should deliver it, worked out with transformers alone: the tokens of its
    rendering plus end-of-text, and whether each is in an assistant turn (its rendering through the turn, less the
    rendering up to its generation prompt)."""
    text = hf_tok.apply_chat_template(messages, tokenize=False)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] == "assistant":
            start = len(hf_tok.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True))
            spans.append((start, len(hf_tok.apply_chat_template(messages[: i + 1], tokenize=False))))
    enc = hf_tok(text, add_special_tokens=False, return_offsets_mapping=True)
    mask = [any(a < stop and max(b, a + 1) > start for start, stop in spans) for a, b in enc["offset_mapping"]]
    return np.array(enc["input_ids"] + [eos_id]), np.array(mask + [False])


def test_rendering_matches_transformers(tok_dir, hf_tok):
    rng = random.Random(1)
    chatml = ChatTemplate(CHATML, special_tokens(tok_dir / "tokenizer.json"))
    named = ChatTemplate(template_source("chatml", tok_dir / "tokenizer.json"), {})
    own = ChatTemplate(template_source("", tok_dir / "tokenizer.json"), {})
    llama3 = ChatTemplate(template_source("llama3", tok_dir / "tokenizer.json"), {"bos_token": "<|endoftext|>"})
    hf_llama3 = type(hf_tok)(tokenizer_file=str(tok_dir / "tokenizer.json"), chat_template=LLAMA3, bos_token="<|endoftext|>")
    for turns in (1, 2, 3):
        messages = conversation(rng, turns)
        messages[-1]["content"] += "  \n"  # llama3 trims it
        for prompt in (False, True):
            want = hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=prompt)
            assert chatml.render(messages, prompt) == named.render(messages, prompt) == own.render(messages, prompt) == want
            assert llama3.render(messages, prompt) == hf_llama3.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=prompt)
    # A template that marks assistant text with {% generation %} (for Hugging Face's assistant masks) renders too.
    marked = CHATML.replace("{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}",
                            "{{'<|im_start|>' + message['role'] + '\n'}}{% generation %}{{message['content'] + "
                            "'<|im_end|>' + '\n'}}{% endgeneration %}")
    assert ChatTemplate(marked, {}).render(messages) == hf_tok.apply_chat_template(messages, tokenize=False,
                                                                                   chat_template=marked)


def test_loader_marks_exactly_the_assistant_tokens(tok_dir, hf_tok, tmp_path):
    """A chunk as a loader tokenizes it: its mask agrees with transformers' rendering and offsets, and decodes to the
    assistant turns with their end-of-turn token."""
    from tokenizers import Tokenizer

    write_chats(tmp_path / "c.jsonl", 40, seed=2)
    src = SourceConfig(name="c", path=str(tmp_path / "c.jsonl"), format="chat")
    files = source_files(src)
    tok_path = tok_dir / "tokenizer.json"
    tok, eos = Tokenizer.from_file(str(tok_path)), hf_tok.convert_tokens_to_ids("<|endoftext|>")
    chat = reader_for(src, template_source("", tok_path), tok_path)
    out = tokenize_chunk(plan_chunks(0, files, 1 << 20)[0], files, src.text_field, tok, eos, chat)
    records = [json.loads(line) for line in (tmp_path / "c.jsonl").read_text().splitlines()]
    assert len(out.keys) == len(records) and out.text.skipped == 0
    for d, record in enumerate(records):
        tokens, mask = out.tokens[out.starts[d] : out.starts[d + 1]], out.mask[out.starts[d] : out.starts[d + 1]]
        want_tokens, want_mask = hf_document(hf_tok, messages_of(record), eos)
        assert np.array_equal(tokens, want_tokens) and np.array_equal(mask, want_mask)
        answers = [m["content"] + "<|im_end|>\n" for m in messages_of(record) if m["role"] == "assistant"]
        assert tok.decode(tokens[mask].tolist(), skip_special_tokens=False) == "".join(answers)


def test_bad_chat_records_are_skipped_and_counted(tok_dir, tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    good = [{"role": "user", "content": "why"}, {"role": "assistant", "content": "alpha"}]
    lines = [
        {"messages": good},
        {"messages": "not a list"},
        {"messages": []},
        {"messages": [{"role": "user"}]},  # no content
        {"messages": [{"role": "robot", "content": "x"}, {"role": "assistant", "content": "y"}]},
        {"messages": [{"role": "user", "content": "only a question"}]},
        {"prompt": "why", "response": 3},
        {"text": "neither shape"},
        {"messages": good + [{"role": "user", "content": "stop"}]},  # refused by the template below
        {"prompt": "why", "response": "beta"},
    ]
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in lines[:3]) + '\n{"messages": [\n'
                    + "\n".join(json.dumps(r) for r in lines[3:]) + "\n")
    template = CHATML.replace("{% for message in messages %}", "{% if messages[-1]['role'] == 'user' and messages|length"
                              " > 2 %}{{ raise_exception('ends with a question') }}{% endif %}{% for message in messages %}")
    src = SourceConfig(name="c", path=str(path), format="chat")
    chat = ChatReader(src, ChatTemplate(template, {}))
    files = source_files(src)
    part = read_chunk(plan_chunks(0, files, 1 << 20)[0], files, "text", 0, chat)
    assert [t.count("<|im_start|>") for t in part.texts] == [2, 2]
    assert [o for _, o in part.keys] == [0, path.read_text().index('{"prompt": "why", "response": "beta"}')]
    assert part.skipped == 9 and len(part.skip_examples) == 5
    assert part.skip_examples == [f"{path}:2: 'messages' is not a list", f"{path}:3: 'messages' is empty",
                                  f"{path}:4: not valid JSON",
                                  f"{path}:5: message 0 is not a {{role, content}} object with string content",
                                  f"{path}:6: message 0 has unknown role 'robot' (known: system, user, assistant)"]
    # The examples stop at five; the later records' reasons:
    assert [chat_reason(chat, r) for r in lines[5:9]] == [
        "no assistant message: nothing to train on", "'prompt' and 'response' must be non-empty strings",
        "no 'messages' list and no 'prompt'/'response' pair", "the chat template refused it: ends with a question"]

    # Parquet: a messages column (list of structs) or prompt/response columns; without either, one error naming the file.
    pq.write_table(pa.table({"messages": [good, [], good]}), tmp_path / "m.parquet")
    pq.write_table(pa.table({"prompt": ["why", "how"], "response": ["alpha", ""]}), tmp_path / "p.parquet")
    pq.write_table(pa.table({"body": ["x"]}), tmp_path / "x.parquet")
    for name, texts, skipped in (("m", 2, 1), ("p", 1, 1)):
        pfiles = source_files(SourceConfig(name=name, path=str(tmp_path / f"{name}.parquet"), format="chat"))
        part = read_chunk(plan_chunks(0, pfiles, 1 << 20)[0], pfiles, "text", 0, chat)
        assert (len(part.texts), part.skipped) == (texts, skipped)
    xfiles = source_files(SourceConfig(name="x", path=str(tmp_path / "x.parquet"), format="chat"))
    with pytest.raises(ConfigError, match=r"x\.parquet: no column 'messages' \(data\.sources\[c\]\.messages_field\)"):
        read_chunk(plan_chunks(0, xfiles, 1 << 20)[0], xfiles, "text", 0, chat)


def chat_reason(chat: ChatReader, record: dict) -> str:
    from holotrain.data.sources import BadRecord

    with pytest.raises(BadRecord) as e:
        chat.read(record)
    return str(e.value)


def test_a_long_chat_document_is_split_with_its_mask():
    """Pieces of a document longer than a sample keep their slice of the mask; a target survives only where it
    predicts a trained-on token of the same piece. Text documents beside it keep every target."""
    rng = np.random.default_rng(3)
    length = 17
    packer = Packer(length, max_open=4)
    docs = {}
    for i in range(60):
        n = int(rng.integers(3, 60))
        tokens = rng.integers(2, 99, size=n).astype(np.uint32)
        mask = rng.random(n) < 0.5 if i % 2 else None  # odd documents are chat documents
        docs[i] = (tokens, mask)
        packer.add(tokens, (0, 0, 0, i), mask)
    bins = packer.take(len(packer.ready))
    x, y, _ = sample_arrays(bins, length, pad_id=1)
    split = 0
    for r, b in enumerate(bins):
        pos = 0
        for p in b.pieces:
            tokens, mask = docs[p.key[3]]
            start, n = p.key[4], len(p.tokens)
            split += start > 0
            assert np.array_equal(p.tokens, tokens[start : start + n])
            assert (p.mask is None) == (mask is None)
            trained = np.ones(n, bool) if mask is None else mask[start : start + n]
            if mask is not None:
                assert np.array_equal(p.mask, trained)
            want = np.where(trained[1:], p.tokens[1:].astype(np.int64), -100)
            got = y[r, pos : pos + n - 1]
            assert np.array_equal(got, want)
            if pos + n - 1 < length - 1:
                assert y[r, pos + n - 1] == -100  # the piece's last token predicts nothing
            pos += n
        assert (y[r, pos:] == -100).all()
    assert split > 10


def test_mask_runs_and_packer_state_round_trip():
    for mask in ([], [True] * 5, [False] * 5, [True, False, False, True, True, False, True]):
        m = np.array(mask, dtype=bool)
        assert np.array_equal(runs_mask(mask_runs(m), len(m)), m)
    rng = np.random.default_rng(4)
    docs = [(rng.integers(2, 99, size=int(rng.integers(3, 40))).astype(np.uint32), rng.random(40) < 0.5 if i % 3 else None)
            for i in range(80)]
    docs = [(t, None if m is None else m[: len(t)]) for t, m in docs]
    first = Packer(23, max_open=6)
    for i, (t, m) in enumerate(docs[:40]):
        first.add(t, (0, 0, 0, i), m)
    state = json.loads(json.dumps(first.state_dict()))  # what a checkpoint stores
    assert any(len(p) == 3 for b in state["open"] + state["ready"] for p in b)  # chat pieces keep a mask
    second = Packer(23, max_open=6)
    second.load_state_dict(state)
    for packer in (first, second):
        for i, (t, m) in enumerate(docs[40:], start=40):
            packer.add(t, (0, 0, 0, i), m)
    n = len(first.ready)
    assert len(second.ready) == n > 20
    a, b = (sample_arrays(p.take(n), 23, pad_id=1) for p in (first, second))
    for u, v in zip(a, b):  # a mask lost on the way would keep targets that the first packer drops
        assert np.array_equal(u, v)


def _chat_constructor(tok_dir, data: Path, backend: str):
    src = SourceConfig(name="chat", path=str(data), format="chat")
    tok_path = tok_dir / "tokenizer.json"
    spec = PlaneSpec(sources=[src], tokenizer_path=str(tok_path), eos_id=0, pad_id=1, seq_len=48, global_batch=8,
                     world_size=1, local_ranks=[0], micro_batch=8, accum=1, seed=0, max_workers=1, chunk_bytes=4000,
                     backend=backend, chat_template=template_source("", tok_path))
    files = [source_files(src)]
    if backend == "ray":
        from holotrain.data.ray_backend import RayLoaderPool

        pool = RayLoaderPool(spec, files)
    else:
        pool = LoaderPool(spec, files)
    return Constructor(spec, [SourceStream(0, plan_chunks(0, files[0], spec.chunk_bytes), pool, 0, True, "chat")]), pool


def test_constructor_state_replays_the_same_masked_targets(tok_dir, tmp_path):
    """Through loader processes and shared memory: a constructor resumed from a state (with the Ray backend where
    Ray is installed) produces the same inputs and targets as the uninterrupted one."""
    import importlib.util

    write_chats(tmp_path / "c.jsonl", 300, seed=5)
    first, pool = _chat_constructor(tok_dir, tmp_path / "c.jsonl", "local")
    try:
        for _ in range(3):
            first.produce()
        state = json.loads(json.dumps(first.state_dict()))
        want = [first.produce()["ranks"][0]["arrays"] for _ in range(3)]
    finally:
        pool.close()
    backend = "ray" if importlib.util.find_spec("ray") is not None else "local"
    second, pool = _chat_constructor(tok_dir, tmp_path / "c.jsonl", backend)
    try:
        second.load_state_dict(state)
        got = [second.produce()["ranks"][0]["arrays"] for _ in range(3)]
    finally:
        pool.close()
    for w, g in zip(want, got):
        for a, b in zip(w, g):
            assert np.array_equal(a, b)
    targets = np.stack([w[1] for w in want])
    assert 0.2 < (targets == -100).mean() < 0.9  # a real share of the tokens is masked, not all


def test_config_errors_name_the_key(tok_dir, tmp_path):
    def config(source: str, *overrides: str):
        path = tmp_path / "job.toml"
        path.write_text(f'[[data.sources]]\nname = "c"\npath = "{tmp_path / "c.jsonl"}"\n{source}\n')
        return resolve(load_config(path, list(overrides)))

    (tmp_path / "c.jsonl").write_text("")
    with pytest.raises(ConfigError, match=r"^data\.sources\[c\]\.format must be 'text' or 'chat', got 'chatty'$"):
        config('format = "chatty"')
    with pytest.raises(ConfigError, match=r"^data\.sources\[c\]\.messages_field is empty$"):
        config('format = "chat"\nmessages_field = ""')
    with pytest.raises(ConfigError, match=r"^data\.chat_template must be .* got 'vicuna'$"):
        config('format = "chat"', "--data.chat_template=vicuna")
    with pytest.raises(ConfigError, match=r"^data\.chat_template: file not found: .*nope\.jinja$"):
        config('format = "chat"', f"--data.chat_template={tmp_path / 'nope.jinja'}")
    config('format = "chat"', "--data.chat_template=llama3")  # fine
    # Beyond the config file: the tokenizer has no template, the template does not compile, a file chat cannot read.
    (tmp_path / "tokenizer.json").write_text("{}")
    with pytest.raises(ConfigError, match=r"^data\.chat_template is empty .*tokenizer_config\.json has no chat_template"):
        template_source("", tmp_path / "tokenizer.json")
    (tmp_path / "broken.jinja").write_text("{% for m in messages %}{{ m['content'] }}")
    with pytest.raises(ConfigError, match=r"^data\.chat_template: .*broken\.jinja is not a valid Jinja template"):
        template_source(str(tmp_path / "broken.jinja"), tok_dir / "tokenizer.json")
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(ConfigError, match=r"^data\.sources\[t\]: format = 'chat' reads \.jsonl or \.parquet files"):
        source_files(SourceConfig(name="t", path=str(tmp_path / "notes.txt"), format="chat"))


def test_chat_fine_tuning_trains_on_assistant_tokens_only(tok_dir, hf_tok, tmp_path, monkeypatch):
    """One run of the trainer on a chat source: the loss is finite and falls, and every target it was given is
    what transformers' rendering says: the next token where that token is an assistant token, else -100."""
    from holotrain.data.client import DataClient
    from holotrain.train import train

    data = tmp_path / "chats.jsonl"
    write_chats(data, 400, seed=6, max_turns=4)
    job = tmp_path / "job.toml"
    job.write_text(f'[[data.sources]]\nname = "chat"\npath = "{data}"\nformat = "chat"\n')
    seq_len, steps = 64, 8
    cfg = load_config(job, tiny_args(tmp_path / "run", **{
        "data.tokenizer": tok_dir / "tokenizer.json", "data.cache_dir": tmp_path / "cache", "data.seq_len": seq_len,
        "data.log_samples": True, "data.workers": 1, "training.steps": steps, "checkpoint.every": 0,
        "checkpoint.save_final": False, "training.lr": 3e-3}))
    handed = []  # what the data plane gave the training step, as it gave it
    real_next = DataClient.next

    def recording_next(self):
        batches, waited = real_next(self)
        handed.append([tuple(t.clone() for t in b[:2]) for b in batches])
        return batches, waited

    monkeypatch.setattr(DataClient, "next", recording_next)
    rows = train(cfg)
    losses = [r["loss"] for r in rows]
    assert len(losses) == steps and all(math.isfinite(v) for v in losses)
    assert losses[-1] < losses[0]

    eos, pad = hf_tok.convert_tokens_to_ids("<|endoftext|>"), hf_tok.convert_tokens_to_ids("<|pad|>")
    raw = data.read_bytes()
    samples = [json.loads(line)["samples"] for line in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == len(handed) == steps
    documents, answers = {}, {}
    whole = 0  # conversations that fit in one piece, whose every assistant token must be a target
    for step_samples, batches in zip(samples, handed):
        inputs = np.concatenate([b[0].numpy() for b in batches])
        targets = np.concatenate([b[1].numpy() for b in batches])
        for r, pieces in enumerate(step_samples):
            row, want = [], []
            for _, _, _, offset, start in pieces:
                if offset not in documents:
                    messages = messages_of(json.loads(raw[offset : raw.index(b"\n", offset)]))
                    documents[offset] = hf_document(hf_tok, messages, eos)
                    answers[offset] = "".join(m["content"] + "<|im_end|>\n" for m in messages if m["role"] == "assistant")
                tokens, mask = (a[start : start + seq_len + 1] for a in documents[offset])
                if start == 0 and len(tokens) == len(documents[offset][0]):
                    # Decoded, what it trained on is its assistant turns with their end-of-turn tokens, nothing else.
                    piece_targets = targets[r, len(row) : len(row) + len(tokens) - 1]
                    assert hf_tok.decode(piece_targets[piece_targets != -100].tolist()) == answers[offset]
                    whole += 1
                row += tokens.tolist()
                want += np.where(mask[1:], tokens[1:], -100).tolist() + [-100]
            row += [pad] * (seq_len + 1 - len(row))
            want += [-100] * (seq_len + 1 - len(want))
            assert inputs[r].tolist() == row[:-1]
            assert targets[r].tolist() == want[:-1]
    assert whole > 20

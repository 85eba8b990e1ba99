"""Chat records (a source's `format = "chat"`) to training text, and the tokens the loss counts.

A record is either a `messages` list of {"role", "content"} objects (roles system, user, assistant) or a
prompt/response pair, which becomes a user message and an assistant message. It is rendered with a chat template
the way Hugging Face's apply_chat_template renders it. Each assistant turn's span in the rendered text is the
difference between the conversation rendered up to that turn's prompt (add_generation_prompt) and rendered through
the turn, so it includes the template's end-of-turn token. Tokens that overlap an assistant span are the only ones
trained on.

Imported by loader processes: it must not import torch.
"""

from __future__ import annotations

import json
from datetime import datetime
from importlib.resources import files
from pathlib import Path

import jinja2
import numpy as np
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from holotrain.data.corpus import TOKENIZER_CONFIG, tokenizer_config
from holotrain.data.sources import BadRecord, SourceConfig
from holotrain.errors import ConfigError

ROLES = ("system", "user", "assistant")
NAMED_TEMPLATES = ("chatml", "llama3")  # holotrain/data/templates/<name>.jinja
# The special tokens Hugging Face hands a template (its special_tokens_map), as tokenizer_config.json names them.
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


# ----------------------------------------------------------------------------------------------
# Which template


def check_template_choice(choice: str) -> None:
    """data.chat_template names a built-in template or an existing .jinja file, or is "" (config.validate)."""
    if choice not in ("", *NAMED_TEMPLATES) and not choice.endswith(".jinja"):
        raise ConfigError(f"data.chat_template must be '' (the tokenizer's own), {', '.join(map(repr, NAMED_TEMPLATES))} "
                          f"or a .jinja file, got {choice!r}")
    if choice.endswith(".jinja") and not Path(choice).expanduser().is_file():
        raise ConfigError(f"data.chat_template: file not found: {choice}")


def template_source(choice: str, tokenizer_path: str | Path) -> str:
    """The Jinja source that `data.chat_template` names: "" the tokenizer's own (the chat_template of the
    tokenizer_config.json beside it), a built-in name, or a .jinja file. It is compiled here once, so that a broken
    template is one error before any loader starts."""
    if choice == "":
        source, where = _tokenizer_template(tokenizer_path), str(Path(tokenizer_path).with_name(TOKENIZER_CONFIG))
    elif choice in NAMED_TEMPLATES:
        source, where = (files("holotrain.data") / "templates" / f"{choice}.jinja").read_text(), choice
    else:
        path = Path(choice).expanduser()
        if path.suffix != ".jinja" or not path.is_file():
            raise ConfigError(f"data.chat_template: {choice!r} is neither {', '.join(NAMED_TEMPLATES)} nor a .jinja file")
        source, where = path.read_text(), str(path)
    try:
        _environment().from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise ConfigError(f"data.chat_template: {where} is not a valid Jinja template "
                          f"({e.message}, line {e.lineno})") from None
    return source


def template_for(sources: list, choice: str, tokenizer_path: str | Path) -> str:
    """The chat template of a job: its source text if any source is a chat source, else ""."""
    return template_source(choice, tokenizer_path) if any(s.format == "chat" for s in sources) else ""


def run_template(sources: list, choice: str, tokenizer_path: str | Path) -> str:
    """The chat template a trained model goes out with, "" for none: the one its chat sources were rendered with
    (template_for); for a run without chat sources, the one data.chat_template names, else the tokenizer's own where
    it has one (an imported chat model trained on plain text)."""
    if choice or any(s.format == "chat" for s in sources) or "chat_template" in tokenizer_config(tokenizer_path):
        return template_source(choice, tokenizer_path)
    return ""


def end_of_turn(source: str, tokenizer_path: str | Path, tokenizer) -> int | None:
    """The id of the special token that closes an assistant turn in a template (<|im_end|>, <|eot_id|>): the first
    special token of the tokenizer after the answer in a one-turn conversation, cut out as the loss mask cuts it.
    None where the template closes a turn with plain text only."""
    answer = "Hello"
    reader = ChatReader(SourceConfig(name="end_of_turn", path="", format="chat"),
                        ChatTemplate(source, special_tokens(tokenizer_path)))
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": answer}]
    try:
        text, [(start, stop)] = reader.render(messages)
    except BadRecord:
        return None
    turn = text[start:stop]
    if answer not in turn:
        return None
    special = {i for i, token in tokenizer.get_added_tokens_decoder().items() if token.special}
    tail = tokenizer.encode(turn[turn.index(answer) + len(answer):], add_special_tokens=False).ids
    return next((i for i in tail if i in special), None)


def _tokenizer_template(tokenizer_path: str | Path) -> str:
    template = tokenizer_config(tokenizer_path).get("chat_template")
    if isinstance(template, list):  # several named templates: the default one is the chat template
        template = next((t.get("template") for t in template if isinstance(t, dict) and t.get("name") == "default"), None)
    if not isinstance(template, str) or not template:
        named = " or ".join(map(repr, NAMED_TEMPLATES))
        raise ConfigError(f"data.chat_template is empty (the tokenizer's own), but "
                          f"{Path(tokenizer_path).with_name(TOKENIZER_CONFIG)} has no chat_template: set "
                          f"data.chat_template to {named} or a .jinja file")
    return template


def special_tokens(tokenizer_path: str | Path) -> dict[str, str]:
    """The special tokens a template may use (bos_token, eos_token, ...), from the tokenizer's tokenizer_config.json."""
    config = tokenizer_config(tokenizer_path)
    out = {}
    for name in SPECIAL_TOKENS:
        value = config.get(name)
        value = value.get("content") if isinstance(value, dict) else value
        if isinstance(value, str):
            out[name] = value
    return out


# ----------------------------------------------------------------------------------------------
# Rendering, as transformers does (utils/chat_template_utils.py)


class _Generation(Extension):
    """`{% generation %}...{% endgeneration %}`, with which some templates mark assistant text for Hugging Face: here it
    renders its body (the spans come from rendering prefixes), so that such templates compile."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
        return caller()


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # Hugging Face's: no HTML escaping (Jinja's own filter escapes <, > and &)
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _environment() -> ImmutableSandboxedEnvironment:
    """Templates come with downloaded tokenizers: untrusted code, so a sandbox, configured as Hugging Face's."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


class ChatTemplate:
    """A compiled chat template with the tokenizer's special tokens."""

    def __init__(self, source: str, tokens: dict[str, str]):
        self.template = _environment().from_string(source)
        self.tokens = tokens

    def render(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        try:
            return self.template.render(messages=messages, tools=None, documents=None,
                                        add_generation_prompt=add_generation_prompt, **self.tokens)
        except (jinja2.TemplateError, TypeError) as e:  # raise_exception(...) in the template, or a type it refuses
            raise BadRecord(f"the chat template refused it: {e}") from None


# ----------------------------------------------------------------------------------------------
# Records


class ChatReader:
    """Reads one chat source's records: each becomes its rendered conversation and its assistant turns' spans."""

    def __init__(self, src, template: ChatTemplate):
        self.source = src.name
        self.messages_field, self.prompt_field = src.messages_field, src.prompt_field
        self.response_field = src.response_field
        self.template = template

    def read(self, record) -> tuple[str, list[tuple[int, int]]]:
        """(text, [(start, stop) character span of each assistant turn]); BadRecord when it is malformed."""
        return self.render(self.conversation(record))

    def conversation(self, record) -> list[dict]:
        if not isinstance(record, dict):
            raise BadRecord("not a JSON object")
        if record.get(self.messages_field) is not None:
            return checked_messages(record[self.messages_field], self.messages_field)
        prompt, response = record.get(self.prompt_field), record.get(self.response_field)
        if prompt is None and response is None:
            raise BadRecord(f"no {self.messages_field!r} list and no "
                            f"{self.prompt_field!r}/{self.response_field!r} pair")
        if not (isinstance(prompt, str) and prompt and isinstance(response, str) and response):
            raise BadRecord(f"{self.prompt_field!r} and {self.response_field!r} must be non-empty strings")
        return [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}]

    def render(self, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
        text = self.template.render(messages)
        spans = []
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            prompt = self.template.render(messages[:i], add_generation_prompt=True)
            through = self.template.render(messages[: i + 1])
            if not (len(prompt) <= len(through) and text.startswith(prompt) and text.startswith(through)):
                raise BadRecord("the chat template does not render the turns before an assistant message as a "
                                "prefix of the conversation, so its tokens cannot be told apart")
            spans.append((len(prompt), len(through)))
        return text, spans

    def parquet_columns(self, names: list[str], path: Path) -> list[str]:
        """The columns of a parquet file that hold the conversations."""
        if self.messages_field in names:
            return [self.messages_field]
        if self.prompt_field in names and self.response_field in names:
            return [self.prompt_field, self.response_field]
        raise ConfigError(f"{path}: no column {self.messages_field!r} (data.sources[{self.source}].messages_field) nor "
                          f"{self.prompt_field!r} and {self.response_field!r} (prompt_field, response_field)")


def checked_messages(messages, field: str) -> list[dict]:
    """The messages as the template sees them (keys whose value is null dropped, as Hugging Face does), or
    BadRecord naming what is wrong."""
    if not isinstance(messages, list):
        raise BadRecord(f"{field!r} is not a list")
    if not messages:
        raise BadRecord(f"{field!r} is empty")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("content"), str):
            raise BadRecord(f"message {i} is not a {{role, content}} object with string content")
        if message.get("role") not in ROLES:
            raise BadRecord(f"message {i} has unknown role {message.get('role')!r} (known: {', '.join(ROLES)})")
        out.append({k: v for k, v in message.items() if v is not None})
    if not any(m["role"] == "assistant" for m in out):
        raise BadRecord("no assistant message: nothing to train on")
    return out


def reader_for(src, template: str, tokenizer_path: str | Path) -> ChatReader | None:
    """A loader's reader of a source's records: None for a text source."""
    if src.format != "chat":
        return None
    return ChatReader(src, ChatTemplate(template, special_tokens(tokenizer_path)))


def assistant_mask(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> np.ndarray:
    """Which tokens belong to an assistant turn: those whose characters overlap one of the spans. A zero-width token
    (whitespace, where a byte-level tokenizer trims offsets) counts by its position."""
    bounds = np.asarray(offsets, dtype=np.int64).reshape(-1, 2)
    first, last = bounds[:, 0], np.maximum(bounds[:, 1], bounds[:, 0] + 1)
    mask = np.zeros(len(bounds), dtype=bool)
    for start, stop in spans:
        mask |= (first < stop) & (last > start)
    return mask

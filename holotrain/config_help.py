"""`holotrain train --help`: every config key with its default and its comment.

The text is read from the config dataclasses and the comments beside their fields in each one's own source file
(holotrain/config.py for the trainer's sections, holotrain/<lever>/config.py for a lever's, and
holotrain/data/sources.py for the [[data.sources]] tables), so the help says what the code says and is never kept by
hand.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import io
import json
import textwrap
import tokenize
import typing
from typing import Any

from holotrain.config import Config
from holotrain.config_values import closest
from holotrain.data.sources import SourceConfig
from holotrain.errors import ConfigError

WIDTH = 100  # columns of the help text
MAX_COMMENT_COLUMN = 46  # comments start here at the latest; a longer `key = default` puts its comment below

INTRO = ("Config keys and their defaults. Set them in a TOML file (--config FILE), a [section] table per section, or "
         "on the command line as --section.key=value, which wins over the file. A relative input path in a TOML file "
         "(a data.sources path, data.tokenizer, data.chat_template's .jinja file, model.init_from) is relative to the "
         "file's folder; on the command line, and for the output folders job.run_dir and data.cache_dir, it is "
         "relative to the current directory. --help SECTION shows one section.")


def field_comments(cls: type) -> tuple[str, dict[str, str]]:
    """A dataclass's docstring, and each field's comment: the comment lines just above it, then the comment at the
    end of its line, read from the class's own source file. Fields without one are left out; so is everything when
    the source cannot be read."""
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):
        return "", {}
    comments = {}  # line -> (text, whether the comment is alone on its line)
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            row, col = tok.start
            comments[row] = (tok.string.lstrip("#").strip(), not tok.line[:col].strip())
    class_def = next(node for node in ast.parse(source).body if isinstance(node, ast.ClassDef))
    out = {}
    for node in class_def.body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        above, row = [], node.lineno - 1
        while row in comments and comments[row][1]:  # the block of comment lines right above (no blank line between)
            above.insert(0, comments[row][0])
            row -= 1
        end = [comments[r][0] for r in range(node.lineno, node.end_lineno + 1) if r in comments and not comments[r][1]]
        if above or end:
            out[node.target.id] = " ".join(above + end)
    return ast.get_docstring(class_def) or "", out


def toml_value(value: Any) -> str:
    """A default as a TOML file writes it."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {toml_value(v)}" for k, v in value.items()) + "}"
    return repr(value)


def _default(f: dataclasses.Field) -> Any:
    return f.default_factory() if f.default is dataclasses.MISSING else f.default


def _entries(lines: list[str], rows: list[tuple[str, str]], indent: str) -> None:
    """`key = default  comment` rows, the comments in one column, wrapped to WIDTH."""
    heads = [f"{indent}{head}" for head, _ in rows]
    column = min(max(len(h) for h in heads) + 2, MAX_COMMENT_COLUMN)
    for head, (_, comment) in zip(heads, rows):
        if not comment:
            lines.append(head)
            continue
        if len(head) + 2 > column:  # too long to share a line with its comment
            lines.append(head)
            head = ""
        lines.extend(textwrap.wrap(comment, WIDTH, initial_indent=head.ljust(column),
                                   subsequent_indent=" " * column, break_long_words=False,
                                   break_on_hyphens=False))


def _section_block(name: str, cls: type) -> str:
    doc, comments = field_comments(cls)
    lines = [f"[{name}]" + (f"  {doc.splitlines()[0]}" if doc else "")]
    rows = [(f"{name}.{f.name} = {toml_value(_default(f))}", comments.get(f.name, "")) for f in dataclasses.fields(cls)]
    _entries(lines, rows, "  ")
    if cls is typing.get_type_hints(Config)["data"]:
        lines.append("  [[data.sources]]  a table per source, in the TOML file; its keys:")
        _, source_comments = field_comments(SourceConfig)
        _entries(lines, [(f"{f.name} = {toml_value(_default(f))}", source_comments.get(f.name, ""))
                         for f in dataclasses.fields(SourceConfig)], "    ")
    return "\n".join(lines)


def config_reference(section: str | None = None) -> str:
    """Every section's keys (or one section's), with their defaults and comments."""
    sections = typing.get_type_hints(Config)
    names = [f.name for f in dataclasses.fields(Config)]
    if section is not None and section not in names:
        near = closest(section, names)
        hint = f"did you mean {near}?" if near else f"sections: {', '.join(names)}"
        raise ConfigError(f"--help {section}: no such config section ({hint})")
    blocks = [] if section else [textwrap.fill(INTRO, WIDTH)]
    blocks += [_section_block(name, sections[name]) for name in names if section in (None, name)]
    return "\n\n".join(blocks) + "\n"

"""The package's shape: no import cycle among holotrain modules (imports inside functions included), no module over
600 lines, no C or C++ source inside a Python string, and the shipped files in the wheel."""

from __future__ import annotations

import ast
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "holotrain"
MAX_LINES = 600


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(REPO).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _ancestors(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def import_graph() -> dict[str, set[str]]:
    """Module -> the holotrain modules its import statements (anywhere in the file) load, including the packages
    whose __init__ runs on the way (but not the module's own enclosing packages, which are loading already)."""
    modules = _modules()
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    targets.add(sub if sub in modules else base)
        own = set(_ancestors(name))
        for target in targets:
            if target not in modules or target == name:
                continue
            graph[name].update(m for m in [*_ancestors(target), target] if m in modules and m not in own and m != name)
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, on_stack, stack, out = {}, {}, set(), [], []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles():
    cycles = find_cycles(import_graph())
    assert not cycles, "import cycles among holotrain modules: " + "; ".join(" <-> ".join(c) for c in cycles)


def test_the_cycle_finder_finds_a_cycle():
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert find_cycles({"a": {"b"}, "b": set()}) == []


def test_no_module_is_too_long():
    long = {str(p.relative_to(REPO)): n for p in PACKAGE.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines: {long}"


_C_SOURCE = re.compile(r"#include\s*[<\"]|__global__\s+void|extern\s+\"C\"|PYBIND11_MODULE")


def test_no_c_source_in_python_strings():
    found = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and _C_SOURCE.search(node.value):
                found.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert not found, f"C/C++ source inside Python strings (put it in a source file): {found}"


@pytest.mark.slow
def test_wheel_ships_configs_and_native_sources(tmp_path):
    """A non-editable install has the shipped configs (found by name) and the C++ source the offload engine builds."""
    source = tmp_path / "src"  # a clean copy: a build/ folder left in the checkout could leak stale files in
    shutil.copytree(REPO, source, ignore=shutil.ignore_patterns(".git", "build", "runs", "*.egg-info", "__pycache__"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(tmp_path), str(source)], check=True, capture_output=True, timeout=600)
    wheel = next(tmp_path.glob("holotrain-*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    shipped = {Path(n).stem for n in names if n.startswith("holotrain/configs/") and n.endswith(".toml")}
    assert {"tiny", "125m", "1.4b", "1.4b-tp2", "offload", "14b"} <= shipped
    assert any(n.startswith("holotrain/memory/offload/csrc/") and n.endswith(".cpp") for n in names)
    for path in REPO.joinpath("holotrain/configs").glob("*.toml"):
        assert f"holotrain/configs/{path.name}" in names


def test_config_by_name_finds_a_shipped_config(tmp_path, monkeypatch):
    from holotrain.config import ConfigError, load_config

    monkeypatch.chdir(tmp_path)  # not the repository: the name must resolve inside the package
    assert load_config("1.4b").model.preset == "1.4b"
    assert load_config("offload.toml").memory.offload is True
    with pytest.raises(ConfigError, match="shipped configs"):
        load_config("no-such-config")


def test_results_current_figures_link_to_sections():
    """bench/RESULTS.md's "Current figures" table: every `](#anchor)` in it names a heading of the file (GitHub's
    anchors: the heading's text with links reduced to their text, lowercased, punctuation dropped, spaces to '-', a
    repeated anchor suffixed -1, -2, ...), and every row ends with a link to a dated (##) section."""
    text = (REPO / "bench" / "RESULTS.md").read_text()

    def anchor(title: str) -> str:
        title = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", title).strip().lower()
        return re.sub(r"[^\w\- ]", "", title).replace(" ", "-")

    anchors, sections, seen, fenced = set(), set(), {}, False
    for line in text.splitlines():
        fenced ^= line.startswith("```")
        heading = None if fenced else re.match(r"(#{1,6}) (.+)", line)
        if heading:
            name = anchor(heading.group(2))
            repeat = seen.get(name, 0)
            seen[name] = repeat + 1
            name = f"{name}-{repeat}" if repeat else name
            anchors.add(name)
            if heading.group(1) == "##" and name != "current-figures":
                sections.add(name)
    parts = text.split("\n## Current figures\n", 1)
    assert len(parts) == 2, "bench/RESULTS.md has no '## Current figures' section"
    table = [line for line in parts[1].split("\n## ", 1)[0].splitlines() if line.startswith("|")]
    rows = [line for line in table[1:] if not re.fullmatch(r"\|(\s*:?-+:?\s*\|)+", line)]
    assert len(rows) >= 10
    for row in rows:
        broken = [a for a in re.findall(r"\]\(#([^)\s]+)\)", row) if a not in anchors]
        assert not broken, f"links to no heading of bench/RESULTS.md: {broken} in {row[:80]}"
        last = re.split(r"(?<!\\)\|", row.strip().strip("|"))[-1].strip()
        section = re.fullmatch(r"\[[^\]]+\]\(#([^)\s]+)\)", last)
        assert section and section.group(1) in sections, f"the row's last cell is not a link to a section: {row[:80]}"
    # The superseded sections' titles link to what replaced them: those links resolve too.
    broken = [a for a in re.findall(r"\]\(#([^)\s]+)\)", text) if a not in anchors]
    assert not broken, f"links to no heading of bench/RESULTS.md: {broken}"

"""The model and parallel-layout interfaces, as the code reads: levers import no config from above them, write no
attribute on a model, name no model family but through the registry, and never re-derive a parallel size."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "holotrain"
LEVERS = ("model", "data", "parallel", "memory", "precision", "optim", "hw", "profile")
MODEL_NAMES = {"model", "stage", "stage_model", "models", "base", "last"}
FAMILY_NAMES = {"llama", "qwen2", "qwen3", "mistral"}


def _files(*packages: str):
    for package in packages:
        yield from sorted((PACKAGE / package).rglob("*.py"))


def _tree(path: Path) -> ast.AST:
    return ast.parse(path.read_text(), str(path))


def _root(node: ast.AST) -> str | None:
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def _imports(tree: ast.AST) -> list[str]:
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            out += [node.module] + [f"{node.module}.{a.name}" for a in node.names]
    return out


def test_no_lever_imports_the_config_module():
    found = [f"{p.relative_to(REPO)}: {name}" for p in _files(*LEVERS) for name in _imports(_tree(p))
             if name in ("holotrain.config", "holotrain.config_checks")
             or name.startswith(("holotrain.config.", "holotrain.config_checks."))]
    assert not found, found


def model_attribute_writes(tree: ast.AST) -> list[int]:
    """Lines that assign (or setattr) an attribute of a model object."""
    lines = []
    for node in ast.walk(tree):
        targets = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        for target in targets:
            for t in (target.elts if isinstance(target, ast.Tuple) else [target]):
                if isinstance(t, ast.Attribute) and _root(t) in MODEL_NAMES:
                    lines.append(node.lineno)
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("setattr", "delattr")
                and node.args and _root(node.args[0]) in MODEL_NAMES):
            lines.append(node.lineno)
    return sorted(lines)


def test_no_lever_writes_an_attribute_on_a_model():
    found = [f"{p.relative_to(REPO)}:{line}" for p in _files(*LEVERS, "plan", "train") if "model" not in p.parts[-2:-1]
             for line in model_attribute_writes(_tree(p))]
    assert not found, f"levers write attributes on a model (use its hooks): {found}"
    # The check sees a write.
    assert model_attribute_writes(ast.parse("model.loss = f\nsetattr(stage, 'x', 1)\nmodel.hooks.a = 2")) == [1, 2, 3]


def test_family_names_appear_outside_the_model_package_only_through_the_registry():
    found = []
    for p in PACKAGE.rglob("*.py"):
        if "model" in p.relative_to(PACKAGE).parts[:1]:
            continue
        tree = _tree(p)
        found += [f"{p.relative_to(REPO)}: imports {n}" for n in _imports(tree)
                  if n.startswith("holotrain.model.families")]
        found += [f"{p.relative_to(REPO)}:{node.lineno}: {node.value!r}" for node in ast.walk(tree)
                  if isinstance(node, ast.Constant) and node.value in FAMILY_NAMES]
        found += [f"{p.relative_to(REPO)}:{node.lineno}: {node.id}" for node in ast.walk(tree)
                  if isinstance(node, ast.Name) and node.id in ("Llama", "LlamaArgs", "Qwen3", "Mistral")]
    assert not found, found


def _names(node: ast.AST) -> set[str]:
    out = set()
    for n in ast.walk(node):
        if isinstance(n, ast.Name):
            out.add(n.id)
        elif isinstance(n, ast.Attribute):
            out.add(n.attr)
    return out


def size_derivations(tree: ast.AST) -> list[int]:
    """Lines that divide a rank count by parallel sizes (world // (tp * cp), ranks % (tp * pp), ...)."""
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.FloorDiv, ast.Mod)):
            left, right = _names(node.left), _names(node.right)
            if right & {"tp", "cp", "pp"} and any("world" in n or "ranks" in n or "gpus" in n for n in left):
                lines.append(node.lineno)
    return lines


def test_parallel_sizes_are_read_from_the_layout_object():
    found = [f"{p.relative_to(REPO)}:{line}" for p in PACKAGE.rglob("*.py") if p.name != "dims.py"
             for line in size_derivations(_tree(p))]
    assert not found, f"parallel sizes re-derived outside parallel/dims.py: {found}"
    assert size_derivations(ast.parse("dp = env.world_size // (cfg.parallel.tp * cfg.parallel.cp)")) == [1]


def test_the_data_plane_imports_no_torch():
    """The data plane and its loaders are processes of their own: the layout they read (parallel/dims.py) must not
    pull torch in (seconds of startup in every run)."""
    import subprocess
    import sys

    code = "import sys, holotrain.data.plane, holotrain.data.worker; print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO).stdout.strip() == "False"

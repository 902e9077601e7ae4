"""The package keeps the layer table of the README's "Layout of the code": a folder imports only the
layers below it (the planner only configs and models), `tessera.config` holds no import circle, and
the planner runs without torch. Every import counts, also those inside functions and under
TYPE_CHECKING."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "tessera"
LAYER = {"config": 1, "models": 2, "parallel": 3, "data": 4, "checkpoint": 5, "train": 6, "infer": 7, "plan": 8,
         "cli": 9}
ALIAS = {"hf": "checkpoint", "__main__": "cli"}  # tessera/hf.py re-exports checkpoint/hf/; `python -m tessera`
ONLY = {"plan": {"config", "models"}}  # the planner is analytic: it may use configs and model counts only


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """Every `tessera.*` module `path` imports, wherever in the file."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)  # `from tessera.config import model`
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return {name for name in found if name.startswith("tessera.")}


def _folder(module: str) -> str:
    name = module.split(".")[1]
    return ALIAS.get(name, name)


def test_every_folder_imports_only_the_layers_below_it():
    assert set(LAYER) >= {_folder(_module_name(p)) for p in PACKAGE.rglob("*.py") if p.stem != "__init__"
                          or p.parent != PACKAGE}, "a new folder or top-level module needs a row in LAYER"
    wrong = []
    for path in PACKAGE.rglob("*.py"):
        module = _module_name(path)
        if module == "tessera":
            continue
        src = _folder(module)
        for target in {_folder(name) for name in _imports(path)} - {src}:
            allowed = ONLY.get(src, {f for f, layer in LAYER.items() if layer < LAYER[src]})
            if target not in allowed:
                wrong.append(f"{module} (layer {LAYER[src]}) imports tessera.{target} (layer {LAYER[target]})")
    assert not wrong, "\n".join(sorted(wrong))


def test_config_has_no_import_circle():
    modules = {_module_name(p): p for p in (PACKAGE / "config").glob("*.py")}
    graph = {m: {n for n in _imports(p) if n in modules and n != m} for m, p in modules.items()}
    done: set[str] = set()

    def visit(m: str, path: list[str]) -> None:
        assert m not in path, "import circle: " + " -> ".join(path[path.index(m):] + [m])
        if m in done:
            return
        for n in sorted(graph[m]):
            visit(n, path + [m])
        done.add(m)

    for m in sorted(graph):
        visit(m, [])


def test_the_planner_imports_without_torch():
    code = ("import sys, tessera.plan, tessera.models.flops, tessera.models.counting\n"
            "assert 'torch' not in sys.modules, 'torch was imported'")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=PACKAGE.parent)
    assert run.returncode == 0, run.stderr

"""The package keeps the layer table of docs/architecture.md ("Layers"): a folder imports only the
layers below it (the planner only configs and models), no module of `tessera` is part of an import
circle, and the planner runs without torch. Every import counts, also those inside functions and
under TYPE_CHECKING. The house stays one a newcomer can find their way in: files short enough to read
(at most 500 lines), functions too (at most 60), folders of at most 25 modules (a folder that
outgrows it gets wings: sub-packages with one job each), and no module changes another object's
class (`obj.__class__ = ...`: the seams exist for that). The serving and training cores name no
vision-language family: they ask the family registries and the model
(tessera/config/vision_families.py)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "tessera"
LAYER = {"config": 1, "models": 2, "parallel": 3, "data": 4, "checkpoint": 5, "train": 6, "quantize": 6, "prune": 6,
         "infer": 7, "plan": 8, "eval": 9, "profiling": 9,
         "cli": 10}
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


# The serving and training cores, and the modules (or names) of one vision-language family they must not import.
FAMILY_FREE = ("infer/engine/llm_engine.py", "infer/api/server.py", "infer/engine/llm.py", "train/builder.py",
               "train/data_source.py")
VISION_LANGUAGE_FAMILY = ("tessera.models.vision.llava", "tessera.models.vision.qwen_vl",
                          "tessera.models.vision.qwen_vision", "tessera.config.vision", "tessera.config.qwen_vl",
                          "tessera.checkpoint.hf.llava", "tessera.checkpoint.hf.qwen_vl",
                          "tessera.models.vision.qwen3_vision", "tessera.config.qwen3_5_vl",
                          "tessera.checkpoint.hf.qwen3_5_vl",
                          "tessera.data.qwen_image_processor", "tessera.data.image_processor.ImageProcessor")


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


def test_serving_and_training_name_no_vision_language_family():
    wrong = [f"tessera/{rel} imports {name}" for rel in FAMILY_FREE for name in sorted(_imports(PACKAGE / rel))
             if any(name == family or name.startswith(family + ".") for family in VISION_LANGUAGE_FAMILY)]
    assert not wrong, "ask the family registries or the model instead:\n" + "\n".join(wrong)


def _packages(module: str) -> list[str]:
    """The packages whose `__init__` runs before `module` does: `a.b.c` -> [`a`, `a.b`]."""
    parts = module.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def _import_graph() -> dict[str, set[str]]:
    """Module -> the `tessera` modules importing it runs: those it names, and the packages of those
    (`import a.b.c` runs `a.b`'s `__init__`). A module's own packages have run before it does, so they
    count only where it names one (`from tessera.train import step_engine` runs `tessera/train/__init__.py`
    again from the inside: a circle if that `__init__` imports the module back)."""
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {}
    for module, path in modules.items():
        named = {n for n in _imports(path) if n in modules}
        implied = {pkg for n in named for pkg in _packages(n)} - set(_packages(module))
        graph[module] = (named | implied) - {module}
    return graph


def test_no_module_is_part_of_an_import_circle():
    graph = _import_graph()
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


def test_files_and_functions_stay_short():
    long = []
    for path in sorted(PACKAGE.rglob("*.py")):
        text = path.read_text()
        if len(text.splitlines()) > 500:
            long.append(f"{path.relative_to(PACKAGE.parent)}: {len(text.splitlines())} lines (at most 500)")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.end_lineno - node.lineno >= 60:
                long.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno} {node.name}: "
                            f"{node.end_lineno - node.lineno + 1} lines (at most 60)")
    assert not long, "\n".join(long)


def test_folders_hold_at_most_25_modules():
    crowded = []
    for folder in sorted({p.parent for p in PACKAGE.rglob("*.py")}):
        modules = [p for p in folder.glob("*.py") if p.name != "__init__.py"]
        if len(modules) > 25:
            crowded.append(f"{folder.relative_to(PACKAGE.parent)}: {len(modules)} modules (at most 25)")
    assert not crowded, "\n".join(crowded)


def test_no_module_assigns_a_class():
    swaps = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
                node, ast.AnnAssign | ast.AugAssign) else []
            swaps += [f"{path.relative_to(PACKAGE.parent)}:{node.lineno}" for t in targets
                      if isinstance(t, ast.Attribute) and t.attr == "__class__"]
    assert not swaps, "class assigned at " + ", ".join(swaps)


def test_the_planner_imports_without_torch():
    code = ("import sys, tessera.plan, tessera.models.flops, tessera.models.counting\n"
            "assert 'torch' not in sys.modules, 'torch was imported'")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=PACKAGE.parent)
    assert run.returncode == 0, run.stderr

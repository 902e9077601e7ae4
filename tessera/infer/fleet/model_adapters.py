"""LoRA adapters on the models of `tessera serve --model NAME=PATH ...`, served per request as on one
model: `--lora MODEL:ADAPTER=DIR` (repeatable) serves the PEFT adapter DIR on the served model MODEL
(with one model served, `--lora ADAPTER=DIR` may leave MODEL out). A request's `model` names
`MODEL:ADAPTER`, or the adapter alone where one model only has an adapter of that name; it goes to
MODEL (woken if it sleeps), whose engine runs it with the adapter (tessera/infer/api/server.py's
`adapter_of` reads either spelling). `/v1/models` lists each adapter as `MODEL:ADAPTER` with its
`parent`.
"""

from __future__ import annotations

from tessera.config.errors import ConfigError


def adapters_per_model(lora: dict[str, str], models: list[str]) -> dict[str, dict[str, str]]:
    """`--lora` items ({`MODEL:ADAPTER` or `ADAPTER`: DIR}) as {model: {adapter: DIR}}; ConfigError for
    an item whose model is not served, missing where several are, or whose adapter has a model's name."""
    out: dict[str, dict[str, str]] = {m: {} for m in models}
    for key, path in lora.items():
        base = max((m for m in models if key.startswith(m + ":")), key=len, default=None)
        if base is None and len(models) > 1:
            raise ConfigError(f"--lora {key}={path} is invalid with several models: name the model it adapts, "
                              f"--lora MODEL:ADAPTER=DIR (MODEL one of {models})")
        base = base or models[0]
        adapter = key[len(base) + 1:] if key.startswith(base + ":") else key
        if not adapter or adapter in models:
            raise ConfigError(f"--lora {key}={path} is invalid: the adapter's name {adapter!r} must be non-empty "
                              f"and differ from the served models' names {models}")
        out[base][adapter] = path
    return out


def owners(name: str, adapters: dict[str, dict[str, str]]) -> list[str]:
    """The models a request's `model` names an adapter of: `MODEL:ADAPTER`, or a bare adapter's name
    (several models where they each have one so named)."""
    qualified = [m for m, names in adapters.items() if name.startswith(m + ":") and name[len(m) + 1:] in names]
    return qualified or [m for m, names in adapters.items() if name in names]


def qualified_names(adapters: dict[str, dict[str, str]]) -> list[str]:
    return [f"{m}:{a}" for m, names in adapters.items() for a in names]

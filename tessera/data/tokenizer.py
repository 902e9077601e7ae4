"""Tokenizer: a HuggingFace `tokenizer.json` plus the special tokens and chat template around it.

Any tokenizer that HuggingFace saves in the "fast" format loads here, from its directory or from
the `tokenizer.json` itself, with the `tokenizers` library alone (no `transformers` at run time).
Next to `tokenizer.json` it reads, when present:

- `tokenizer_config.json`: `bos_token`, `eos_token`, `pad_token`, `unk_token` (a string or an
  `{"content": ...}` object) and `chat_template`;
- `special_tokens_map.json`: special tokens the config does not name (older saves);
- `chat_template.jinja`: the chat template, which newer saves keep in its own file.

Encoding follows `transformers` (5.x) exactly: `tokenizer.json` is the source of truth, and
`encode(text)` applies its post-processor (which adds a BOS token for LLaMA-style tokenizers);
like `transformers`, `add_bos_token` / `add_eos_token` in the config do not override it.

`default_tokenizer()` loads the byte-level BPE tokenizer shipped in `tessera/assets/tokenizer`
(vocabulary 4096, trained on the Python standard library by `tessera.data.train_tokenizer`).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import tokenizers
from tokenizers import AddedToken

from tessera.config.errors import DataError
from tessera.config.json_text import read_json_file
from tessera.data.atomic_write import atomic_output
from tessera.data.chat_template import render_chat_template

DEFAULT_TOKENIZER_DIR = Path(__file__).resolve().parent.parent / "assets" / "tokenizer"
SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "pad_token", "unk_token")


def _token_content(value: Any) -> str | None:
    """A special token from a config file: a string, an AddedToken object `{"content": ...}`, or null."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _read_json(path: Path) -> dict[str, Any]:
    data = read_json_file(path, DataError, f"tokenizer file {path}")
    if not isinstance(data, dict):
        raise DataError(f"{path}: expected a JSON object, found {type(data).__name__}")
    return data


def _select_template(value: Any, path: Path) -> str | None:
    """`chat_template` is a string, or a list of `{"name", "template"}` of which "default" is used."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {item.get("name"): item.get("template") for item in value if isinstance(item, dict)}
        return named.get("default") or next(iter(named.values()), None)
    raise DataError(f"{path}: chat_template must be a string or a list of named templates, "
                    f"found {type(value).__name__}")


class Tokenizer:
    """Text <-> token ids, special token ids, and chat-template rendering."""

    def __init__(self, backend: tokenizers.Tokenizer, *, bos_token: str | None = None,
                 eos_token: str | None = None, pad_token: str | None = None, unk_token: str | None = None,
                 chat_template: str | None = None, source: str | None = None):
        self.backend = backend
        self.backend.no_padding()
        self.backend.no_truncation()
        self.special_tokens = {"bos_token": bos_token, "eos_token": eos_token, "pad_token": pad_token,
                               "unk_token": unk_token}
        missing = [t for t in self.special_tokens.values()
                   if t is not None and backend.token_to_id(t) is None]
        if missing:  # transformers adds named special tokens that the vocabulary lacks; so do we
            backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in missing])
        self.chat_template = chat_template
        self.source = source
        vocab = backend.get_vocab(with_added_tokens=True)
        # Every id is below vocab_size, even where ids are not contiguous.
        self.vocab_size = max(backend.get_vocab_size(with_added_tokens=True),
                              max(vocab.values(), default=-1) + 1)

    @classmethod
    def from_path(cls, path: str | os.PathLike) -> Tokenizer:
        """Load from a directory holding `tokenizer.json` (and optional configs), or from the file."""
        path = Path(path)
        if path.is_dir():
            directory, tokenizer_file = path, path / "tokenizer.json"
        else:
            directory, tokenizer_file = path.parent, path
        if not tokenizer_file.is_file():
            hint = " (only the `tokenizer.json` format is supported)" if path.is_dir() else ""
            raise DataError(f"{tokenizer_file}: tokenizer file is missing{hint}")
        try:
            backend = tokenizers.Tokenizer.from_file(str(tokenizer_file))
        except Exception as error:  # the Rust library raises plain Exception
            raise DataError(f"{tokenizer_file}: not a valid tokenizer.json: {error}") from error

        config_file = directory / "tokenizer_config.json"
        config = _read_json(config_file) if config_file.is_file() else {}
        map_file = directory / "special_tokens_map.json"
        token_map = _read_json(map_file) if map_file.is_file() else {}
        special = {key: _token_content(config.get(key, token_map.get(key))) for key in SPECIAL_TOKEN_KEYS}
        template_file = directory / "chat_template.jinja"
        if template_file.is_file():
            template = template_file.read_text(encoding="utf-8")
        else:
            template = _select_template(config.get("chat_template"), config_file)

        return cls(backend, **special, chat_template=template, source=str(path))

    # --- token ids -----------------------------------------------------------------------------

    def _id_of(self, key: str) -> int | None:
        token = self.special_tokens[key]
        return None if token is None else self.backend.token_to_id(token)

    @property
    def bos_id(self) -> int | None:
        return self._id_of("bos_token")

    @property
    def eos_id(self) -> int | None:
        return self._id_of("eos_token")

    @property
    def pad_id(self) -> int | None:
        return self._id_of("pad_token")

    @property
    def bos_token(self) -> str | None:
        return self.special_tokens["bos_token"]

    @property
    def eos_token(self) -> str | None:
        return self.special_tokens["eos_token"]

    @property
    def pad_token(self) -> str | None:
        return self.special_tokens["pad_token"]

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    # --- encoding ------------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; `add_special_tokens` applies the post-processor (e.g. a leading BOS)."""
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(self, texts: Sequence[str], add_special_tokens: bool = True) -> list[list[int]]:
        """`encode` of each text, computed in parallel by the tokenizers library; order is kept."""
        return [e.ids for e in self.backend.encode_batch(list(texts), add_special_tokens=add_special_tokens)]

    def encode_with_offsets(self, text: str, add_special_tokens: bool = False
                            ) -> tuple[list[int], list[tuple[int, int]]]:
        """Token ids and, for each, the `[start, end)` character span of `text` it came from."""
        encoding = self.backend.encode(text, add_special_tokens=add_special_tokens)
        return encoding.ids, [tuple(span) for span in encoding.offsets]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    # --- chat ----------------------------------------------------------------------------------

    @property
    def has_chat_template(self) -> bool:
        return bool(self.chat_template)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = False,
                            chat_template: str | None = None, **variables: Any) -> str:
        """Render `messages` with the tokenizer's chat template (or `chat_template` when given)."""
        template = chat_template or self.chat_template
        if not template:
            raise DataError(f"tokenizer {self.source or ''} has no chat template; pass chat_template= "
                            "(e.g. tessera.data.PLAIN_CHAT_TEMPLATE)")
        return render_chat_template(template, messages, add_generation_prompt=add_generation_prompt,
                                    special_tokens=self.special_tokens, **variables)

    # --- identity and saving -------------------------------------------------------------------

    @property
    def fingerprint(self) -> str:
        """A hash of everything that decides the ids: the tokenizer itself, special tokens, template."""
        digest = hashlib.sha256(self.backend.to_str().encode("utf-8"))
        digest.update(json.dumps([self.special_tokens, self.chat_template], sort_keys=True).encode("utf-8"))
        return digest.hexdigest()

    def save(self, directory: str | os.PathLike) -> None:
        """Write `tokenizer.json` and `tokenizer_config.json` (loadable here and by transformers)."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        with atomic_output(directory / "tokenizer.json") as tmp:
            tmp.write_text(self.backend.to_str(pretty=True), encoding="utf-8")
        config: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast", **self.special_tokens}
        if self.chat_template:
            config["chat_template"] = self.chat_template
        with atomic_output(directory / "tokenizer_config.json") as tmp:
            tmp.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")

    def __repr__(self) -> str:
        return f"Tokenizer(source={self.source!r}, vocab_size={self.vocab_size}, eos_id={self.eos_id})"


def default_tokenizer() -> Tokenizer:
    """The byte-level BPE tokenizer shipped with Tessera (vocabulary 4096, eos `<|endoftext|>`)."""
    return Tokenizer.from_path(DEFAULT_TOKENIZER_DIR)


def load_tokenizer(path: str | os.PathLike | None = None) -> Tokenizer:
    """`Tokenizer.from_path(path)`, or the shipped tokenizer when `path` is None or "default"."""
    if path is None or os.fspath(path) == "default":
        return default_tokenizer()
    return Tokenizer.from_path(path)

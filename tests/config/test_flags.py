"""Options declared once: EngineConfig's fields carry their command-line options, every command
that sets one spells it the same, and the refusals of two options together name both."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from tessera.cli import build_parser
from tessera.config.dtypes import dtype_name, short_dtype_name
from tessera.config.errors import ConfigError, require
from tessera.config.flags import flag_text
from tessera.infer.config import EngineConfig


def _options(command: str) -> dict[str, argparse.Action]:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices[command]
    return {s: a for a in sub._actions for s in a.option_strings}


def test_serve_parses_to_the_config_defaults_but_the_device():
    args = build_parser().parse_args(["serve", "some/model", "--device", "cpu"])
    assert EngineConfig.from_args(args) == EngineConfig()
    assert build_parser().parse_args(["serve", "some/model"]).device == "auto"  # the CLI's own default


def test_commands_share_the_engine_options_word_for_word():
    serve = _options("serve")
    for command, flags in (("eval", ["--tensor-parallel-size", "--dtype", "--kv-cache-gib", "--merge-lora"]),
                           ("generate", ["--quantization", "--gguf-keep-quantized", "--gguf-dequantize"])):
        options = _options(command)
        for f in flags:
            mine, served = options[f], serve[f]
            assert (mine.help, mine.default, mine.choices, mine.type) == (served.help, served.default,
                                                                        served.choices, served.type), f


def test_every_engine_option_is_a_field():
    declared = {f.name for f in dataclasses.fields(EngineConfig) if "flag" in f.metadata}
    assert "mm_encoder_cache_images" not in declared and len(declared) >= 28
    args = build_parser().parse_args(["serve", "m", "--device", "cpu", "--speculative", "prompt_lookup",
                                      "--num-speculative-tokens", "3", "--no-prefix-caching", "--no-cpu-prepack",
                                      "--lora", "a=/tmp", "--limit-mm-per-prompt", "image=2"])
    config = EngineConfig.from_args(args)
    assert config.speculative.num_tokens == 3 and not config.enable_prefix_caching and not config.cpu_prepack
    assert config.lora_adapters == {"a": "/tmp"} and config.limit_mm_per_prompt == {"image": 2}


def test_a_refusal_of_two_options_names_both_spellings():
    with pytest.raises(ConfigError, match=r"quantization='int8' is invalid: not supported with tensor_parallel_size=2 "
                                          r"\(--quantization int8 is not supported with --tensor-parallel-size 2"):
        EngineConfig(quantization="int8", tensor_parallel_size=2)
    with pytest.raises(ConfigError, match="--allow-runtime-lora is not supported with --tensor-parallel-size 2"):
        EngineConfig(tensor_parallel_size=2).check_runtime_lora()
    assert flag_text(EngineConfig, "mm_encoder_cache_images", 3) == "mm_encoder_cache_images=3"
    # a switch with an opposite: each value spelled as the option that gives it
    assert [flag_text(EngineConfig, "gguf_keep_quantized", v) for v in (True, False)] == ["--gguf-keep-quantized",
                                                                                        "--gguf-dequantize"]


def test_one_dtype_table_and_one_require():
    assert [dtype_name(n) for n in ("bf16", "bfloat16", "fp32")] == ["bfloat16", "bfloat16", "float32"]
    assert short_dtype_name("float16") == "fp16" and EngineConfig(dtype="bf16").dtype == "bfloat16"
    with pytest.raises(ConfigError, match=r"^x.y=3 is invalid: must be even$"):
        require(False, "x.y", 3, "must be even")
    with pytest.raises(ConfigError, match=r"^prune --layers 5 is invalid: at most 4$"):
        require(False, "prune --layers", 5, "at most 4", sep=" ")

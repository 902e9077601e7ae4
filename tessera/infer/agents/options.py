"""The agent options of `tessera serve`, declared once with their flags (vLLM's spellings):
`--tool-call-parser NAME`, `--enable-auto-tool-choice`, `--reasoning-parser NAME`.

`--tool-call-parser` names the format the model writes its calls in (tool_parsers.py); it is read
out of the output under `tool_choice: auto`, and it is the format constrained calls are written in
(`required`, a named function, a `strict` tool). `--enable-auto-tool-choice` lets the model decide
whether to call (`auto`, the default where tools are offered): as vLLM does, a request offering
tools under `auto` is refused without it, and it needs `--tool-call-parser`. `--reasoning-parser`
puts a `<think>` block into `reasoning_content`. Torch-free: `tessera serve --help` reads it.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

from tessera.config.errors import ConfigError
from tessera.config.flags import add_flags, flag, values_from_args
from tessera.infer.agents.reasoning import REASONING_PARSERS, reasoning_parser
from tessera.infer.agents.tool_parsers import TOOL_CALL_PARSERS, tool_call_parser


@dataclass(frozen=True)
class AgentOptions:
    """How a served model's tool calls and reasoning are read (each None: not read)."""

    tool_call_parser: str | None = field(default=None, metadata=flag(
        f"the model's tool-call format ({', '.join(TOOL_CALL_PARSERS)}): its calls are read out of the output "
        "under tool_choice auto, and constrained calls (required, a named function, strict tools) are written "
        "in it (None: hermes for constrained calls, none read under auto)", choices=tuple(TOOL_CALL_PARSERS),
        metavar="NAME"))
    enable_auto_tool_choice: bool = field(default=False, metadata=flag(
        "let the model decide whether to call the tools a request offers (tool_choice auto, the default "
        "with tools); needs --tool-call-parser; without it such requests are refused", action="store_true"))
    reasoning_parser: str | None = field(default=None, metadata=flag(
        f"put the model's <think> block into reasoning_content, apart from content ({', '.join(REASONING_PARSERS)}; "
        "None: all content)",
        choices=tuple(REASONING_PARSERS), metavar="NAME"))

    def __post_init__(self) -> None:
        if self.tool_call_parser is not None:
            tool_call_parser(self.tool_call_parser)
        if self.reasoning_parser is not None:
            reasoning_parser(self.reasoning_parser)
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ConfigError("--enable-auto-tool-choice needs --tool-call-parser NAME (the format the model's "
                              f"calls are read in: one of {', '.join(TOOL_CALL_PARSERS)})")

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
        add_flags(parser, cls)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> AgentOptions:
        return cls(**values_from_args(cls, args))

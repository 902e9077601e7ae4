"""Tiny random models that speak a real family's chat format, for the agent tests and the tool-call
benchmark: the bundled byte-level BPE tokenizer with Qwen's added tokens (`<|im_start|>`,
`<|im_end|>` special, the end of a turn; `<tool_call>`, `</tool_call>`, `<think>`, `</think>` plain
added tokens, as in Qwen2.5's and Qwen3's tokenizers) and a chat template of the family's shape,
written from the published templates: Qwen2.5-Instruct's (tools in the system turn, calls as
`<tool_call>` blocks, results as `<tool_response>` in a user turn) and Qwen3's (the same, an earlier
turn's `reasoning_content` in a `<think>` block; its generation prompt opens the `<think>` block as
the thinking models' does, and holds an empty closed one with `enable_thinking: false`)."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import AddedToken, Tokenizer

from tessera.data.tokenizer import DEFAULT_TOKENIZER_DIR
from tests.infer.tiny_models import write_model

SPECIAL = ["<|im_start|>", "<|im_end|>"]
PLAIN = ["<tool_call>", "</tool_call>", "<think>", "</think>"]

_TOOLS_SYSTEM = (
    "{%- if tools %}\n"
    "    {{- '<|im_start|>system\\n' }}\n"
    "    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- messages[0]['content'] }}\n"
    "    {%- else %}\n"
    "        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}\n"
    "    {%- endif %}\n"
    "    {{- \"\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are "
    "provided with function signatures within <tools></tools> XML tags:\\n<tools>\" }}\n"
    "    {%- for tool in tools %}\n"
    "        {{- \"\\n\" }}\n"
    "        {{- tool | tojson }}\n"
    "    {%- endfor %}\n"
    "    {{- \"\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\\"name\\\": <function-name>, \\\"arguments\\\": "
    "<args-json-object>}\\n</tool_call><|im_end|>\\n\" }}\n"
    "{%- else %}\n"
    "    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}\n"
    "    {%- else %}\n"
    "        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful "
    "assistant.<|im_end|>\\n' }}\n"
    "    {%- endif %}\n"
    "{%- endif %}\n"
)

_TOOL_RESULT = (
    "    {%- elif message.role == \"tool\" %}\n"
    "        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != \"tool\") %}\n"
    "            {{- '<|im_start|>user' }}\n"
    "        {%- endif %}\n"
    "        {{- '\\n<tool_response>\\n' }}\n"
    "        {{- message.content }}\n"
    "        {{- '\\n</tool_response>' }}\n"
    "        {%- if loop.last or (messages[loop.index0 + 1].role != \"tool\") %}\n"
    "            {{- '<|im_end|>\\n' }}\n"
    "        {%- endif %}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n"
)

QWEN25_TEMPLATE = _TOOLS_SYSTEM + (
    "{%- for message in messages %}\n"
    "    {%- if (message.role == \"user\") or (message.role == \"system\" and not loop.first) or "
    "(message.role == \"assistant\" and not message.tool_calls) %}\n"
    "        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}\n"
    "    {%- elif message.role == \"assistant\" %}\n"
    "        {{- '<|im_start|>' + message.role }}\n"
    "        {%- if message.content %}\n"
    "            {{- '\\n' + message.content }}\n"
    "        {%- endif %}\n"
    "        {%- for tool_call in message.tool_calls %}\n"
    "            {%- if tool_call.function is defined %}\n"
    "                {%- set tool_call = tool_call.function %}\n"
    "            {%- endif %}\n"
    "            {{- '\\n<tool_call>\\n{\"name\": \"' }}\n"
    "            {{- tool_call.name }}\n"
    "            {{- '\", \"arguments\": ' }}\n"
    "            {{- tool_call.arguments | tojson }}\n"
    "            {{- '}\\n</tool_call>' }}\n"
    "        {%- endfor %}\n"
    "        {{- '<|im_end|>\\n' }}\n"
) + _TOOL_RESULT + (
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|im_start|>assistant\\n' }}\n"
    "{%- endif %}\n"
)

QWEN3_TEMPLATE = _TOOLS_SYSTEM + (
    "{%- for message in messages %}\n"
    "    {%- if message.content is string %}\n"
    "        {%- set content = message.content %}\n"
    "    {%- else %}\n"
    "        {%- set content = '' %}\n"
    "    {%- endif %}\n"
    "    {%- if (message.role == \"user\") or (message.role == \"system\" and not loop.first) %}\n"
    "        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}\n"
    "    {%- elif message.role == \"assistant\" %}\n"
    "        {{- '<|im_start|>' + message.role + '\\n' }}\n"
    "        {%- if message.reasoning_content is string and message.reasoning_content %}\n"
    "            {{- '<think>\\n' + message.reasoning_content.strip('\\n') + '\\n</think>\\n\\n' }}\n"
    "        {%- endif %}\n"
    "        {{- content.lstrip('\\n') }}\n"
    "        {%- if message.tool_calls %}\n"
    "            {%- for tool_call in message.tool_calls %}\n"
    "                {%- if (loop.first and content) or (not loop.first) %}\n"
    "                    {{- '\\n' }}\n"
    "                {%- endif %}\n"
    "                {%- if tool_call.function %}\n"
    "                    {%- set tool_call = tool_call.function %}\n"
    "                {%- endif %}\n"
    "                {{- '<tool_call>\\n{\"name\": \"' }}\n"
    "                {{- tool_call.name }}\n"
    "                {{- '\", \"arguments\": ' }}\n"
    "                {{- tool_call.arguments | tojson }}\n"
    "                {{- '}\\n</tool_call>' }}\n"
    "            {%- endfor %}\n"
    "        {%- endif %}\n"
    "        {{- '<|im_end|>\\n' }}\n"
) + _TOOL_RESULT + (
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|im_start|>assistant\\n' }}\n"
    "    {%- if enable_thinking is defined and enable_thinking is false %}\n"
    "        {{- '<think>\\n\\n</think>\\n\\n' }}\n"
    "    {%- else %}\n"
    "        {{- '<think>\\n' }}\n"
    "    {%- endif %}\n"
    "{%- endif %}\n"
)


def qwen_tokenizer() -> Tokenizer:
    """The bundled BPE tokenizer with Qwen's chat and agent tokens added after its 4096."""
    tok = Tokenizer.from_file(str(DEFAULT_TOKENIZER_DIR / "tokenizer.json"))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in PLAIN])
    return tok


def write_agent_model(path: Path, template: str, seed: int = 0, **overrides) -> dict[str, int]:
    """A random Llama at `path` over `qwen_tokenizer()` and `template`; its added tokens' ids."""
    tok = qwen_tokenizer()
    ids = {t: tok.token_to_id(t) for t in SPECIAL + PLAIN}
    config = dict(vocab_size=tok.get_vocab_size(), eos_token_id=ids["<|im_end|>"], bos_token_id=None,
                  max_position_embeddings=4096)
    write_model(path, "llama", seed=seed, std=0.25, **{**config, **overrides})
    tok.save(str(path / "tokenizer.json"))
    base = json.loads((DEFAULT_TOKENIZER_DIR / "tokenizer_config.json").read_text())
    base.update({"eos_token": "<|im_end|>", "bos_token": None, "chat_template": template})
    (path / "tokenizer_config.json").write_text(json.dumps(base))
    return ids


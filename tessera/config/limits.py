"""Upper bounds on what a configuration or a command line may ask for, checked before anything
is allocated.

They are sanity bounds, not fit checks: each is several times the largest published model or
run of its kind (LLaMA-3.1 405B, DeepSeek-V3 671B, Qwen3, Gemma's 262k vocabulary, 10M-token
contexts), so a real configuration never meets them, while a typo (`dim: 40960000`) or a hostile
file is refused with a message naming the key instead of exhausting the machine's memory.
Whether a real model fits a real machine is `tessera plan`'s job.
"""

from __future__ import annotations

# ---- YAML configuration files -------------------------------------------------------------------
MAX_CONFIG_BYTES = 2**20  # a config file's size, 1 MiB (real ones are a few KiB; PyYAML reads well under 1 MiB/s)
MAX_YAML_NODES = 1_000_000  # values after expanding every alias (billion laughs expands to 10^9)
MAX_YAML_DEPTH = 64  # nesting of sections and lists; real configs nest 4 deep

# ---- model shape (largest real model in parentheses) --------------------------------------------
MAX_VOCAB_SIZE = 2**22  # 4,194,304 tokens (Gemma 3: 262,144; LLaMA-3: 128,256)
MAX_DIM = 65_536  # hidden size (LLaMA-3.1 405B: 16,384); also the MLA ranks
MAX_LAYERS = 1_024  # decoder layers (LLaMA-3.1 405B: 126)
MAX_MTP_DEPTH = 16  # multi-token-prediction modules (DeepSeek-V3 trains 1)
MAX_HEADS = 1_024  # attention (and key/value) heads (405B, DeepSeek-V3: 128)
MAX_HEAD_DIM = 4_096  # per-head size, also the MLA head parts (Gemma: 256)
MAX_FFN_DIM = 262_144  # SwiGLU hidden size of dense, routed and shared experts (405B: 53,248)
MAX_SEQ_LEN = 2**24  # 16,777,216 positions (LLaMA-4 Scout: 10M; DeepSeek-V3: 163,840)
MAX_EXPERTS = 4_096  # routed experts (DeepSeek-V3: 256; Kimi K2: 384)
MAX_SINKHORN_ITERS = 10_000  # Sinkhorn routing iterations (S-BASE uses tens)

# ---- batch and layout ---------------------------------------------------------------------------
MAX_BATCH_SAMPLES = 2**24  # micro and global batch, in samples (DeepSeek-V3: 15,360)
MAX_TOKENS_PER_STEP = 2**30  # global_batch_size x seq_len (DeepSeek-V3: 63M; LLaMA-3 405B: 16M)
MAX_PARALLEL_SIZE = 2**20  # one mesh dimension, and pipeline micro-batches
MAX_LOCAL_RANKS = 1_024  # `tessera train --nproc N` processes on one machine
MAX_RESTARTS = 10_000  # `tessera train --max-restarts K` (a failure every hour of a year-long run)

# ---- scalars ------------------------------------------------------------------------------------
MAX_SEED = 2**63 - 1  # seeds are 0..MAX_SEED: they fit int64 everywhere they are stored
MAX_INT = 2**63 - 1  # any integer of a configuration fits int64
MAX_SPIKE_WINDOW = 100_000  # steps of loss history the spike rule keeps (and stores in each checkpoint)
MAX_TIMEOUT_S = 7 * 24 * 3600.0  # a collective timeout of a week; longer is a hang, not a wait
MIN_TEMPERATURE = 1e-5  # smallest sampling temperature above 0: logits / T stays finite in fp32
MAX_PORT = 65_535
MAX_REQUEST_BYTES = 2**31  # `--max-request-bytes` of `tessera serve` and `tessera router` (default: 8 MiB)

# ---- serving ------------------------------------------------------------------------------------
MAX_KV_BLOCKS = 2**24  # `tessera serve --num-blocks` (x 16 tokens: 268M cached positions)
MAX_KV_CACHE_GIB = 2.0**20  # `tessera serve --kv-cache-gib` (a PiB; a GPU holds ~0.1 TiB)
# one server-sent event a router reads whole for its usage (tessera/infer/fleet/prefix_index.py): a Responses
# stream's last event repeats the whole answer (a 128k-token answer is ~1 MiB of JSON); a longer one is not read
MAX_STREAM_EVENT_BYTES = 2**24
# the tools one agent request offers (tessera/infer/agents/turn.py); every schema is compiled to check it
MAX_TOOLS = 256  # tools a request offers (OpenAI's limit: 128; agents with many MCP servers send ~100)
MAX_TOOL_DESCRIPTION_CHARS = 2**16  # one tool's description (long coding-agent ones are ~10k characters)
MAX_TOOL_SCHEMA_CHARS = 2**16  # one tool's parameter schema as JSON text (real ones: a few KiB)

# ---- chat templates (code from a model or tokenizer directory; tessera/data/chat_template.py) ---
MAX_TEMPLATE_SECONDS = 10.0  # rendering one conversation (real templates take milliseconds)
MAX_TEMPLATE_CHARS = 2**26  # 67M characters of output (a 10M-token context is ~40M characters)
MAX_TEMPLATE_NUMBER = 2**16  # a number given to a filter or function (a width, a count), a format width
MAX_TEMPLATE_BITS = 2**16  # the largest integer a template computes (multiplying or raising to a power)

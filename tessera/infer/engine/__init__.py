"""The engine and its front ends: `LLMEngine` (llm_engine.py: requests in, tokens out, one `step()`
at a time), the background thread that runs it for the server (loop.py), the offline `LLM`
(llm.py), a request checked once (checked_request.py), the sequences and the typed hand-offs between
scheduler and runner (sequence.py, step_outputs.py), text and stop rules (output_processor.py,
detokenizer.py), serving metrics, perplexity through the engine, the eager reference generation
every cached path is tested against, and sleep level 1 (sleep.py: KV cache freed, weights to host
memory, in place).
"""

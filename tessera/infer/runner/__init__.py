"""The executor's side of a step: executors in this process or over tensor-parallel worker processes
(executor.py, tp_*.py, tensor_parallel.py; a GGUF file's kept blocks cut by gguf_shards.py), the model
over the paged cache (paged_model.py, paged_attention.py, ragged_attention.py, window_ring.py for a
sliding window's ring of slots, bucketed_decode.py), the model runner that samples and verifies
(model_runner.py), dynamic LoRA adapters (lora.py), the image encoder of a vision-language model
(multimodal.py), and the proposers of speculative decoding (speculative.py, draft_tokens.py,
eagle_proposer.py, mtp_proposer.py, rejection_sampling.py).
"""

"""The activation-memory savers the layouts apply to a model's blocks: recomputation by block or by
operator (`activation_checkpoint.py`, with the save lists and FP8 keeps of `recompute_policy.py`, and
the MoE all-to-all outputs an op policy keeps instead of re-sending, `kept_exchange.py`) and saved
activations moved to host memory (`activation_offload.py`)."""

"""Attention beside the core softmax (models/attention.py), each behind its seam: gpt-oss's sink logits
(attention_sinks.py), DeepSeek-V3.2's indexer-selected latent attention (sparse_mla.py) and its
indexer's KL loss (indexer_loss.py), and GRPO's shared-prefix rows through the per-call attention seam
(shared_prefix.py)."""

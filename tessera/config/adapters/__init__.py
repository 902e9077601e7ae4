"""Parameter-efficient fine-tuning's configuration: what trains over a frozen base model.

    lora.py   `train.lora`: LoRA / QLoRA adapters (rank, alpha, targets by HuggingFace name, a quantized
              base), the refusals of what cannot be adapted, and the targets' names through the family
              registry (tessera/config/families)
"""

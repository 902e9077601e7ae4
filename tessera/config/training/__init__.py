"""The train section's parts beyond the language-model objective, one module each: what an EAGLE-3
draft head trains against (`eagle.py`), the objective and DPO's settings (`dpo.py`), GRPO's
(`grpo.py`), LoRA / QLoRA adapters and their targets by HuggingFace name (`lora.py`), and a
vision-language fine-tune (`vision_training.py`). `tessera.config.schema` holds them as fields of
`TrainConfig` and `RunConfig`; `tessera.config.run_checks` calls each module's cross-field check.
"""

"""The vision-language models: the base every family shares (vision_language.py: the image seam,
merging image rows into the sequence), LLaVA (llava.py, over the CLIP / SigLIP tower of
vision_tower.py), Qwen2-VL / Qwen2.5-VL (qwen_vl.py, over its native-resolution tower
qwen_vision.py) and Qwen3.5 / Qwen3.5-MoE (qwen3_vision.py: QwenVL over Qwen3-VL's tower). A
family is registered in tessera/config/vision_families.py and tessera/checkpoint/vision_families.py.
"""

"""Layer 5: distributed checkpoints (DCP) and HuggingFace conversion."""

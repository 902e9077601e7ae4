"""Layer 5: checkpoints.

- `tessera.checkpoint.dcp`: crash-safe distributed checkpoints (torch.distributed.checkpoint) of
  a training run, loadable under another parallel layout.
- `tessera.checkpoint.hf`: HuggingFace model directories (config.json + safetensors).
- `tessera.checkpoint.convert`: models from either format, and conversion between them.

Submodules are imported where used, so loading a HuggingFace model does not pay for DCP.
"""

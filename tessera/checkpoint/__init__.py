"""Layer 5: checkpoints.

- `tessera.checkpoint.dcp`: crash-safe distributed checkpoints (torch.distributed.checkpoint) of
  a training run, loadable under another parallel layout.
- `tessera.checkpoint.hf`: HuggingFace model directories (config.json + safetensors), written by
  `hf_writer` one shard file at a time; `hf_export` writes a Tessera checkpoint saved under any
  layout that way without building the model.
- `tessera.checkpoint.convert`: models from either format (the one loader of Tessera
  checkpoints), and conversion between them.
- Untrusted files: `dcp_reader` / `restricted_unpickle` (no code runs from a checkpoint),
  `checksums` (truncated or corrupted files are detected), `hf_files` (malformed HuggingFace
  directories are refused), `run_lock` (one trainer per run directory).

Submodules are imported where used, so loading a HuggingFace model does not pay for DCP.
"""

"""Layer 5: checkpoints, organised by format.

- `tessera.checkpoint.dcp`: Tessera checkpoints, crash-safe distributed checkpoints of a training
  run (DCP files + meta.json), loadable under another parallel layout;
- `tessera.checkpoint.hf`: HuggingFace model directories (config.json + safetensors + tokenizer);
- `tessera.checkpoint.int8`: the pre-quantized int8 directory serving reads.

Across formats: `loading` is the one loader of whole models (any of the three) and says where a
model's tokenizer is; `vision_families` each vision-language family's parts (model, image
processor, directory); `parts` is what a rank's sharded loaders fill (`hf.load.load_hf_shards`,
`dcp.shards.load_checkpoint_shards`); `convert` writes one format as the other. Untrusted files:
nothing is unpickled beyond plain data, checksums detect damage, malformed HuggingFace
directories are refused.

Submodules are imported where used, so loading a HuggingFace model does not pay for DCP.
"""

"""HuggingFace model directories: config.json, safetensors (single or sharded), tokenizer files.

- `names`: each Tessera tensor's HuggingFace name(s), and what an export refuses, by family
  (the config.json mapping is tessera/config/hf_config.py, also by family);
- `files` / `slices`: the safetensors read as untrusted input, and any box of a tensor read alone;
- `load`: the one path that fills a model (whole, a rank's shards or stages) from a directory,
  and `load_pretrained`;
- `writer`: the one writer of a directory (`save_pretrained` for a model in memory), and
  `export`: a Tessera checkpoint saved under any layout written one shard file at a time;
- `tokenizer`: the tokenizer files, special-token ids and chat template an export carries.
"""

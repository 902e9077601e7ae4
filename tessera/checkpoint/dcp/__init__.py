"""Tessera checkpoints: directories of DCP files (torch.distributed.checkpoint) plus meta.json.

- `store`: saving (crash-safe, collective), finding, verifying, reading and loading checkpoints,
  under any parallel layout;
- `reader` / `restricted_unpickle`: reading DCP files without running code from them;
- `checksums`: every file's size and CRC-32 in meta.json, so damage is detected;
- `run_lock`: one trainer per run directory;
- `model`: a model saved as, and rebuilt from, a checkpoint alone (its run configuration);
- `shards`: a checkpoint's weights into a rank's model parts, reading only the chunks it holds;
- `layout`: a checkpoint written from a HuggingFace directory, cut into a target layout's shards.
"""

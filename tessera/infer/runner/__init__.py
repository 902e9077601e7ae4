"""tessera/infer/runner."""

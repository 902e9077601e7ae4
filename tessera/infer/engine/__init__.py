"""tessera/infer/engine."""

"""tessera/infer/cpu."""

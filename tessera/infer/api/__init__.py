"""tessera/infer/api."""

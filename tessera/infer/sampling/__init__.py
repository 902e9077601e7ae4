"""tessera/infer/sampling."""

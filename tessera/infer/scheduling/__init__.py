"""tessera/infer/scheduling."""

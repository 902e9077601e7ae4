

def test_the_benchmark_serves_the_same_tokens_with_and_without_the_cache(capsys):
    """bench/hybrid_prefix_cache.py on a small case: what it times with prefix caching computes the
    tokens it computes without, the later requests' shared blocks coming from the cache."""
    import json

    from bench.hybrid_prefix_cache import main

    assert main(["--prefix", "48", "--tail", "5", "--requests", "3", "--dim", "64", "--layers", "4"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["same_tokens"] and report["with_cache"]["cached_prompt_tokens"] == 2 * 48
    assert report["without_cache"]["cached_prompt_tokens"] == 0

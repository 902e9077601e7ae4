"""KV tiers below the device: blocks the device evicts come back from host memory, blocks a server
wrote to its cache directory are found by the next server, and greedy output is the same as
without tiers (dense, MoE, MLA; int8 KV). Damaged, truncated or foreign files are recomputed;
the directory is private and bounded."""

import os
import stat

import pytest

from tessera.config.errors import ConfigError
from tessera.infer import LLM, SamplingParams
from tessera.infer.config import EngineConfig
from tests.infer.kv_messages import PEER_SECRET, body_of, forged, nested, signed
from tests.infer.tiny_models import write_model

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
SHARED = "System: answer in one short line, politely.\n"
FIRST = SHARED + "User: hi"
OTHERS = [f"{i} other words fill the cache until the first is gone" for i in range(4)]
# small enough that the other prompts push every block of the first out of the device
SMALL = dict(block_size=4, num_blocks=20, max_model_len=80, max_num_seqs=1, decode_batch_sizes=[])


def _run(llm, prompts):
    return [llm.generate([p], GREEDY)[0].token_ids for p in prompts]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tier_models")
    for family in ("llama", "mixtral", "deepseek_v3"):
        write_model(root / family, family, std=0.25)
    return root


@pytest.mark.parametrize("family,kv_dtype", [("llama", None), ("llama", "int8"), ("mixtral", None),
                                             ("deepseek_v3", None)])
def test_evicted_prefix_comes_back_from_host_memory(dirs, family, kv_dtype):
    prompts = [FIRST, *OTHERS, FIRST]
    want = _run(LLM(dirs / family, **SMALL, kv_cache_dtype=kv_dtype), prompts)
    llm = LLM(dirs / family, **SMALL, kv_cache_dtype=kv_dtype, kv_offload_gib=0.01)
    assert _run(llm, prompts) == want
    tiers = llm.engine.tier_metrics
    full = (len(llm.tokenizer.encode(FIRST)) - 1) // 4
    assert tiers.host_saved_blocks > 0 and tiers.host_hit_blocks >= full
    assert llm.engine.blocks.cache.hit_tokens >= full * 4
    page = llm.engine.prometheus()
    assert f"tessera_kv_host_hit_blocks_total {tiers.host_hit_blocks}" in page
    assert "tessera_kv_disk_hit_blocks_total 0" in page


def test_a_host_tier_too_small_for_one_block_is_refused(dirs):
    with pytest.raises(ConfigError, match="kv_offload_gib=1e-09 is invalid: it holds no block"):
        LLM(dirs / "llama", **SMALL, kv_offload_gib=1e-9)


def test_a_new_server_finds_blocks_on_disk(dirs, tmp_path):
    cache = tmp_path / "kv"
    prompts = [FIRST, SHARED + "User: what is 2+2?"]
    want = _run(LLM(dirs / "llama", **SMALL), prompts)
    first = LLM(dirs / "llama", **SMALL, kv_cache_dir=str(cache))
    assert _run(first, prompts[:1]) == want[:1]
    first.engine.close()
    assert first.engine.tier_metrics.disk_written_blocks > 0
    assert stat.S_IMODE(os.stat(cache).st_mode) == 0o700
    files = list(cache.glob("*/*.kv"))
    assert files and all(stat.S_IMODE(os.stat(f).st_mode) == 0o600 for f in files)

    second = LLM(dirs / "llama", **SMALL, kv_cache_dir=str(cache))
    assert _run(second, prompts) == want
    shared_blocks = len(second.tokenizer.encode(SHARED)) // 4
    assert second.engine.tier_metrics.disk_hit_blocks >= shared_blocks
    assert "tessera_kv_disk_hit_blocks_total" in second.engine.prometheus()

    other = tmp_path / "other_model"
    write_model(other, "llama", seed=3, std=0.25)  # another model: none of these files is its own
    want_other = _run(LLM(other, **SMALL), prompts[:1])
    third = LLM(other, **SMALL, kv_cache_dir=str(cache))
    assert _run(third, prompts[:1]) == want_other
    assert third.engine.tier_metrics.disk_hit_blocks == 0


@pytest.mark.parametrize("damage", ["flip", "truncate", "header", "empty"])
def test_damaged_files_are_recomputed_not_used(dirs, tmp_path, damage):
    cache = tmp_path / "kv"
    want = _run(LLM(dirs / "llama", **SMALL), [FIRST])
    writer = LLM(dirs / "llama", **SMALL, kv_cache_dir=str(cache))
    _run(writer, [FIRST])
    writer.engine.close()
    files = sorted(cache.glob("*/*.kv"))
    for f in files:
        data = bytearray(f.read_bytes())
        if damage == "flip":
            data[-5] ^= 0x40  # a key/value byte: the checksum no longer matches
        elif damage == "truncate":
            data = data[:len(data) // 2]
        elif damage == "header":
            data = data.replace(b'"identity": "', b'"identity": "0', 1)
        else:
            data = bytearray()
        f.write_bytes(bytes(data))
    reader = LLM(dirs / "llama", **SMALL, kv_cache_dir=str(cache))
    assert _run(reader, [FIRST]) == want
    m = reader.engine.tier_metrics
    assert m.disk_hit_blocks == 0 and m.disk_rejected_files >= 1


def test_the_cache_directory_is_bounded(dirs, tmp_path):
    cache = tmp_path / "kv"
    llm = LLM(dirs / "llama", **SMALL, kv_cache_dir=str(cache), kv_cache_dir_gib=4e-6)  # ~4 KiB
    _run(llm, [FIRST, *OTHERS])
    llm.engine.close()
    written = llm.engine.tier_metrics.disk_written_blocks
    on_disk = list(cache.glob("*/*.kv"))
    block = max(f.stat().st_size for f in on_disk)
    assert 0 < len(on_disk) < written
    assert sum(f.stat().st_size for f in on_disk) <= 4e-6 * 2**30 * 1.1 + block


def test_directories_others_could_write_are_refused(dirs, tmp_path):
    open_dir = tmp_path / "shared"
    open_dir.mkdir()
    open_dir.chmod(0o777)
    with pytest.raises(ConfigError, match="kv_cache_dir=.*writable by this user only"):
        LLM(dirs / "llama", **SMALL, kv_cache_dir=str(open_dir))
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "target", target_is_directory=True)
    (tmp_path / "target").mkdir(mode=0o700)
    with pytest.raises(ConfigError, match="symlink is refused"):
        LLM(dirs / "llama", **SMALL, kv_cache_dir=str(link))


@pytest.mark.parametrize("bad,match", [
    (dict(kv_offload_gib=1.0, enable_prefix_caching=False), "kv_offload_gib=1.0 .*needs prefix caching"),
    (dict(kv_cache_dir="/tmp/x", tensor_parallel_size=2), "kv_cache_dir='/tmp/x' .*one rank"),
    (dict(kv_offload_gib=-1.0), "kv_offload_gib=-1.0 .*>= 0"),
    (dict(kv_cache_dir="/tmp/x", kv_cache_dir_gib=0.0), "kv_cache_dir_gib=0.0 .*> 0"),
])
def test_bad_tier_settings_are_refused_by_name(bad, match):
    with pytest.raises(ConfigError, match=match):
        EngineConfig(**bad)


@pytest.mark.slow
def test_served_blocks_survive_a_restart_and_show_on_metrics(dirs, tmp_path):
    """`tessera serve DIR --kv-offload-gib G --kv-cache-dir D`, stopped with Ctrl-C and started again:
    the second server answers from the blocks the first wrote (kv_disk hits on /metrics), with the
    same text."""
    import subprocess
    import sys
    from pathlib import Path

    import httpx

    from tests.hang_guard import HANG_S
    from tests.infer.running_server import serving_url, stop_serving, terminate_if_running, wait_until_serving

    root = Path(__file__).resolve().parents[2]
    env = {"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin", "PYTHONPATH": str(root)}
    path, cache = dirs / "llama", tmp_path / "kv"
    body = {"model": str(path), "prompt": FIRST, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    texts, pages = [], []
    for _ in range(2):
        proc = subprocess.Popen([sys.executable, "-m", "tessera", "serve", str(path), "--port", "0", "--block-size",
                                 "4", "--kv-offload-gib", "0.01", "--kv-cache-dir", str(cache),
                                 "--log-level", "warning"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
        try:
            url = serving_url(proc)
            wait_until_serving(proc, url)
            r = httpx.post(url + "/v1/completions", json=body, timeout=HANG_S)
            assert r.status_code == 200, r.text
            texts.append(r.json()["choices"][0]["text"])
            pages.append(httpx.get(url + "/metrics", timeout=HANG_S).text)
            stop_serving(proc)
        finally:
            terminate_if_running(proc)
    want = LLM(path, block_size=4).generate([FIRST], SamplingParams(max_tokens=8, temperature=0.0,
                                                                    ignore_eos=True))[0].text
    assert texts == [want, want]
    hits = [float(line.split()[-1]) for page in pages for line in page.splitlines()
            if line.startswith("tessera_kv_disk_hit_blocks_total ")]
    assert hits[0] == 0 and hits[1] >= len(SHARED) // 4
    assert any(line.startswith("tessera_kv_host_hit_blocks_total ") for line in pages[1].splitlines())


@pytest.mark.parametrize("family", ["llama", "mixtral", "deepseek_v3"])
def test_blocks_move_from_a_prefill_engine_to_a_decode_engine(dirs, family):
    from tessera.infer.scheduling.kv_transfer import export_prefix, import_prefix, open_transfer

    want = _run(LLM(dirs / family, **SMALL), [FIRST])
    prefill = LLM(dirs / family, **SMALL, kv_role="prefill")
    decode = LLM(dirs / family, **SMALL, kv_role="decode", kv_offload_gib=0.01)
    ids = prefill.tokenizer.encode(FIRST)
    prefill.generate([ids], SamplingParams(max_tokens=1, temperature=0.0))
    message = export_prefix(prefill.engine, ids, PEER_SECRET)
    full = (len(ids) - 1) // 4
    assert import_prefix(decode.engine, open_transfer(message, PEER_SECRET)) == full
    assert _run(decode, [FIRST]) == want
    m = decode.engine.tier_metrics
    assert m.host_hit_blocks == full and m.transfer_in_blocks == full
    assert prefill.engine.tier_metrics.transfer_out_blocks == full
    assert f"tessera_kv_transfer_in_blocks_total {full}" in decode.engine.prometheus()


def test_a_damaged_or_foreign_transfer_keeps_nothing_wrong(dirs, tmp_path):
    from tessera.infer.scheduling.kv_transfer import TransferError, export_prefix, import_prefix, open_transfer

    want = _run(LLM(dirs / "llama", **SMALL), [FIRST])
    prefill = LLM(dirs / "llama", **SMALL, kv_role="prefill")
    ids = prefill.tokenizer.encode(FIRST)
    prefill.generate([ids], SamplingParams(max_tokens=1, temperature=0.0))
    message = bytearray(export_prefix(prefill.engine, ids, PEER_SECRET))
    message[-10] ^= 0x01  # a value of the last block, damaged at the peer (signed as it is)
    message = signed(body_of(bytes(message)))
    decode = LLM(dirs / "llama", **SMALL, kv_role="decode", kv_offload_gib=0.01)
    kept = import_prefix(decode.engine, open_transfer(message, PEER_SECRET))
    assert kept == (len(ids) - 1) // 4 - 1 and decode.engine.tier_metrics.transfer_rejected_blocks == 1
    assert _run(decode, [FIRST]) == want
    for bad in (b"", message[:20], b"GET / HTTP/1.1\r\n", signed(body_of(message)[:60]),  # truncated
                signed(b"\xff\xff\x00\x00{}"), signed(b"\x05\x00\x00\x00[1, 2"), signed(b"\x02\x00\x00\x00[]")):
        with pytest.raises(TransferError):
            open_transfer(bad, PEER_SECRET)
    other = tmp_path / "other"
    write_model(other, "llama", seed=5, std=0.25)
    stranger = LLM(other, **SMALL, kv_role="decode", kv_offload_gib=0.01)
    with pytest.raises(TransferError, match="another model"):
        import_prefix(stranger.engine, open_transfer(message, PEER_SECRET))
    with pytest.raises(ConfigError, match="kv_role='decode' .*kv_offload_gib > 0"):
        EngineConfig(kv_role="decode")


def test_blocks_not_made_with_the_peer_secret_are_refused_before_they_are_read(dirs):
    """Whoever holds a genuine message but not the KV peer secret cannot plant blocks: replacing the
    keys and values and recomputing the checksums leaves a tag that no longer verifies; a message made
    with another secret is refused the same way. A peer's header nested 20,000 deep is a TransferError."""
    from tessera.infer.scheduling.kv_peer import UnauthenticatedPeer
    from tessera.infer.scheduling.kv_transfer import TransferError, export_prefix, open_transfer

    prefill = LLM(dirs / "llama", **SMALL, kv_role="prefill")
    ids = prefill.tokenizer.encode(FIRST)
    prefill.generate([ids], SamplingParams(max_tokens=1, temperature=0.0))
    message = export_prefix(prefill.engine, ids, PEER_SECRET)
    assert open_transfer(message, PEER_SECRET).header["tokens"] == ids
    for bad in (forged(message), signed(body_of(forged(message)), b"another secret, not the peers'"),
                signed(nested(20_000), b"another secret, not the peers'")):
        with pytest.raises(UnauthenticatedPeer, match="not made with this instance's KV peer secret"):
            open_transfer(bad, PEER_SECRET)
    with pytest.raises(TransferError, match="KV transfer header is nested too deeply"):
        open_transfer(signed(nested(20_000)), PEER_SECRET)


def test_scoring_that_evicts_blocks_saves_them_before_overwriting(dirs):
    """Perplexity borrows KV blocks outside the scheduler's steps: the blocks it evicts are copied to
    the host tier before its forward writes over them."""
    from tessera.infer.engine.perplexity import perplexity

    want = _run(LLM(dirs / "llama", **SMALL), [FIRST])
    llm = LLM(dirs / "llama", **SMALL, kv_offload_gib=0.01)
    assert _run(llm, [FIRST]) == want
    text = " ".join(OTHERS) + " and more words to fill every block of the device"
    perplexity(llm.engine, llm.tokenizer.encode(text)[:79])
    assert llm.engine.tier_metrics.host_saved_blocks > 0
    assert _run(llm, [FIRST]) == want
    assert llm.engine.tier_metrics.host_hit_blocks > 0

"""The KV disk tier (`--kv-cache-dir`) under a careless operator and a broken file system: a path
that cannot serve is refused at start-up in one line (exit status 2 from `tessera serve`, before
the model loads); a directory made read-only, removed or full while serving costs recomputed or
unwritten blocks, counted on /metrics (`tessera_kv_disk_errors_total`), never a failed request; a
block file replaced by a FIFO, a symlink or a huge sparse file is refused without being read."""

import errno
import os
import shutil
import stat
import tracemalloc
from pathlib import Path

import pytest

from tessera.config.errors import ConfigError
from tessera.infer import LLM
from tests.infer.test_kv_tiers import FIRST, OTHERS, SMALL, _run

AS_ROOT = os.geteuid() == 0  # file modes do not stop root


def _long_path(base: Path) -> Path:
    """A directory that can be created, but whose block files' paths are past PATH_MAX (4096)."""
    path = base
    while len(str(path)) < 4060:
        path = path / ("y" * min(200, 4060 - len(str(path))))
    return path


def _bad_dir(tmp_path: Path, case: str) -> Path:
    if case == "a file":
        (tmp_path / "kv").write_text("")
    elif case == "unwritable parent":
        (tmp_path / "ro").mkdir(mode=0o500)
        return tmp_path / "ro" / "kv"
    elif case == "too long a name":
        return tmp_path / ("x" * 300)
    elif case == "too long a path":
        return _long_path(tmp_path)
    elif case in ("/proc/tessera-kv", "/proc/1"):
        return Path(case)
    return tmp_path / "kv"


@pytest.mark.parametrize("case, fragment", [
    ("a file", "it exists and is not a directory"),
    ("/proc/tessera-kv", "it cannot be created (No such file or directory)"),
    ("/proc/1", ""),  # this user's: a block file cannot be written in it; another's: refused as such
    ("too long a name", "it cannot be created (File name too long)"),
    ("too long a path", "a block file cannot be written in it (File name too long)"),
    pytest.param("unwritable parent", "it cannot be created (Permission denied)",
                 marks=pytest.mark.skipif(AS_ROOT, reason="root writes in any directory")),
])
def test_a_cache_directory_that_cannot_serve_is_refused_in_one_line(llama, tmp_path, case, fragment):
    path = _bad_dir(tmp_path, case)
    with pytest.raises(ConfigError) as caught:
        LLM(llama[0], **SMALL, kv_cache_dir=str(path))
    message = str(caught.value)
    assert message.startswith("kv_cache_dir=") and " is invalid: " in message and fragment in message
    assert "\n" not in message and len(message) < 400, message


def test_serve_refuses_a_cache_directory_before_loading_the_model(llama, tmp_path, capsys):
    from tessera.cli import main

    (tmp_path / "kv").write_text("")
    assert main(["serve", str(llama[0]), "--port", "0", "--kv-cache-dir", str(tmp_path / "kv")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tessera serve: error: kv_cache_dir=") and "not a directory" in err
    assert len(err.strip().splitlines()) == 1, err


def _break(cache: Path, how: str, monkeypatch) -> None:
    """Make the cache directory fail while serving."""
    if how == "read-only":
        for d in (cache, *cache.iterdir()):
            d.chmod(0o500)
    elif how == "removed":  # and a file where it was: every path below it is ENOTDIR
        shutil.rmtree(cache)
        cache.write_text("")
    else:  # full: renaming a written block into place fails as on a full disk
        real = os.replace

        def replace(src, dst, *args, **kwargs):
            if str(src).startswith(str(cache)):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(dst))
            return real(src, dst, *args, **kwargs)

        monkeypatch.setattr(os, "replace", replace)


@pytest.mark.parametrize("how", [
    pytest.param("read-only", marks=pytest.mark.skipif(AS_ROOT, reason="root writes in a read-only directory")),
    "removed", "full"])
def test_a_failing_directory_never_fails_a_request(llama, tmp_path, monkeypatch, caplog, how):
    prompts = [FIRST, *OTHERS, FIRST]
    want = _run(LLM(llama[0], **SMALL), prompts)
    cache = tmp_path / "kv"
    llm = LLM(llama[0], **SMALL, kv_cache_dir=str(cache))
    assert _run(llm, prompts[:1]) == want[:1]
    _break(cache, how, monkeypatch)
    try:
        assert _run(llm, prompts[1:]) == want[1:]
    finally:
        if how == "read-only":
            for d in (cache, *cache.iterdir()):
                d.chmod(0o700)
    m = llm.engine.tier_metrics
    assert m.disk_errors >= 1
    assert f"tessera_kv_disk_errors_total {m.disk_errors}" in llm.engine.prometheus()
    said = [r.getMessage() for r in caplog.records if "KV disk tier" in r.getMessage()]
    assert len(said) == 1 and "requests go on without it" in said[0], said  # logged once


BIG = 8 << 30  # a sparse block file of 8 GiB: nothing of it may be read into memory


@pytest.mark.parametrize("kind", ["fifo", "symlink", "sparse"])
def test_only_regular_files_of_a_block_size_are_read(llama, tmp_path, kind):
    """Each block file replaced: by a FIFO (reading would wait for a writer forever), a symlink to a
    good copy, or a sparse file of 8 GiB that starts as the block did. Each is refused unread, removed
    and recomputed, with the same answer."""
    cache = tmp_path / "kv"
    want = _run(LLM(llama[0], **SMALL), [FIRST])
    writer = LLM(llama[0], **SMALL, kv_cache_dir=str(cache))
    _run(writer, [FIRST])
    writer.engine.close()
    files = sorted(cache.glob("*/*.kv"))
    assert files
    for i, f in enumerate(files):
        if kind == "fifo":
            f.unlink()
            os.mkfifo(f, 0o600)
        elif kind == "symlink":
            good = tmp_path / f"good{i}"
            f.rename(good)
            f.symlink_to(good)
        else:
            os.truncate(f, BIG)
    reader = LLM(llama[0], **SMALL, kv_cache_dir=str(cache))
    tracemalloc.start()
    try:
        assert _run(reader, [FIRST]) == want
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 256 << 20, f"{peak} bytes allocated while reading"
    m = reader.engine.tier_metrics
    assert m.disk_hit_blocks == 0 and m.disk_rejected_files >= 1 and m.disk_errors == 0
    left = [f for f in cache.glob("*/*.kv") if not stat.S_ISREG(os.lstat(f).st_mode) or os.lstat(f).st_size >= BIG]
    assert len(left) < len(files)  # those refused are gone (and written again, as regular files)

"""The CPU library's build (tessera/infer/cpu/build.py) never waits silently on a lock: PyTorch's
builder leaves its `lock` file behind when a build is killed, and the next build used to wait for it
forever, printing nothing. A lock whose builder is dead is taken over in one log line; a live builder
is waited for in one log line naming its pid (its `lock` left alone); a build that starts says so;
where the file system has no locks the build goes on as before, saying so. Each checkout builds in a
directory of its own. Deadlines are hang guards (tests/hang_guard.py)."""

from __future__ import annotations

import errno
import logging
import os
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tessera.infer.cpu import attention, build
from tessera.infer.cpu.build import BATON, OURS, build_directory, build_lock, library_name
from tests.hang_guard import HANG_S
from tests.train.runs import ROOT

# A Tessera build in another process: it holds the lock, creates PyTorch's `lock` as the builder does,
# says so, and ends its build (removing `lock`, as FileBaton.release does) when its stdin closes.
BUILDER = """import sys
from pathlib import Path
from tessera.infer.cpu.build import build_lock
d = Path(sys.argv[1])
with build_lock(d):
    (d / "lock").touch()
    print("building", flush=True)
    sys.stdin.read()
    (d / "lock").unlink()
"""


def _builder(directory: Path) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", BUILDER, str(directory)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    ready, _, _ = select.select([proc.stdout], [], [], HANG_S)
    assert ready and proc.stdout.readline() == "building\n", "the builder did not start"
    return proc


def _lock_in_thread(directory: Path) -> tuple[threading.Thread, threading.Event]:
    held = threading.Event()

    def take() -> None:
        with build_lock(directory):
            held.set()

    thread = threading.Thread(target=take, daemon=True)
    thread.start()
    return thread, held


def _messages(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "tessera.build"]


def test_a_lock_left_by_a_killed_build_is_taken_over_in_one_line(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="tessera.build")
    builder = _builder(tmp_path)
    builder.send_signal(signal.SIGKILL)  # killed midway: PyTorch's `lock` stays
    builder.wait(HANG_S)
    assert (tmp_path / BATON).exists()
    thread, held = _lock_in_thread(tmp_path)
    thread.join(HANG_S)
    assert held.is_set(), "the build waited on a lock its dead builder left"
    assert not (tmp_path / BATON).exists()
    messages = _messages(caplog)
    assert len(messages) == 1 and messages[0].startswith(f"taking over the build lock {tmp_path / BATON}"), messages


def test_a_live_builder_is_waited_for_in_one_line_naming_it(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="tessera.build")
    builder = _builder(tmp_path)
    thread, held = _lock_in_thread(tmp_path)
    deadline = time.monotonic() + HANG_S
    while not _messages(caplog) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _messages(caplog) == [f"waiting for process {builder.pid}, which is building the CPU kernels in "
                                 f"{tmp_path}"]
    assert not held.is_set() and (tmp_path / BATON).exists()  # a live builder's lock is its own
    builder.communicate("", timeout=HANG_S)  # its build ends
    thread.join(HANG_S)
    assert held.is_set() and len(_messages(caplog)) == 1  # nothing stale to take over


def test_a_file_system_without_locks_builds_as_before_saying_so(tmp_path, caplog, monkeypatch):
    def no_locks(*_):
        raise OSError(errno.ENOLCK, "No locks available")

    caplog.set_level(logging.WARNING, logger="tessera.build")
    monkeypatch.setattr(build.fcntl, "flock", no_locks)
    with build_lock(tmp_path):
        pass
    messages = _messages(caplog)
    assert len(messages) == 1 and messages[0].startswith(f"cannot lock {tmp_path / OURS}"), messages


def test_each_checkout_builds_in_a_directory_of_its_own(tmp_path, monkeypatch):
    a, b = tmp_path / "a" / "csrc", tmp_path / "b" / "csrc"
    assert library_name("tessera_cpu", a) == library_name("tessera_cpu", a) != library_name("tessera_cpu", b)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    name = attention.library()
    assert name == library_name(f"tessera_cpu_attention_{attention._vector_flags()[0]}", attention.CSRC)
    assert build_directory(name) == tmp_path / "ext" / name


@pytest.mark.slow  # builds the library (minutes on a loaded machine)
def test_the_kernel_builds_past_a_lock_a_killed_build_left(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    directory = build_directory(attention.library())
    directory.mkdir(parents=True)
    (directory / BATON).touch()  # what FileBaton leaves when its process dies mid-build
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    probe = [sys.executable, "-c", "from tessera.infer.cpu.attention import kernel; print(kernel())"]
    first = subprocess.run(probe, capture_output=True, text=True, env=env, timeout=3 * HANG_S)  # a build: generous
    assert first.returncode == 0 and first.stdout.split() == ["tessera_cpu.paged_attention"], first.stderr[-3000:]
    lines = first.stderr.splitlines()
    assert sum(line.startswith("taking over the build lock") for line in lines) == 1, first.stderr[-3000:]
    assert sum(line.startswith("building the CPU kernels") and "this may take minutes" in line
               for line in lines) == 1, first.stderr[-3000:]
    again = subprocess.run(probe, capture_output=True, text=True, env=env, timeout=HANG_S)  # built: said nothing
    assert again.returncode == 0 and again.stdout.split() == ["tessera_cpu.paged_attention"], again.stderr[-3000:]
    assert "build" not in again.stderr, again.stderr

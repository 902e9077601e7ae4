"""Run a `tessera` command with a directory that cannot be written, or that is full, also as root.

Root ignores permission bits, so a read-only file system is mounted over the directory in a private
user + mount namespace (`unshare -rm`, no privileges needed); where that is not possible the
directory is made read-only with chmod, which binds every user but root. A full disk is a 64 KiB
file system mounted the same way (skipped where namespaces are not available).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.train.runs import ROOT

_MOUNT_READ_ONLY = 'mount -t tmpfs -o ro,size=64k none "$1" && shift && exec "$@"'


def _can_mount(directory: Path) -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "-rm", "sh", "-c", _MOUNT_READ_ONLY, "sh", str(directory), "true"],
                           capture_output=True)
    return probe.returncode == 0


def run_with_full_disk(directory: Path, argv: list[str]) -> tuple[subprocess.CompletedProcess, list[str]]:
    """`python -m tessera ARGV` with a 64 KiB file system mounted on `directory` (which must exist);
    also the names left in that file system when the command has ended (read before it goes)."""
    if not _can_mount(directory):
        pytest.skip("no user namespaces: no way to mount a small file system")
    full = ('mount -t tmpfs -o size=64k none "$1" && dir="$1" && shift && "$@"; status=$?; '
            'echo "LEFT:$(ls -A "$dir" | tr "\\n" " ")" >&2; exit $status')
    command = ["unshare", "-rm", "sh", "-c", full, "sh", str(directory), sys.executable, "-m", "tessera", *argv]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    lines = proc.stderr.rstrip("\n").split("\n")
    assert lines[-1].startswith("LEFT:"), proc.stderr[-2000:]
    proc.stderr = "\n".join(lines[:-1]) + "\n"
    return proc, lines[-1].removeprefix("LEFT:").split()


def run_with_read_only(directory: Path, argv: list[str]) -> subprocess.CompletedProcess:
    """`python -m tessera ARGV` with `directory` (which must exist, empty) read-only."""
    command = [sys.executable, "-m", "tessera", *argv]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    if _can_mount(directory):
        command = ["unshare", "-rm", "sh", "-c", _MOUNT_READ_ONLY, "sh", str(directory), *command]
    elif os.geteuid() != 0:
        directory.chmod(0o555)
    else:
        pytest.skip("root without user namespaces: no way to make a directory read-only")
    try:
        return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    finally:
        directory.chmod(0o755)

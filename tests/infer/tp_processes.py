"""The processes of tensor-parallel serving as the tests see them: `tessera serve` at
tensor_parallel_size=2 in a child process, the children of a process and whether one is alive."""

import os
import signal
import subprocess
import sys
from pathlib import Path

from tests.hang_guard import HANG_S
from tests.infer.running_server import serving_url, wait_until_serving


def children(pid: int) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def serve_two_ranks(path, **popen_options) -> tuple[subprocess.Popen, str]:
    """`tessera serve` of `path` at tensor_parallel_size=2 on the CPU, its output piped, on a port
    the system chose (--port 0), and its URL once it answers."""
    proc = subprocess.Popen([sys.executable, "-m", "tessera", "serve", str(path), "--port", "0",
                             "--block-size", "4", "--device", "cpu", "--tensor-parallel-size", "2",
                             "--log-level", "warning"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}, **popen_options)
    try:
        url = serving_url(proc)
        wait_until_serving(proc, url)
    except BaseException:
        if popen_options.get("start_new_session"):
            os.killpg(proc.pid, signal.SIGKILL)
        else:
            proc.kill()
        proc.wait(HANG_S)
        raise
    return proc, url

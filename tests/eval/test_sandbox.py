"""Generated code runs contained: a sandboxed program cannot write the caller's files, reach the
network or a Unix-domain socket of the host, exceed its memory, run past its time, fork without
bound, keep capabilities, or see or outlive anything outside its pid namespace. Each hostile program
below attempts its damage, swallows the error, and then asserts what it observed, so a pass means
the attempt really ran and was stopped; the caller's side is checked from outside as well. Where
user namespaces are unavailable, the sandbox refuses unless unsandboxed runs are allowed."""

from __future__ import annotations

import errno
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
import uuid
from pathlib import Path

import pytest

from tessera.eval.sandbox import Sandbox, SandboxLimits
from tests.hang_guard import HANG_S

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def sandbox():
    return Sandbox(SandboxLimits(timeout_s=5, memory_mib=512, processes=16))


def _run(sandbox: Sandbox, code: str):
    return sandbox.run(textwrap.dedent(code))


def _named(code: str) -> tuple[str, str]:
    """`code` preceded by a line that names its process (and so every process it forks) with a token
    of its own, so that the check below finds this run's processes and never another test run's."""
    name = "tsb" + uuid.uuid4().hex[:12]
    head = f"import ctypes\nctypes.CDLL(None).prctl(15, b'{name}', 0, 0, 0)\n"  # 15: PR_SET_NAME
    return name, head + textwrap.dedent(code)


def _runner_processes(name: str) -> list[str]:
    """Processes left running the named program (its name was set by the line `_named` adds)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            comm = Path(f"/proc/{pid}/comm").read_text().strip()
        except OSError:
            continue
        if comm == name:
            found.append(pid)
    return found


def test_a_plain_program_passes_and_a_failing_one_fails_with_its_error(sandbox):
    assert _run(sandbox, "assert sum(range(4)) == 6\n").passed
    failed = _run(sandbox, "assert sorted([2, 1]) == [2, 1], 'not sorted'\n")
    assert failed.status == "failed" and "not sorted" in failed.detail
    assert _run(sandbox, "import sys\nsys.exit(0)\n").status == "failed"  # leaving early is not passing


def test_the_callers_files_cannot_be_written_removed_or_created(sandbox, tmp_path):
    canary = tmp_path / "canary.txt"
    canary.write_text("untouched")
    verdict = _run(sandbox, f"""
        import os, shutil
        errors = 0
        for attempt in (lambda: open({str(canary)!r}, "w").write("pwned"),
                        lambda: os.remove({str(canary)!r}),
                        lambda: open({str(tmp_path / "new.txt")!r}, "w").write("x"),
                        lambda: shutil.rmtree({str(tmp_path)!r}),
                        lambda: open({str(ROOT / "README.md")!r}, "a").write("x")):
            try:
                attempt()
            except OSError:
                errors += 1
        assert errors == 5, errors
        open("scratch.txt", "w").write("its own scratch directory is writable")
        assert open("scratch.txt").read().startswith("its own")
    """)
    assert verdict.passed, verdict.detail
    assert canary.read_text() == "untouched" and sorted(p.name for p in tmp_path.iterdir()) == ["canary.txt"]


def test_the_network_is_unreachable(sandbox):
    listener = socket.create_server(("127.0.0.1", 0))
    listener.setblocking(False)
    port = listener.getsockname()[1]
    try:
        verdict = _run(sandbox, f"""
            import socket
            try:
                socket.create_connection(("127.0.0.1", {port}), timeout=2)
                reached = True
            except OSError:
                reached = False
            assert not reached
        """)
        assert verdict.passed, verdict.detail
        with pytest.raises(BlockingIOError):
            listener.accept()
    finally:
        listener.close()


def _visible_directory() -> Path:
    """A directory of the caller's that the sandbox shows read-only (not under its scratch tmpfs)."""
    from tessera.eval.sandbox_init import scratch_point

    hidden = scratch_point()
    for candidate in (tempfile.gettempdir(), "/var/tmp", "/dev/shm", str(ROOT)):
        real = os.path.realpath(candidate)
        if os.path.isdir(real) and os.access(real, os.W_OK) and not (real + "/").startswith(hidden + "/"):
            return Path(real)
    pytest.skip(f"no writable directory outside the sandbox's scratch point {hidden}")


def test_no_unix_domain_socket_of_the_host_is_reachable(sandbox):
    """A path socket shows through the read-only view of the file system (connect() writes nothing
    to it), and an abstract one lives in the network namespace: neither may be reached. Sockets of
    any family the program does not need are refused; a socketpair and an inet socket still work."""
    directory = Path(tempfile.mkdtemp(dir=_visible_directory(), prefix="sock"))
    path_listener, abstract_listener = socket.socket(socket.AF_UNIX), socket.socket(socket.AF_UNIX)
    abstract = b"\0tessera-sandbox-test-" + str(os.getpid()).encode()
    try:
        directory.chmod(0o755)
        path_listener.bind(str(directory / "s"))
        (directory / "s").chmod(0o777)
        abstract_listener.bind(abstract)
        for listener in (path_listener, abstract_listener):
            listener.listen()
            listener.setblocking(False)
        verdict = _run(sandbox, f"""
            import os, socket
            assert os.path.exists({str(directory / "s")!r})  # the host's socket file is in view
            reached = []
            for address in ({str(directory / "s")!r}, {abstract!r}):
                try:
                    client = socket.socket(socket.AF_UNIX)
                    client.connect(address)
                    client.sendall(b"out")
                    reached.append(address)
                except OSError:
                    pass
            assert reached == [], reached
            for family in ("AF_UNIX", "AF_NETLINK", "AF_PACKET", "AF_VSOCK", "AF_ALG"):
                try:
                    socket.socket(getattr(socket, family), socket.SOCK_DGRAM).close()
                    raise AssertionError(family + " allowed")
                except (OSError, AttributeError):
                    pass
            a, b = socket.socketpair()
            a.sendall(b"ok")
            assert b.recv(2) == b"ok"
            socket.socket(socket.AF_INET).close()
        """)
        assert verdict.passed, verdict.detail
        for listener in (path_listener, abstract_listener):
            with pytest.raises(BlockingIOError):
                listener.accept()
    finally:
        path_listener.close()
        abstract_listener.close()
        shutil.rmtree(directory, ignore_errors=True)


def test_io_uring_and_other_abis_are_refused(sandbox):
    """io_uring makes and connects sockets without socket(); a 32-bit or x32 system call is another
    table of numbers that the filter's socket() rule would not match."""
    verdict = _run(sandbox, """
        import ctypes, errno, platform
        libc = ctypes.CDLL(None, use_errno=True)
        params = ctypes.create_string_buffer(120)
        assert libc.syscall(425, 8, params) == -1 and ctypes.get_errno() == errno.ENOSYS  # io_uring_setup
        if platform.machine() == "x86_64":
            assert libc.syscall(0x40000000 | 41, 1, 1, 0) == -1 and ctypes.get_errno() == errno.ENOSYS
    """)
    assert verdict.passed, verdict.detail


def test_a_machine_without_a_system_call_filter_gets_no_sandbox(monkeypatch):
    """Without the filter the host's sockets would be reachable: "unavailable", never a silent run."""
    from tessera.eval import sandbox_init

    assert sandbox_init._filter_program()[-1][3] & 0xFFFF == errno.ENOSYS
    monkeypatch.setattr(sandbox_init.platform, "machine", lambda: "mips")
    with pytest.raises(OSError, match="no system-call filter"):
        sandbox_init._filter_program()


def test_memory_is_limited(sandbox):
    verdict = _run(sandbox, """
        block = None
        try:
            block = bytearray(8 << 30)
        except MemoryError:
            pass
        assert block is None
    """)
    assert verdict.passed, verdict.detail


def test_an_infinite_loop_is_stopped_by_the_time_limit():
    name, program = _named("import os\nassert os.fork() >= 0\nwhile True:\n    pass\n")
    verdict = Sandbox(SandboxLimits(timeout_s=1)).run(program)
    assert verdict.status == "timed out" and not verdict.passed
    assert _runner_processes(name) == []


def test_a_fork_bomb_is_bounded_and_leaves_nothing_behind(sandbox):
    name, program = _named("""
        import os, time
        if os.fork() == 0:  # one that leaves the session, to outlive the run
            os.setsid()
            time.sleep(1000)
            os._exit(0)
        children = 0
        while True:
            try:
                pid = os.fork()
            except OSError:
                break
            if pid == 0:
                time.sleep(1000)  # every child stays alive: only the process limit ends the loop
                os._exit(0)
            children += 1
        assert 0 < children < 16, children
    """)
    verdict = sandbox.run(program)
    assert verdict.passed, verdict.detail
    assert _runner_processes(name) == []  # its pid namespace ended with it: the sleepers and the detached one


def test_an_endless_fork_bomb_times_out_and_leaves_nothing_behind():
    name, program = _named("""
        import os
        while True:
            try:
                os.fork()
            except OSError:
                pass
    """)
    verdict = Sandbox(SandboxLimits(timeout_s=2, processes=16)).run(program)
    assert verdict.status in ("timed out", "failed") and not verdict.passed
    assert _runner_processes(name) == []


def test_no_capability_no_remount_and_only_its_own_processes(sandbox):
    verdict = _run(sandbox, """
        import os, subprocess
        status = open("/proc/self/status").read()
        assert "CapEff:\\t0000000000000000" in status and "CapBnd:\\t0000000000000000" in status
        remount = subprocess.run(["mount", "-o", "remount,rw", "/"], capture_output=True)
        assert remount.returncode != 0
        pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
        assert max(pids) < 16, pids  # a fresh pid namespace: the machine's processes are not there
        try:
            os.kill(-1, 9)  # every process it can signal: its own, none outside
        except ProcessLookupError:
            pass
    """)
    assert verdict.passed, verdict.detail


@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs util-linux unshare")
def test_without_user_namespaces_it_refuses_unless_allowed(tmp_path):
    """In a user namespace whose max_user_namespaces is 0 no further one can be made: the sandbox
    cannot isolate there, refuses, and with allow_unsandboxed runs with limits only."""
    script = tmp_path / "probe.py"
    script.write_text(textwrap.dedent("""
        from tessera.config.errors import EvaluationError
        from tessera.eval.sandbox import Sandbox
        try:
            Sandbox().run("pass")
            print("ran")
        except EvaluationError as e:
            print("refused:", e)
        print("allowed:", Sandbox(allow_unsandboxed=True).run("assert 1 + 1 == 2").status)
    """))
    probe = subprocess.run(["unshare", "--user", "--map-root-user", "sh", "-c",
                            f"echo 0 > /proc/sys/user/max_user_namespaces && {sys.executable} {script}"],
                           capture_output=True, text=True, cwd=ROOT, timeout=HANG_S,
                           env={**os.environ, "PYTHONPATH": str(ROOT)})
    if probe.returncode != 0 and "max_user_namespaces" in probe.stderr:
        pytest.skip(f"cannot make a user namespace without user namespaces here: {probe.stderr.strip()}")
    assert "refused:" in probe.stdout and "--allow-unsandboxed-code" in probe.stdout, probe.stdout + probe.stderr
    assert "allowed: passed" in probe.stdout, probe.stdout + probe.stderr


@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs util-linux unshare")
def test_tessera_eval_refuses_humaneval_before_loading_a_model_without_a_sandbox(tmp_path):
    cli = subprocess.run(["unshare", "--user", "--map-root-user", "sh", "-c",
                          "echo 0 > /proc/sys/user/max_user_namespaces && "
                          f"{sys.executable} -m tessera eval {tmp_path / 'no-model'} --tasks humaneval"],
                         capture_output=True, text=True, cwd=ROOT, timeout=HANG_S,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    if "max_user_namespaces" in cli.stderr and "tessera eval" not in cli.stderr:
        pytest.skip(f"cannot make a user namespace without user namespaces here: {cli.stderr.strip()}")
    assert cli.returncode == 1, cli.stderr
    lines = cli.stderr.strip().splitlines()
    assert lines[-1].startswith("tessera eval: error: cannot sandbox generated code here")
    assert "--allow-unsandboxed-code" in lines[-1]


def test_the_scratch_tmpfs_never_hides_the_interpreter(monkeypatch):
    """A checkout under /tmp keeps its virtual environment there; a tmpfs on /tmp would hide the
    program's own interpreter, and every program would fail without a word."""
    from tessera.eval import sandbox_init

    assert sandbox_init.scratch_point() == "/tmp" or sys.executable.startswith("/tmp/")
    monkeypatch.setattr(sandbox_init.sys, "executable", "/tmp/ci/main/.venv/bin/python")
    monkeypatch.setattr(sandbox_init.sys, "prefix", "/tmp/ci/main/.venv")
    point = sandbox_init.scratch_point()
    assert point != "/tmp" and point in sandbox_init.SCRATCH_POINTS
    monkeypatch.setattr(sandbox_init, "SCRATCH_POINTS", ("/tmp",))
    with pytest.raises(OSError, match="holds the interpreter"):
        sandbox_init.scratch_point()

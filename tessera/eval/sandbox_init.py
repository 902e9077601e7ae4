"""The sandbox's first process: run one untrusted Python program under namespaces and limits.

Run as `python -I -S sandbox_init.py` by `tessera.eval.sandbox` (a fresh, single-threaded
interpreter: unshare(CLONE_NEWUSER) refuses a process with threads). It reads one JSON request on
stdin, `{"program", "timeout_s", "memory_bytes", "file_bytes", "open_files", "processes",
"scratch_bytes", "isolate"}`, and writes one JSON verdict line on stdout, `{"status": "passed" |
"failed" | "timed out" | "unavailable", "detail": ...}`. It imports nothing from Tessera, so it
starts in milliseconds.

With `isolate` (the default) this process first bounds the number of processes of the run: a user
other than root gets RLIMIT_NPROC below, which binds in the user namespace; root, whom the kernel
exempts from RLIMIT_NPROC whatever the namespace, gets a pids cgroup of its own (cgroup v1's pids
hierarchy, or v2 where the pids controller is enabled), which this process and all it starts join;
without one, root gets "unavailable". It then forks a child that unshares a user, mount, network,
pid, IPC and UTS namespace and forks the new pid namespace's init (pid 1), which

1. makes every mount private and remounts each one read-only (keeping its locked nosuid / nodev /
   noexec / atime flags), then mounts a fresh /proc (only the namespace's processes) and a tmpfs
   of `scratch_bytes` on /tmp (or, where the interpreter lives under /tmp, the first of /var/tmp,
   /dev/shm, /mnt that holds none of it), the program's working directory: the only place it can write,
   and installs a system-call filter (seccomp: no socket but AF_INET / AF_INET6, no io_uring, no
   other ABI) that it and everything it starts inherit;
2. forks the program (pid 2) with rlimits (CPU seconds, address space, file size, open files,
   processes, no core dumps), its capabilities in the namespace dropped for good (securebits
   NOROOT, empty bounding set, no_new_privs), so that it cannot undo a mount, and stdin / stdout /
   stderr on /dev/null and a file in the tmpfs;
3. waits at most `timeout_s` of wall-clock time, then exits: the kernel kills every process of a pid
   namespace whose init exits, however many the program forked or detached.

This process stays outside the namespaces; it is the subreaper of what they leave, reaps it, and
removes the cgroup. The network namespace has only a loopback interface, down: nothing can be
reached. If this process is killed (the caller's own deadline), the namespaces' maker and then
pid 1 get SIGKILL (PR_SET_PDEATHSIG) and the namespace goes with it; the caller removes the cgroup
(`release_cgroup(cgroup_path(pid), leave=False)`). Where the sandbox cannot be made the verdict is
"unavailable", and the caller decides; with `isolate` false the program runs with the rlimits and
the wall-clock limit only, in a temporary directory, with the caller's file system and network
(what `--allow-unsandboxed-code` accepts).

The program passes when its source returns normally (the runner then says so on a pipe and exits
0); an exception, `sys.exit`, an exit of its process (`os._exit`), a signal (RLIMIT_CPU's SIGXCPU)
or the wall clock fails it. A program written to fake a pass could write on that pipe itself: the
sandbox contains code, it does not certify an adversary's score.
"""

import ctypes
import errno
import json
import os
import platform
import resource
import shutil
import signal
import sys
import tempfile
import time

CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
MS_NOATIME, MS_NODIRATIME, MS_BIND, MS_REC, MS_PRIVATE = 1024, 2048, 4096, 16384, 1 << 18
MS_RELATIME, MS_STRICTATIME = 1 << 21, 1 << 24
MOUNT_FLAGS = {"nosuid": MS_NOSUID, "nodev": MS_NODEV, "noexec": MS_NOEXEC, "noatime": MS_NOATIME,
               "nodiratime": MS_NODIRATIME, "relatime": MS_RELATIME, "strictatime": MS_STRICTATIME}
PR_SET_PDEATHSIG, PR_CAPBSET_DROP, PR_SET_SECUREBITS, PR_SET_NO_NEW_PRIVS = 1, 24, 28, 38
PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL = 47, 4
PR_SET_CHILD_SUBREAPER = 36
PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 22, 2
# The system-call filter of the namespace (seccomp, inherited by every process it starts). socket() is
# allowed for AF_INET and AF_INET6 only, which the namespace's network (a loopback, down) contains; any
# other family fails with EAFNOSUPPORT: AF_UNIX above all, since the read-only view of the file system
# still shows the host's path sockets and connect() needs no write to a file system, and AF_VSOCK,
# AF_NETLINK and the rest, which no network namespace contains. io_uring (it makes and connects sockets
# without socket()) and every system call of another ABI (x32, 32-bit compat: socketcall) fail with
# ENOSYS. socketpair() stays: its two ends reach nothing else. Per machine: (AUDIT_ARCH, socket,
# io_uring_setup); on another machine there is no filter, and so no sandbox ("unavailable").
SECCOMP_ARCHES = {"x86_64": (0xC000003E, 41, 425), "aarch64": (0xC00000B7, 198, 425)}
SOCKET_FAMILIES = (2, 10)  # AF_INET, AF_INET6
X32_SYSCALL_BIT = 0x40000000
# SECBIT_NOROOT (+ locked): execve gives uid 0 no capabilities; NO_SETUID_FIXUP and KEEP_CAPS locked
SECUREBITS = 0x01 | 0x02 | 0x04 | 0x08 | 0x20
LINUX_CAPABILITY_VERSION_3 = 0x20080522
# Where the scratch tmpfs is mounted: the first of these directories that exists and holds none of
# the interpreter's files (a checkout under /tmp keeps its virtual environment there, which a tmpfs on
# /tmp would hide from the program's own interpreter)
SCRATCH_POINTS = ("/tmp", "/var/tmp", "/dev/shm", "/mnt")
CGROUP_ROOT = "/sys/fs/cgroup"
CGROUP_V1_PIDS = "/sys/fs/cgroup/pids"
CGROUP_PREFIX = "tessera-sandbox-"  # + the pid of the process that made it
# The program's interpreter: exec of the source in a fresh namespace (as the reference harness
# does); when it returns normally, DONE on descriptor 3 (a pipe to pid 1) and exit status 0. An exit
# of the process from inside the program (os._exit(0), a signal) never writes DONE.
DONE = b"returned\n"
RUNNER = ("import sys, traceback, os\n"
          "src = open(sys.argv[1], encoding='utf-8').read()\n"
          "try:\n"
          "    exec(compile(src, 'program.py', 'exec'), {})\n"
          "except BaseException:\n"
          "    traceback.print_exc(limit=3)\n"
          "    sys.stderr.flush()\n"
          "    os._exit(1)\n"
          f"os.write(3, {DONE!r})\n"
          "os._exit(0)\n")

libc = ctypes.CDLL(None, use_errno=True)


def _check(result: int, what: str) -> None:
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _emit(status: str, detail: str = "") -> None:
    os.write(1, (json.dumps({"status": status, "detail": detail[-2000:]}) + "\n").encode())


def _enter_namespaces() -> None:
    """A user namespace in which this process is root (uid and gid 0 mapped to ours), and new mount,
    network, pid, IPC and UTS namespaces owned by it."""
    uid, gid = os.getuid(), os.getgid()
    _check(libc.unshare(CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWPID | CLONE_NEWIPC | CLONE_NEWUTS),
           "unshare")
    with open("/proc/self/setgroups", "w") as f:
        f.write("deny")
    with open("/proc/self/uid_map", "w") as f:
        f.write(f"0 {uid} 1")
    with open("/proc/self/gid_map", "w") as f:
        f.write(f"0 {gid} 1")


def _mount(source, target: str, fstype, flags: int, data) -> None:
    def enc(text):
        return None if text is None else text.encode()

    _check(libc.mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)), f"mount {target}")


def _unescape(path: str) -> str:
    """Mount points in /proc/self/mountinfo escape space, tab, newline and backslash as octal."""
    out, i = [], 0
    while i < len(path):
        if path[i] == "\\" and i + 4 <= len(path) and path[i + 1:i + 4].isdigit():
            out.append(chr(int(path[i + 1:i + 4], 8)))
            i += 4
        else:
            out.append(path[i])
            i += 1
    return "".join(out)


def _mounts() -> list[tuple[str, set[str]]]:
    """(mount point, per-mount options) of every mount, in mount order."""
    out = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            out.append((_unescape(fields[4]), set(fields[5].split(","))))
    return out


def scratch_point() -> str:
    """The directory the scratch tmpfs covers: the first of SCRATCH_POINTS that exists and does not
    hold the interpreter, its environment or its standard library."""
    needed = {os.path.realpath(p) for p in (sys.executable, sys.prefix, sys.base_prefix, sys.exec_prefix)}
    needed.add(os.path.abspath(sys.executable))
    for point in SCRATCH_POINTS:
        inside = [p for p in needed if p == point or p.startswith(point + os.sep)]
        if os.path.isdir(point) and not os.path.islink(point) and not inside:
            return point
    raise OSError(f"no directory for the scratch tmpfs: each of {', '.join(SCRATCH_POINTS)} is missing or holds "
                  f"the interpreter ({sys.executable})")


def _read_only_world(scratch: str, scratch_bytes: int) -> None:
    """Every mount private and read-only; a fresh /proc; a tmpfs on `scratch`. A mount that stays
    writable stops the run (the caller gets "unavailable", never an unconfined program)."""
    _mount(None, "/", None, MS_REC | MS_PRIVATE, None)
    for point, options in _mounts():
        if "ro" in options:
            continue
        keep = sum(flag for name, flag in MOUNT_FLAGS.items() if name in options)
        try:
            _mount(None, point, None, MS_REMOUNT | MS_BIND | MS_RDONLY | keep, None)
        except OSError:
            pass  # hidden under another mount (unreachable) or gone; checked below
    top = dict(_mounts())  # a later mount on the same point hides the earlier one entirely
    writable = [p for p, options in top.items() if "ro" not in options]
    if writable:
        raise OSError(f"mounts still writable in the sandbox: {writable[:5]}")
    _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, None)
    _mount("tmpfs", scratch, "tmpfs", MS_NOSUID | MS_NODEV, f"size={scratch_bytes},mode=0700")


class SockFprog(ctypes.Structure):
    """struct sock_fprog: a filter's length and its instructions."""

    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def _filter_program() -> list[tuple[int, int, int, int]]:
    """The classic-BPF filter (code, jt, jf, k) over struct seccomp_data (nr at 0, arch at 4, args[0]
    at 16) that SECCOMP_ARCHES describes. Raises OSError on a machine it does not know."""
    machine = platform.machine()
    if machine not in SECCOMP_ARCHES or sys.byteorder != "little":
        raise OSError(f"no system-call filter for this machine ({machine}): generated code could reach the "
                      "host's Unix-domain sockets")
    arch, socket_nr, io_uring_nr = SECCOMP_ARCHES[machine]
    load, jeq, jge, ret = 0x20, 0x15, 0x35, 0x06  # BPF_LD|W|ABS, BPF_JMP|JEQ|K, BPF_JMP|JGE|K, BPF_RET|K
    allow, deny = 0x7FFF0000, 0x00050000  # SECCOMP_RET_ALLOW, SECCOMP_RET_ERRNO | errno
    return [(load, 0, 0, 4), (jeq, 0, 9, arch),  # another ABI: ENOSYS (the last instruction)
            (load, 0, 0, 0), (jge, 7, 0, X32_SYSCALL_BIT), (jeq, 6, 0, io_uring_nr),
            (jeq, 0, 4, socket_nr),  # not socket(): allowed
            (load, 0, 0, 16), (jeq, 2, 0, SOCKET_FAMILIES[0]), (jeq, 1, 0, SOCKET_FAMILIES[1]),
            (ret, 0, 0, deny | errno.EAFNOSUPPORT), (ret, 0, 0, allow), (ret, 0, 0, deny | errno.ENOSYS)]


def _filter_system_calls() -> None:
    """Install the filter on this process (pid 1), so that everything it starts inherits it."""
    program = _filter_program()
    filters = (ctypes.c_uint64 * len(program))(*(code | jt << 16 | jf << 24 | k << 32 for code, jt, jf, k in program))
    fprog = SockFprog(len(program), ctypes.addressof(filters))
    _check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")
    _check(libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(fprog), 0, 0), "seccomp filter")


def _limit(request: dict) -> None:
    """The program's rlimits (set in pid 2, inherited by whatever it starts)."""
    cpu = max(1, int(request["timeout_s"] + 0.999))
    for which, value in ((resource.RLIMIT_CPU, cpu), (resource.RLIMIT_AS, request["memory_bytes"]),
                         (resource.RLIMIT_FSIZE, request["file_bytes"]),
                         (resource.RLIMIT_NOFILE, request["open_files"]),
                         (resource.RLIMIT_NPROC, request["processes"]), (resource.RLIMIT_CORE, 0)):
        resource.setrlimit(which, (value, value))


def _drop_capabilities() -> None:
    """No capability, now or after execve, in the user namespace (root there could remount)."""
    _check(libc.prctl(PR_SET_SECUREBITS, SECUREBITS, 0, 0, 0), "securebits")
    cap = 0
    while libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) == 0:
        cap += 1
    libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)
    _check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")
    header = (ctypes.c_uint32 * 2)(LINUX_CAPABILITY_VERSION_3, 0)
    data = (ctypes.c_uint32 * 6)()
    _check(libc.capset(header, data), "capset")


def _exec_program(request: dict, workdir: str, isolate: bool, done_fd: int) -> None:
    """In the forked child: limits, no capabilities, the program's files, then its interpreter."""
    try:
        if not isolate:
            os.setsid()
        _limit(request)
        if isolate:
            _drop_capabilities()
        null = os.open("/dev/null", os.O_RDWR)
        err = os.open(os.path.join(workdir, ".stderr"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(null, 0)
        os.dup2(null, 1)
        os.dup2(err, 2)
        os.dup2(done_fd, 3)
        os.closerange(4, 65536)
        os.chdir(workdir)
        env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": workdir, "TMPDIR": workdir}
        os.execve(sys.executable, [sys.executable, "-I", "-c", RUNNER, os.path.join(workdir, "program.py")], env)
    finally:
        os._exit(127)


def _wait(pid: int, timeout_s: float) -> tuple[str, int | None]:
    """("exited", status) or ("timed out", None) within `timeout_s` of wall-clock time."""
    deadline = time.monotonic() + timeout_s
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return "exited", status
        left = deadline - time.monotonic()
        if left <= 0:
            return "timed out", None
        time.sleep(min(0.01, left))


def _stderr_tail(workdir: str) -> str:
    try:
        with open(os.path.join(workdir, ".stderr"), "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 2000))
            return f.read().decode("utf-8", "replace")
    except OSError:
        return ""


def _verdict(how: str, status: int | None, done: bytes, workdir: str) -> None:
    if how == "timed out":
        _emit("timed out", "wall-clock limit reached")
    elif os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0 and done == DONE:
        _emit("passed")
    elif os.WIFSIGNALED(status):
        _emit("failed", f"killed by {signal.Signals(os.WTERMSIG(status)).name}\n" + _stderr_tail(workdir))
    elif os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0:
        _emit("failed", "the program ended its process before its tests returned")
    else:
        _emit("failed", _stderr_tail(workdir))


def _run_program(request: dict, workdir: str, isolate: bool) -> None:
    """Write the program, fork it, wait for it, emit the verdict."""
    with open(os.path.join(workdir, "program.py"), "w", encoding="utf-8") as f:
        f.write(request["program"])
    done_r, done_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        _exec_program(request, workdir, isolate, done_w)
    os.close(done_w)
    how, status = _wait(pid, request["timeout_s"])
    if how == "timed out" and not isolate:
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        os.waitpid(pid, 0)
    os.set_blocking(done_r, False)  # what the program wrote; its children may still hold the pipe open
    try:
        done = os.read(done_r, 64)
    except BlockingIOError:
        done = b""
    _verdict(how, status, done, workdir)


def _namespace_init(request: dict) -> None:
    """Pid 1 of the new pid namespace: the read-only world, then the program. Its exit ends them all."""
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    try:
        scratch = scratch_point()
        _read_only_world(scratch, request["scratch_bytes"])
        _filter_system_calls()
    except OSError as e:
        _emit("unavailable", str(e))
        os._exit(0)
    _run_program(request, scratch, isolate=True)
    os._exit(0)


def _pids_cgroup_dir() -> str | None:
    """This process's cgroup directory in a hierarchy with the pids controller: cgroup v1's pids
    hierarchy, or cgroup v2 where the pids controller is enabled for children; None: neither."""
    with open("/proc/self/cgroup") as f:
        entries = [line.rstrip("\n").split(":", 2) for line in f]
    for _, controllers, path in entries:
        if "pids" in controllers.split(",") and os.path.isdir(f"{CGROUP_V1_PIDS}{path}"):
            return f"{CGROUP_V1_PIDS}{path}".rstrip("/")
    for _, controllers, path in entries:
        v2 = f"{CGROUP_ROOT}{path}".rstrip("/")
        try:
            with open(f"{v2}/cgroup.subtree_control") as f:
                if controllers == "" and "pids" in f.read().split():
                    return v2
        except OSError:
            continue
    return None


def cgroup_path(owner_pid: int) -> str | None:
    """The pids cgroup a sandbox started by process `owner_pid` runs in (None: no pids hierarchy)."""
    parent = _pids_cgroup_dir()
    return None if parent is None else f"{parent}/{CGROUP_PREFIX}{owner_pid}"


def _bound_processes(request: dict) -> str | None:
    """Bound how many processes the run may have, however they are made. RLIMIT_NPROC does that for
    any user but root (uid 0 outside the namespace), whom the kernel exempts; for root a pids cgroup
    of its own holds this process and everything it starts (the limit plus this process and pid 1).
    Returns the cgroup made (None: none needed); raises OSError when root has no pids cgroup."""
    if os.geteuid() != 0:
        return None
    path = cgroup_path(os.getpid())
    if path is None:
        raise OSError("running as root, where RLIMIT_NPROC does not bind, and no pids cgroup is available to "
                      "bound the processes of generated code")
    os.mkdir(path)
    with open(f"{path}/pids.max", "w") as f:
        f.write(str(request["processes"] + 2))
    with open(f"{path}/cgroup.procs", "w") as f:
        f.write(str(os.getpid()))
    return path


def release_cgroup(path: str | None, leave: bool = True) -> None:
    """Leave the run's pids cgroup (`leave`: this process is in it) and remove it once its processes
    are gone."""
    if path is None or not os.path.isdir(path):
        return
    if leave:
        with open(f"{os.path.dirname(path)}/cgroup.procs", "w") as f:
            f.write(str(os.getpid()))
    deadline = time.monotonic() + 5.0  # the processes of a killed namespace are released within moments
    while True:
        try:
            os.rmdir(path)
            return
        except FileNotFoundError:
            return
        except OSError:
            if time.monotonic() > deadline:
                return
            time.sleep(0.01)


def _namespaces_then_init(request: dict) -> None:
    """The forked child that makes the namespaces (this process stays outside them: in a mount
    namespace of its own it would see the read-only world and could not remove the cgroup), then
    forks their pid 1 and waits for it."""
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    try:
        _enter_namespaces()
    except OSError as e:
        _emit("unavailable", f"no sandbox here: user namespaces are not available ({e})")
        os._exit(0)
    pid = os.fork()
    if pid == 0:
        _namespace_init(request)
    os.waitpid(pid, 0)
    os._exit(0)


def _reap_all() -> None:
    while True:
        try:
            os.waitpid(-1, 0)
        except ChildProcessError:
            return


def main() -> None:
    request = json.loads(sys.stdin.read())
    if not request.get("isolate", True):
        workdir = tempfile.mkdtemp(prefix="tessera-sandbox-")
        try:
            _run_program(request, workdir, isolate=False)
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
        return
    try:
        cgroup = _bound_processes(request)
    except OSError as e:
        _emit("unavailable", f"no sandbox here: {e}")
        return
    try:
        # the namespace's processes, killed when its pid 1 exits, are reparented here and reaped below,
        # so that none is left in the cgroup (or as a zombie) when this process returns
        libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
        if os.fork() == 0:
            _namespaces_then_init(request)
        _reap_all()
    finally:
        release_cgroup(cgroup)


if __name__ == "__main__":
    main()

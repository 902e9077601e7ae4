"""Running generated code: each program in its own sandboxed process, with limits.

    sandbox = Sandbox(SandboxLimits(timeout_s=10))
    verdict = sandbox.run(problem["prompt"] + completion + "\\n" + problem["test"] + ...)
    verdict.passed, verdict.status, verdict.detail

A program is untrusted: code a model wrote. `sandbox_init.py` runs it in a fresh interpreter inside
new user, mount, network and pid namespaces: every mount read-only, a size-limited tmpfs as its
working directory (the only place it can write), no network interface up, no capability left, a
system-call filter that opens sockets of the inet families only (a Unix-domain socket of the host
shows through the read-only file system, and vsock or netlink reach past any network namespace), and
rlimits on CPU time, address space, file size, open files and processes (the process limit binds
inside a user namespace, so a fork bomb stops there); a wall-clock limit ends its pid namespace,
which kills every process it started. So it cannot touch the caller's files, reach the network or
the host's local services, exhaust the machine's processes or outlive its time. It can read what
the caller can read; nothing it reads can leave except its pass/fail verdict and the tail of its
stderr.

Where user namespaces are unavailable (a container that forbids them, a kernel built without
them), `Sandbox` refuses with `EvaluationError` unless it was made with `allow_unsandboxed=True`
(`tessera eval --allow-unsandboxed-code`): the program then runs with the same rlimits and time
limit in a temporary directory, but with the caller's file system and network, and a process that
leaves its session can outlive it.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from tessera.config.errors import ConfigError, EvaluationError
from tessera.eval.sandbox_init import cgroup_path, release_cgroup

log = logging.getLogger("tessera.eval")

INIT = Path(__file__).with_name("sandbox_init.py")
# Time the sandbox's own start-up may take beyond the program's limit (an interpreter on a loaded
# machine) before the caller kills it: a hang guard, not a speed assumption.
START_GRACE_S = 60.0
UNSANDBOXED_FLAG = "--allow-unsandboxed-code"


@dataclass(frozen=True)
class SandboxLimits:
    """What one program may use. The defaults fit HumanEval's tests (each well under a second and a
    few MiB) with room for a slow machine."""

    timeout_s: float = 10.0  # wall-clock seconds (CPU seconds too: RLIMIT_CPU)
    memory_mib: int = 1024  # address space (RLIMIT_AS): an interpreter needs ~100 MiB of it
    file_mib: int = 16  # largest file it may write (RLIMIT_FSIZE)
    scratch_mib: int = 16  # size of its tmpfs working directory
    open_files: int = 64  # RLIMIT_NOFILE
    processes: int = 32  # processes and threads of its user (RLIMIT_NPROC, binding in its namespace)

    def __post_init__(self) -> None:
        for key, value, low in (("timeout_s", self.timeout_s, 0.1), ("memory_mib", self.memory_mib, 64),
                                ("file_mib", self.file_mib, 1), ("scratch_mib", self.scratch_mib, 1),
                                ("open_files", self.open_files, 16), ("processes", self.processes, 1)):
            if not value >= low:
                raise ConfigError(f"sandbox {key}={value!r} is invalid: must be >= {low}")


@dataclass(frozen=True)
class Verdict:
    status: str  # "passed", "failed" or "timed out"
    detail: str = ""  # why it failed: the tail of its stderr, a signal, the time limit

    @property
    def passed(self) -> bool:
        return self.status == "passed"


class Sandbox:
    """Runs programs one per call (thread-safe: each call is its own process tree)."""

    def __init__(self, limits: SandboxLimits | None = None, allow_unsandboxed: bool = False):
        self.limits = limits or SandboxLimits()
        self.allow_unsandboxed = allow_unsandboxed
        self.isolated = True  # False once namespaces proved unavailable and unsandboxed runs were allowed

    def check(self) -> None:
        """Run a trivial program once: raise EvaluationError now, before any model is loaded or
        generates, when the sandbox is unavailable and unsandboxed runs are not allowed."""
        verdict = self.run("pass\n")
        if not verdict.passed:
            raise EvaluationError(f"the code sandbox does not run a trivial program: {verdict.status}: "
                                  f"{verdict.detail.strip()[-300:]}")

    def run(self, program: str) -> Verdict:
        """Run `program` (Python source) under the limits; its verdict."""
        raw = self._launch(program, self.isolated)
        if raw["status"] == "unavailable" and self.isolated:
            if not self.allow_unsandboxed:
                raise EvaluationError(f"cannot sandbox generated code here: {raw['detail']}. Refusing to run it "
                                      f"unconfined; pass {UNSANDBOXED_FLAG} to run it with resource limits only "
                                      "(it can then read and write your files and reach the network)")
            log.warning("no sandbox (%s): running generated code with resource limits only", raw["detail"])
            self.isolated = False
            raw = self._launch(program, False)
        return Verdict(raw["status"], raw.get("detail", ""))

    def _launch(self, program: str, isolate: bool) -> dict:
        lim = self.limits
        request = {"program": program, "timeout_s": lim.timeout_s, "memory_bytes": lim.memory_mib << 20,
                   "file_bytes": lim.file_mib << 20, "scratch_bytes": lim.scratch_mib << 20,
                   "open_files": lim.open_files, "processes": lim.processes, "isolate": isolate}
        proc = subprocess.Popen([sys.executable, "-I", "-S", str(INIT)], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
        try:
            out, err = proc.communicate(json.dumps(request).encode(), timeout=lim.timeout_s + START_GRACE_S)
        except subprocess.TimeoutExpired:
            proc.kill()  # pid 1 of its namespace dies with it (PR_SET_PDEATHSIG), and with pid 1 the rest
            proc.communicate()
            release_cgroup(cgroup_path(proc.pid), leave=False)
            return {"status": "timed out", "detail": "the sandbox did not answer within its time limit"}
        lines = out.decode("utf-8", "replace").strip().splitlines()
        try:
            return json.loads(lines[-1])
        except (IndexError, ValueError):
            return {"status": "unavailable" if isolate else "failed",
                    "detail": f"sandbox start-up failed (exit status {proc.returncode}): "
                              f"{err.decode('utf-8', 'replace')[-500:]}"}

"""Run model-written Python plus unit tests in a sandboxed subprocess (the ``code`` verifier).

NOT A SECURITY BOUNDARY. This keeps honest-but-buggy code (infinite loops, memory hogs,
accidental fork bombs, stray writes, network calls) from hurting a training run or a CI
machine. It does not stop hostile code written to escape it. Production code rewards belong
in NeMo-RL's code environment, SandboxFusion, or a container/VM per execution.

Each run:

* a fresh ``python -I -B`` interpreter (isolated mode: no env vars, no user site, no script
  dir on ``sys.path``) in a throwaway temp working directory, deleted afterwards;
* a scrubbed environment (``PATH``, ``LANG``, ``HOME``/``TMPDIR`` = the work dir);
* ``resource`` limits set in ``preexec_fn``: ``RLIMIT_CPU``, ``RLIMIT_AS``, ``RLIMIT_NPROC``,
  ``RLIMIT_FSIZE``, ``RLIMIT_NOFILE``, ``RLIMIT_CORE=0``;
* when the parent is root: privileges dropped to an unprivileged uid, because the kernel does
  not enforce ``RLIMIT_NPROC`` for root (fork bombs would be uncontained), and so file
  permissions protect the rest of the machine;
* no network: a new network namespace (``unshare(CLONE_NEWNET)``; only a down loopback
  inside) when the kernel allows it, else an audit hook that blocks ``socket.connect``/
  ``bind``/``sendto``/name lookups. :attr:`SandboxResult.network_isolation` says which;
* writes confined to the work dir by the kernel where it has Landlock (Linux >= 5.13;
  :mod:`alignpipe.rewards.landlock`): every open-for-write, mkdir, unlink, rename, link or
  truncate outside it fails with EACCES, whoever asks (C libraries such as sqlite3 or dbm, a
  process started behind the audit hook, a ``dir_fd`` trick), in every child and after ``exec``.
  :attr:`SandboxResult.filesystem_isolation` says whether it applied;
* an audit hook that rejects opening files for writing (and remove/rename/mkdir/chmod/...)
  outside the work dir, and any ``exec``/``subprocess``/``os.system``/``ctypes`` use, so an
  attempt scores 0 even when the program swallows the error. Without Landlock it is the only
  guard, and it sees Python-level opens only: it then also refuses modules that open paths in
  C (``sqlite3``, ``dbm.gnu``/``dbm.ndbm``, ``readline``) and directory handles outside the
  work dir (``dir_fd``). ``_posixsubprocess.fork_exec`` (under ``subprocess`` and
  ``multiprocessing.util.spawnv_passfds``) raises no audit event, so it is replaced by a refusal;
* a wall-clock timeout that kills the whole process group, then any straggler that carries
  the run's token in its environment (escaped with ``setsid``);
* stdout/stderr read up to a cap (the rest is drained and dropped).

``score`` is 1.0 only if the code and all tests ran to the end with no exception and no
sandbox violation.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import os
import re
import resource
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any

from alignpipe.rewards.landlock import WriteConfinement, abi_version

__all__ = [
    "SandboxLimits",
    "SandboxResult",
    "extract_code",
    "filesystem_isolation_mode",
    "network_isolation_mode",
    "run_code",
    "score_code",
    "score_code_batch",
]

# SandboxLimits fields a data row may override (see SandboxLimits.from_row).
ROW_LIMITS = ("timeout_s", "cpu_s", "memory_mb", "nproc", "fsize_mb", "nofile", "output_bytes")
REASONS = ("ok", "failed", "error", "timeout", "memory", "killed", "network", "fs", "forbidden")


@dataclass(frozen=True)
class SandboxLimits:
    """Limits for one run. Defaults suit unit-test-sized programs."""

    timeout_s: float = 10.0  # wall clock, whole process group killed after it
    cpu_s: int = 10  # RLIMIT_CPU (per process)
    memory_mb: int = 1024  # RLIMIT_AS (virtual address space)
    nproc: int = 32  # RLIMIT_NPROC (processes of the sandbox uid)
    fsize_mb: int = 16  # RLIMIT_FSIZE (largest file it can write)
    nofile: int = 64  # RLIMIT_NOFILE
    output_bytes: int = 64 * 1024  # stdout and stderr each, read at most this much
    network: str = "auto"  # "auto" (netns if possible), "netns", or "audit"
    filesystem: str = "auto"  # "auto" (Landlock if possible), "landlock", or "audit"
    drop_privileges: bool = True  # when root: run as an unprivileged uid

    @classmethod
    def from_row(cls, row: dict, base: SandboxLimits | None = None) -> SandboxLimits:
        """``base`` overridden by a row's optional ``sandbox: {timeout_s: ..., ...}`` dict.

        A row may set resource limits only: isolation (network, filesystem, privileges) is the
        caller's decision, never a dataset's.
        """
        base = base or cls()
        over = row.get("sandbox") or {}
        known = {k: v for k, v in over.items() if k in ROW_LIMITS}
        return replace(base, **known)


@dataclass
class SandboxResult:
    """Outcome of one run. ``reason`` is one of :data:`REASONS`."""

    passed: bool
    reason: str
    detail: str = ""
    stdout: str = ""
    stderr: str = ""
    returncode: int | None = None
    duration_s: float = 0.0
    network_isolation: str = ""  # "netns" or "audit-hook"
    filesystem_isolation: str = ""  # "landlock (ABI n)" or "audit-hook"
    run_as: str = ""  # "uid 61234" or "caller (uid N)"
    violations: list[str] = field(default_factory=list)

    @property
    def score(self) -> float:
        return 1.0 if self.passed else 0.0


# --------------------------------------------------------------------------- harness

# Runs inside the sandboxed interpreter. Reads solution.py and tests.py from the work dir,
# installs the audit hook, executes both, and writes one JSON status line to the status fd.
_HARNESS = r"""
import os, sys, json, signal
_status_fd = int(sys.argv[1])
_net_block = sys.argv[2] == "block"
# "kernel": Landlock refuses every write outside the work dir, whoever opens the path. "hook":
# this hook is all there is, and it sees Python-level opens only, so modules that open paths
# in C are refused.
_fs_kernel = sys.argv[4] == "kernel"
_C_OPENERS = {"_sqlite3", "_dbm", "_gdbm", "readline"}
if sys.argv[3] == "pidns":
    # We were started after unshare(CLONE_NEWPID): our first child is PID 1 of a fresh PID
    # namespace. It runs the code; when it dies the kernel kills and reaps everything left in
    # the namespace (no zombies or orphans outlive the run). We only wait and relay.
    _child = os.fork()
    if _child:
        os.close(_status_fd)
        while True:
            try:
                _, _st = os.waitpid(_child, 0)
                break
            except InterruptedError:
                continue
        if os.WIFSIGNALED(_st):
            _sig = os.WTERMSIG(_st)
            try:
                signal.signal(_sig, signal.SIG_DFL)
            except (OSError, ValueError):
                pass
            os.kill(os.getpid(), _sig)
        os._exit(os.WEXITSTATUS(_st) if os.WIFEXITED(_st) else 1)
_root = os.path.realpath(os.getcwd())
_pid = os.getpid()
_violations = []
_busy = [False]
_ALLOWED_WRITE = {"/dev/null"}
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC
_PATH_EVENTS = {
    "os.remove": (0,), "os.rmdir": (0,), "os.mkdir": (0,), "os.rename": (0, 1),
    "os.link": (0, 1), "os.symlink": (1,), "os.chmod": (0,), "os.chown": (0,),
    "os.truncate": (0,), "os.utime": (0,), "os.chflags": (0,), "os.lchown": (0,),
    "os.mkfifo": (0,), "os.mknod": (0,), "shutil.rmtree": (0,), "shutil.move": (0, 1),
    "shutil.copyfile": (1,), "shutil.copytree": (1,), "os.setxattr": (0,), "os.removexattr": (0,),
    "sqlite3.connect": (0,),
}
_NET_EVENTS = {"socket.connect", "socket.bind", "socket.sendto", "socket.sendmsg",
               "socket.getaddrinfo", "socket.gethostbyname", "socket.gethostbyaddr",
               "socket.gethostbyname_ex", "socket.getnameinfo"}
_PROC_EVENTS = {"os.exec", "os.posix_spawn", "os.spawn", "os.system", "subprocess.Popen",
                "os.startfile", "ctypes.dlopen", "ctypes.dlsym", "ctypes.dlsym/handle",
                "ctypes.cdata", "ctypes.call_function", "pty.spawn"}

class SandboxViolation(PermissionError):
    pass

def _outside(path):
    if isinstance(path, int) or path is None:
        return False
    try:
        p = os.fsdecode(path)
    except Exception:
        return True
    if p in _ALLOWED_WRITE:
        return False
    real = os.path.realpath(p)
    return not (real == _root or real.startswith(_root + os.sep))

def _violate(kind, what):
    _violations.append(kind + ": " + what)
    raise SandboxViolation("alignpipe sandbox: %s blocked (%s)" % (kind, what))

def _hook(event, args):
    if _busy[0]:
        return
    _busy[0] = True
    try:
        if event == "open":
            path, mode, flags = args
            writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
                isinstance(flags, int) and flags & _WRITE_FLAGS)
            if writing and _outside(path):
                _violate("fs", "write to %r" % (path,))
            if not _fs_kernel and _outside(path) and os.path.isdir(path):
                # a directory fd lets os.open(name, dir_fd=fd) write there unseen
                _violate("fs", "directory handle on %r" % (path,))
        elif event == "import" and not _fs_kernel and args[0] in _C_OPENERS:
            _violate("forbidden", "import %s (opens files in C; no Landlock here)" % args[0])
        elif event == "import" and args[0] == "_posixsubprocess":  # a fresh copy of fork_exec
            _violate("forbidden", "re-import of _posixsubprocess")
        elif event in _PATH_EVENTS:
            for i in _PATH_EVENTS[event]:
                if i < len(args) and _outside(args[i]):
                    _violate("fs", "%s %r" % (event, args[i]))
        elif event in _NET_EVENTS:
            if _net_block:
                _violate("network", event)
            _violations.append("network: " + event + " (attempted)")
        elif event in _PROC_EVENTS:
            _violate("forbidden", event)
    finally:
        _busy[0] = False

def _status(obj):
    data = (json.dumps(obj) + "\n").encode()
    try:
        os.write(_status_fd, data)
    except OSError:
        pass

def _main():
    with open("solution.py", encoding="utf-8") as f:
        solution = f.read()
    with open("tests.py", encoding="utf-8") as f:
        tests = f.read()
    # fork_exec (behind subprocess and multiprocessing.util.spawnv_passfds) raises no audit
    # event, so it is replaced before the hook goes in.
    import _posixsubprocess
    def _no_fork_exec(*args, **kwargs):
        _violate("forbidden", "_posixsubprocess.fork_exec")
    _posixsubprocess.fork_exec = _no_fork_exec
    sys.addaudithook(_hook)
    ns = {"__name__": "solution", "__builtins__": __builtins__}
    stage = "solution"
    try:
        exec(compile(solution, "solution.py", "exec"), ns)
        stage = "tests"
        exec(compile(tests, "tests.py", "exec"), ns)
    except BaseException as e:
        if os.getpid() != _pid:
            os._exit(1)
        _status({"done": False, "stage": stage, "exc_type": type(e).__name__,
                 "exc": str(e)[:2000], "violations": _violations[:20]})
        return 1
    if os.getpid() != _pid:
        os._exit(0)
    _status({"done": True, "stage": "tests", "violations": _violations[:20]})
    return 0

code = _main()
try:
    sys.stdout.flush(); sys.stderr.flush()
except Exception:
    pass
os._exit(code)
"""


# --------------------------------------------------------------------------- code extraction

_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[ \t]*\n(.*?)```", re.DOTALL)


def extract_code(completion: str) -> str:
    """The code in a completion: the last ```python (or unlabeled) fenced block, else all of it."""
    if completion is None:
        return ""
    blocks = _FENCE.findall(completion)
    py = [body for lang, body in blocks if lang.lower() in ("python", "py", "python3", "")]
    if py:
        return py[-1]
    if blocks:
        return blocks[-1][1]
    return completion


# --------------------------------------------------------------------------- isolation helpers

CLONE_NEWNET = 0x40000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
_LIBC = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_UNSHARE = getattr(_LIBC, "unshare", None)
_SANDBOX_UID_BASE = 61000
_SANDBOX_UID_SPAN = 4000
_probe_lock = threading.Lock()
_probe_cache: dict[str, Any] = {}


def _set_rlimits(limits: SandboxLimits, nproc: int) -> None:
    mem = limits.memory_mb * 1024 * 1024
    fsize = limits.fsize_mb * 1024 * 1024
    for res, val in (
        (resource.RLIMIT_CPU, (limits.cpu_s, limits.cpu_s + 1)),
        (resource.RLIMIT_AS, (mem, mem)),
        (resource.RLIMIT_FSIZE, (fsize, fsize)),
        (resource.RLIMIT_NOFILE, (limits.nofile, limits.nofile)),
        (resource.RLIMIT_NPROC, (nproc, nproc)),
        (resource.RLIMIT_CORE, (0, 0)),
    ):
        resource.setrlimit(res, val)


def _ns_flags(netns: bool, pidns: bool) -> int:
    flags = (CLONE_NEWNET if netns else 0) | (CLONE_NEWPID if pidns else 0)
    # root can make namespaces directly; others need a user namespace around them
    if flags and os.geteuid() != 0:
        flags |= CLONE_NEWUSER
    return flags


def _make_preexec(
    limits: SandboxLimits,
    netns: bool,
    uid: int | None,
    nproc: int,
    pidns: bool = False,
    confinement: WriteConfinement | None = None,
):
    unshare = _UNSHARE  # bound before fork: no dlopen/dlsym in the child
    flags = _ns_flags(netns, pidns)

    def preexec() -> None:  # runs in the child between fork and exec
        if flags:
            if unshare is None or unshare(flags) != 0:
                raise OSError(ctypes.get_errno(), f"unshare({flags:#x}) failed")
        _set_rlimits(limits, nproc)
        if uid is not None:
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
        if confinement is not None:  # last: it also sets no_new_privs
            confinement.restrict_self()

    return preexec


def _probe(python: str, netns: bool, uid: int | None, pidns: bool = False) -> bool:
    code = "import os, sys; print(sys.version_info[0])"
    if pidns:  # the first child must be PID 1 of the new namespace
        code = "import os, sys\npid = os.fork()\nif pid == 0: os._exit(0 if os.getpid() == 1 else 3)\n" + (
            "_, st = os.waitpid(pid, 0)\nprint(3 if st == 0 else 0)"
        )
    try:
        r = subprocess.run(
            [python, "-I", "-B", "-c", code],
            preexec_fn=_make_preexec(SandboxLimits(), netns, uid, 64, pidns),
            env={"PATH": "/usr/bin:/bin"},
            cwd="/",
            stdin=subprocess.DEVNULL,
            capture_output=True,
            timeout=30,
        )
    except (OSError, subprocess.SubprocessError):
        return False
    return r.returncode == 0 and r.stdout.strip() == b"3"


def network_isolation_mode(requested: str = "auto") -> str:
    """``"netns"`` if a new network namespace can be made here (checked once), else ``"audit-hook"``."""
    if requested == "audit":
        return "audit-hook"
    with _probe_lock:
        if "netns" not in _probe_cache:
            _probe_cache["netns"] = _probe(sys.executable, True, None)
        ok = _probe_cache["netns"]
    if requested == "netns" and not ok:
        raise RuntimeError("a network namespace was requested but unshare(CLONE_NEWNET) fails here")
    return "netns" if ok else "audit-hook"


def _landlock_probe(python: str) -> bool:
    """Whether a child confined by Landlock starts and is refused a write outside its dir."""
    inside, outside = tempfile.mkdtemp(), tempfile.mkdtemp()
    code = f"try:\n    open({os.path.join(outside, 'x')!r}, 'w')\nexcept PermissionError:\n    print(3)"
    try:
        confinement = WriteConfinement(inside)
    except OSError:
        return False
    try:
        r = subprocess.run(
            [python, "-I", "-B", "-c", code],
            preexec_fn=confinement.restrict_self,
            env={"PATH": "/usr/bin:/bin"},
            cwd=inside,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            timeout=30,
        )
        return r.returncode == 0 and r.stdout.strip() == b"3" and not os.listdir(outside)
    except (OSError, subprocess.SubprocessError):
        return False
    finally:
        confinement.close()
        shutil.rmtree(inside, ignore_errors=True)
        shutil.rmtree(outside, ignore_errors=True)


def filesystem_isolation_mode(requested: str = "auto") -> str:
    """``"landlock (ABI n)"`` if the kernel confines writes here (checked once), else ``"audit-hook"``."""
    if requested == "audit":
        return "audit-hook"
    with _probe_lock:
        if "landlock" not in _probe_cache:
            _probe_cache["landlock"] = abi_version() if _landlock_probe(sys.executable) else 0
        abi = _probe_cache["landlock"]
    if requested == "landlock" and not abi:
        raise RuntimeError("Landlock was requested but this kernel does not provide it (Linux >= 5.13)")
    return f"landlock (ABI {abi})" if abi else "audit-hook"


def pid_namespace_available() -> bool:
    """Whether runs get their own PID namespace here (checked once)."""
    with _probe_lock:
        if "pidns" not in _probe_cache:
            _probe_cache["pidns"] = _probe(sys.executable, False, None, pidns=True)
        return _probe_cache["pidns"]


def _interpreter_for(uid: int | None) -> str | None:
    """An interpreter the sandbox uid can run: ours if it can, else a system python3."""
    key = f"python:{uid is not None}"
    with _probe_lock:
        if key in _probe_cache:
            return _probe_cache[key]
        candidates = [sys.executable]
        if uid is not None:
            for c in (getattr(sys, "_base_executable", None), "/usr/bin/python3", shutil.which("python3")):
                if c and c not in candidates:
                    candidates.append(c)
        found = None
        probe_uid = None if uid is None else _SANDBOX_UID_BASE + _SANDBOX_UID_SPAN - 1
        for c in candidates:
            if os.path.exists(c) and _probe(c, False, probe_uid):
                found = c
                break
        _probe_cache[key] = found
        return found


def _count_procs_of(uid: int) -> int:
    n = 0
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                if os.stat(f"/proc/{d}").st_uid == uid:
                    n += 1
            except OSError:
                pass
    return n


def _kill_token_holders(token: bytes) -> int:
    """SIGKILL every process whose environment carries ``token``; returns how many were found."""
    found = 0
    me = os.getpid()
    for d in os.listdir("/proc"):
        if not d.isdigit() or int(d) == me:
            continue
        try:
            with open(f"/proc/{d}/environ", "rb") as f:
                env = f.read()
        except OSError:
            continue
        if token in env:
            found += 1
            try:
                os.kill(int(d), signal.SIGKILL)
            except OSError:
                pass
    return found


def _cleanup_processes(pgid: int, token: bytes) -> None:
    """Kill the run's process group and every process carrying its token."""
    for _ in range(50):
        try:
            os.killpg(pgid, signal.SIGKILL)
        except OSError:
            pass
        if _kill_token_holders(token) == 0:
            break
        time.sleep(0.02)


def _children_of(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(x) for x in f.read().split()]
    except OSError:
        pass
    kids = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        kids.append(int(d))
            except (OSError, ValueError, IndexError):
                pass
    return kids


def _terminate(proc: subprocess.Popen, token: bytes, pidns: bool) -> None:
    """Stop everything the run started.

    With a PID namespace, kill its init (the harness's only child) first: the kernel then
    kills and reaps the whole namespace, and the harness reaps the init and exits, so no
    zombie is orphaned to a PID 1 that might not reap. Then the process group and any
    token carrier (``setsid`` escapes) are SIGKILLed.
    """
    if pidns and proc.poll() is None:
        for child in _children_of(proc.pid):
            try:
                os.kill(child, signal.SIGKILL)
            except OSError:
                pass
        try:
            proc.wait(timeout=2)
        except subprocess.TimeoutExpired:
            pass
    _cleanup_processes(proc.pid, token)


def _wait_uid_gone(uid: int | None, timeout_s: float = 2.0) -> None:
    """For a dedicated sandbox uid: wait until the kernel has reaped all its processes."""
    if uid is None:
        return
    deadline = time.monotonic() + timeout_s
    while _count_procs_of(uid) and time.monotonic() < deadline:
        time.sleep(0.02)


_slot_counter = iter(range(1 << 62))
_slot_lock = threading.Lock()


def _next_uid() -> int:
    with _slot_lock:
        n = next(_slot_counter)
    return _SANDBOX_UID_BASE + (os.getpid() * 7 + n) % (_SANDBOX_UID_SPAN - 1)


# --------------------------------------------------------------------------- run


def _read_capped(proc: subprocess.Popen, status_r: int, deadline: float, cap: int):
    """Read stdout/stderr (capped) and the status pipe until all close or ``deadline``."""
    bufs: dict[Any, bytearray] = {proc.stdout: bytearray(), proc.stderr: bytearray()}
    status = bytearray()
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    sel.register(proc.stderr, selectors.EVENT_READ)
    sel.register(status_r, selectors.EVENT_READ)
    open_count = 3
    harness_done = False
    final_deadline = deadline
    while open_count:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        for key, _ in sel.select(timeout=min(remaining, 0.5)):
            fobj = key.fileobj
            fd = fobj if isinstance(fobj, int) else fobj.fileno()
            try:
                chunk = os.read(fd, 65536)
            except OSError:
                chunk = b""
            if not chunk:
                sel.unregister(fobj)
                open_count -= 1
                continue
            if fobj is status_r:
                if len(status) < 1 << 20:
                    status.extend(chunk)
            else:
                buf = bufs[fobj]
                if len(buf) < cap:
                    buf.extend(chunk[: cap - len(buf)])
        if not harness_done and proc.poll() is not None:
            # The harness exited; pipes may still be held open by its children: grace period.
            harness_done = True
            deadline = min(deadline, time.monotonic() + 0.2)
    sel.close()
    try:  # pipes closed (or grace over): give the harness until the deadline to exit
        proc.wait(timeout=max(0.0, final_deadline - time.monotonic()))
        timed_out = False
    except subprocess.TimeoutExpired:
        timed_out = True
    return bytes(bufs[proc.stdout]), bytes(bufs[proc.stderr]), bytes(status), timed_out


def _classify(
    status: dict | None, returncode: int | None, timed_out: bool, stderr: str
) -> tuple[bool, str, str]:
    violations = (status or {}).get("violations") or []
    kinds = [v.split(":", 1)[0] for v in violations]
    if timed_out:
        return False, "timeout", "wall-clock timeout"
    if returncode is not None and returncode < 0:
        sig = -returncode
        if sig == signal.SIGXCPU or (sig == signal.SIGKILL and "CPU" in stderr):
            return False, "timeout", "CPU time limit (RLIMIT_CPU)"
        try:
            name = signal.Signals(sig).name
        except ValueError:
            name = str(sig)
        return False, "killed", f"killed by {name}"
    for kind in ("network", "fs", "forbidden"):
        if kind in kinds:
            return False, kind, "; ".join(violations[:5])
    if status is None:
        if "MemoryError" in stderr:
            return False, "memory", "MemoryError"
        return False, "error", f"no result from harness (exit code {returncode})"
    if status.get("done") and returncode == 0:
        return True, "ok", ""
    exc_type = status.get("exc_type", "")
    msg = f"{status.get('stage')}: {exc_type}: {status.get('exc', '')}".strip()
    if exc_type == "MemoryError":
        return False, "memory", msg
    if exc_type == "AssertionError" and status.get("stage") == "tests":
        return False, "failed", msg
    return False, "error", msg


@dataclass
class _Run:
    """What one run needs: how it is isolated, who it runs as, where, and how to find its processes."""

    limits: SandboxLimits
    netmode: str
    fsmode: str
    pidns: bool
    uid: int | None
    python: str
    nproc: int
    run_as: str
    workdir: str = ""
    token: str = field(default_factory=lambda: f"ALIGNPIPE_SANDBOX_{uuid.uuid4().hex}")

    def result(self, passed: bool, reason: str, detail: str = "", **kw: Any) -> SandboxResult:
        return SandboxResult(
            passed,
            reason,
            detail,
            network_isolation=self.netmode,
            filesystem_isolation=self.fsmode,
            run_as=self.run_as,
            **kw,
        )


def _plan_run(limits: SandboxLimits) -> _Run | SandboxResult:
    """Isolation modes and identity for a run, or a refusal when privileges cannot be dropped."""
    netmode = network_isolation_mode(limits.network)
    fsmode = filesystem_isolation_mode(limits.filesystem)
    pidns = pid_namespace_available()
    if limits.drop_privileges and os.geteuid() == 0:
        uid = _next_uid()
        python = _interpreter_for(uid)
        if python is None:
            # Fail closed: as root RLIMIT_NPROC is not enforced, so a fork bomb could take the
            # machine down. drop_privileges=False runs as root anyway, knowingly.
            return SandboxResult(
                False,
                "error",
                "cannot drop privileges: no Python interpreter is executable by an unprivileged "
                "uid here; refusing to run untrusted code as root (set drop_privileges=False to override)",
                network_isolation=netmode,
                filesystem_isolation=fsmode,
                run_as="nobody",
            )
        return _Run(limits, netmode, fsmode, pidns, uid, python, limits.nproc, f"uid {uid}")
    uid_now = os.getuid()
    nproc = limits.nproc + (_count_procs_of(uid_now) if uid_now != 0 else 0)
    run_as = f"caller (uid {uid_now})" + ("; RLIMIT_NPROC not enforced for root" if uid_now == 0 else "")
    return _Run(limits, netmode, fsmode, pidns, None, sys.executable, nproc, run_as)


def _write_workdir(run: _Run, code: str, tests: str) -> None:
    run.workdir = tempfile.mkdtemp(prefix="alignpipe-sandbox-")
    for name, text in (("solution.py", code), ("tests.py", tests), ("_harness.py", _HARNESS)):
        with open(os.path.join(run.workdir, name), "w", encoding="utf-8") as f:
            f.write(text)
    if run.uid is not None:
        os.chown(run.workdir, run.uid, run.uid)
        for name in os.listdir(run.workdir):
            os.chown(os.path.join(run.workdir, name), run.uid, run.uid)


def _spawn(run: _Run, status_w: int) -> subprocess.Popen:
    """Start the harness in the work dir with the run's limits, namespaces and confinement."""
    env = {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "LANG": "C.UTF-8",
        "LC_ALL": "C.UTF-8",
        "HOME": run.workdir,
        "TMPDIR": run.workdir,
        "ALIGNPIPE_SANDBOX": run.token,
    }
    argv = [
        run.python,
        "-I",
        "-B",
        "_harness.py",  # relative: the sandbox uid may not traverse the parents of workdir
        str(status_w),
        "allow" if run.netmode == "netns" else "block",
        "pidns" if run.pidns else "nopidns",
        "kernel" if run.fsmode.startswith("landlock") else "hook",
    ]
    confinement = WriteConfinement(run.workdir) if run.fsmode.startswith("landlock") else None
    try:
        return subprocess.Popen(
            argv,
            cwd=run.workdir,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            pass_fds=(status_w,),
            start_new_session=True,
            preexec_fn=_make_preexec(
                run.limits, run.netmode == "netns", run.uid, run.nproc, run.pidns, confinement
            ),
            close_fds=True,
        )
    finally:
        if confinement is not None:
            confinement.close()


def _finish(run: _Run, proc: subprocess.Popen, status_r: int, t0: float) -> SandboxResult:
    """Read the run's output and verdict, stop everything it started, and classify it."""
    limits = run.limits
    out, err, status_raw, timed_out = _read_capped(proc, status_r, t0 + limits.timeout_s, limits.output_bytes)
    _terminate(proc, run.token.encode(), run.pidns)
    try:
        returncode = proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        proc.kill()
        returncode = proc.wait()
    _wait_uid_gone(run.uid)
    stderr = err.decode("utf-8", "replace")
    status = None
    for line in status_raw.decode("utf-8", "replace").splitlines():
        try:
            status = json.loads(line)
            break
        except ValueError:
            continue
    passed, reason, detail = _classify(status, returncode, timed_out, stderr)
    return run.result(
        passed,
        reason,
        detail,
        stdout=out.decode("utf-8", "replace"),
        stderr=stderr,
        returncode=returncode,
        duration_s=time.monotonic() - t0,
        violations=list((status or {}).get("violations") or []),
    )


def run_code(code: str, tests: str, limits: SandboxLimits | None = None) -> SandboxResult:
    """Run ``code`` then ``tests`` (Python asserts) in a fresh sandboxed interpreter."""
    run = _plan_run(limits or SandboxLimits())
    if isinstance(run, SandboxResult):
        return run
    status_r, status_w = os.pipe()
    t0 = time.monotonic()
    proc = None
    try:
        _write_workdir(run, code, tests)
        try:
            proc = _spawn(run, status_w)
        except (OSError, subprocess.SubprocessError) as e:
            return run.result(False, "error", f"could not start sandbox: {e}")
        finally:
            os.close(status_w)
            status_w = -1
        return _finish(run, proc, status_r, t0)
    finally:
        if proc is not None and proc.poll() is None:
            _terminate(proc, run.token.encode(), run.pidns)
            proc.wait()
        for fd in (status_r, status_w):
            if fd >= 0:
                os.close(fd)
        if proc is not None:
            for s in (proc.stdout, proc.stderr):
                if s:
                    s.close()
        if run.workdir:
            shutil.rmtree(run.workdir, ignore_errors=True)


# --------------------------------------------------------------------------- verifier entry points


def _code_and_tests(row: dict, completion: str) -> tuple[str, str]:
    tests = row.get("tests")
    if not tests:
        raise ValueError("a 'code' row needs a 'tests' field (Python asserts)")
    if isinstance(tests, list):
        tests = "\n".join(tests)
    return extract_code(completion), str(tests)


def run_row(row: dict, completion: str, limits: SandboxLimits | None = None) -> SandboxResult:
    """Run a completion against a row's ``tests`` (limits from ``limits`` + ``row["sandbox"]``)."""
    code, tests = _code_and_tests(row, completion)
    return run_code(code, tests, SandboxLimits.from_row(row, limits))


def score_code(row: dict, completion: str, limits: SandboxLimits | None = None) -> float:
    """1.0 iff every test in ``row["tests"]`` passes against the completion's code."""
    return run_row(row, completion, limits).score


def _max_parallel() -> int:
    env = os.environ.get("ALIGNPIPE_SANDBOX_WORKERS")
    if env:
        return max(1, int(env))
    return max(1, min(4, os.cpu_count() or 1))


def run_code_batch(
    rows: list[dict], completions: list[str], limits: SandboxLimits | None = None
) -> list[SandboxResult]:
    """Run many completions concurrently (threads wait on sandbox subprocesses)."""
    if len(rows) != len(completions):
        raise ValueError(f"{len(rows)} rows but {len(completions)} completions")
    if not rows:
        return []
    with ThreadPoolExecutor(max_workers=min(_max_parallel(), len(rows))) as ex:
        return list(ex.map(lambda rc: run_row(rc[0], rc[1], limits), zip(rows, completions, strict=True)))


def score_code_batch(
    rows: list[dict], completions: list[str], limits: SandboxLimits | None = None
) -> list[float]:
    return [r.score for r in run_code_batch(rows, completions, limits)]

"""Landlock (Linux >= 5.13): let a process write only beneath one directory, kernel-enforced.

The code sandbox's audit hook sees Python-level opens only; a C library that opens a path
itself (sqlite3, dbm, readline) or a process started behind the hook's back writes where it
likes. A Landlock ruleset that handles every write-type access and grants them beneath the
work directory alone closes that whole class: the kernel refuses the open/mkdir/unlink/rename,
whoever asks, and the restriction is inherited by every child and survives ``exec``.

Reads and execution stay unrestricted (the interpreter and its libraries live everywhere).
Usage: build a :class:`WriteConfinement` in the parent (it opens the ruleset), call
:meth:`WriteConfinement.restrict_self` in the child between fork and exec, ``close`` after.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

# Syscall numbers are the same on every Linux architecture (asm-generic table).
_SYS_CREATE_RULESET, _SYS_ADD_RULE, _SYS_RESTRICT_SELF = 444, 445, 446
_CREATE_RULESET_VERSION = 1
_RULE_PATH_BENEATH = 1
_PR_SET_NO_NEW_PRIVS = 38

_WRITE_FILE = 1 << 1
# remove dir/file, make char/dir/reg/sock/fifo/block/sym
_TREE_WRITES = sum(1 << b for b in (4, 5, 6, 7, 8, 9, 10, 11, 12))
_REFER = 1 << 13  # ABI 2: rename/link across directories
_TRUNCATE = 1 << 14  # ABI 3

_LIBC = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_syscall = _LIBC.syscall
_syscall.restype = ctypes.c_long
_prctl = _LIBC.prctl


class _RulesetAttr(ctypes.Structure):
    _fields_ = [("handled_access_fs", ctypes.c_uint64)]


class _PathBeneathAttr(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


def abi_version() -> int:
    """The kernel's Landlock ABI version, 0 when Landlock is missing or disabled."""
    v = _syscall(ctypes.c_long(_SYS_CREATE_RULESET), None, ctypes.c_size_t(0), ctypes.c_uint32(1))
    return max(0, int(v))


def _handled(abi: int) -> int:
    return _WRITE_FILE | _TREE_WRITES | (_REFER if abi >= 2 else 0) | (_TRUNCATE if abi >= 3 else 0)


class WriteConfinement:
    """A Landlock ruleset: write-type access only beneath ``writable_dir`` (and to ``extra_files``)."""

    def __init__(self, writable_dir: str, extra_files: tuple[str, ...] = ("/dev/null",)):
        self.abi = abi_version()
        if self.abi < 1:
            raise OSError("Landlock is not available in this kernel")
        handled = _handled(self.abi)
        attr = _RulesetAttr(handled)
        fd = _syscall(
            ctypes.c_long(_SYS_CREATE_RULESET),
            ctypes.byref(attr),
            ctypes.c_size_t(ctypes.sizeof(attr)),
            ctypes.c_uint32(0),
        )
        if fd < 0:
            raise OSError(ctypes.get_errno(), "landlock_create_ruleset failed")
        self.fd = int(fd)  # close-on-exec: it reaches the child through fork, not exec
        try:
            self._allow(writable_dir, handled)
            for path in extra_files:
                self._allow(path, handled & (_WRITE_FILE | _TRUNCATE))
        except OSError:
            self.close()
            raise

    def _allow(self, path: str, access: int) -> None:
        target = os.open(path, os.O_PATH | os.O_CLOEXEC)
        try:
            rule = _PathBeneathAttr(access, target)
            rc = _syscall(
                ctypes.c_long(_SYS_ADD_RULE),
                ctypes.c_int(self.fd),
                ctypes.c_int(_RULE_PATH_BENEATH),
                ctypes.byref(rule),
                ctypes.c_uint32(0),
            )
            if rc != 0:
                raise OSError(ctypes.get_errno(), f"landlock_add_rule({path}) failed")
        finally:
            os.close(target)

    def restrict_self(self) -> None:
        """Enforce the ruleset on the calling process (call in the child, before exec)."""
        if _prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS) failed")
        if _syscall(ctypes.c_long(_SYS_RESTRICT_SELF), ctypes.c_int(self.fd), ctypes.c_uint32(0)) != 0:
            raise OSError(ctypes.get_errno(), "landlock_restrict_self failed")

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

"""A feeder stuck while its gRPC still answers (the chaos harness's `stuck` fault, issue 45).

The feeder's event loop runs on its main thread: the servicer, the producers' hand-off, every
reply. ptrace stops that one thread (PTRACE_SEIZE, then PTRACE_INTERRUPT) and lets it go again
(PTRACE_DETACH); gRPC's own C threads keep running, so the HTTP/2 connection stays up and its
pings are answered while no batch comes: what a read hung on a filesystem, or a long pause of
the process, looks like to a rank. The kernel requires the thread that seized a tracee to be
the one that detaches it: the runner calls both from its one loop thread."""
from __future__ import annotations

import ctypes
import errno
import time

PTRACE_DETACH, PTRACE_SEIZE, PTRACE_INTERRUPT = 17, 0x4206, 0x4207

_libc = ctypes.CDLL(None, use_errno=True)
_libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
_libc.ptrace.restype = ctypes.c_long


def _ptrace(request: int, tid: int) -> int:
    """0, or the errno (ESRCH: the thread is gone)."""
    return 0 if _libc.ptrace(request, tid, None, None) == 0 else ctypes.get_errno()


def freeze(pid: int) -> bool:
    """Stop the main thread of process `pid` (its other threads go on). False if it is gone."""
    if _ptrace(PTRACE_SEIZE, pid):
        return False
    if _ptrace(PTRACE_INTERRUPT, pid):
        _ptrace(PTRACE_DETACH, pid)
        return False
    return True


def thaw(pid: int) -> None:
    """Let it go on (from the thread that froze it). The interrupt may not have stopped it yet:
    PTRACE_DETACH needs a stopped tracee, so try for a moment."""
    for _ in range(50):
        e = _ptrace(PTRACE_DETACH, pid)
        if e != errno.ESRCH or not _alive(pid):
            return
        time.sleep(0.01)   # ESRCH from a live tracee: not in its ptrace-stop yet


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] not in ("Z", "X")
    except OSError:
        return False

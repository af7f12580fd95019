"""What every entry of the cache directory (an epoch order, a Kafka epoch's snapshot, a packing)
shares: how it is put in place so that a crash never leaves half of one under its name, and the
tally of entries found damaged (removed and rebuilt; `feeder status`, the metrics).

An entry is written under a temporary name, its files and directory fsynced, renamed into
place, and the directory that holds it fsynced: without the fsyncs a host crash can leave the
new name pointing at blocks never written (a file of zeros; issue 34). What each entry verifies
before it is served is its own module's (docs/guarantees.md has the table).
"""
from __future__ import annotations

import errno
import logging
import os
import shutil
import threading
from pathlib import Path

log = logging.getLogger("feeder.cache")

KINDS = ("order", "snapshot", "packing")

_lock = threading.Lock()
_damaged: dict[str, int] = {k: 0 for k in KINDS}


_OWN: dict[str, Path] = {}


def own_directory(kind: str) -> Path:
    """A directory of this process's own for `kind` ("orders", "packing", "kafka"), in memory
    (/dev/shm) where there is one: where what the cache directory cannot hold (read-only, full,
    not this user's) is built instead, served but not shared (issue 44.2). Made on first use."""
    got = _OWN.get(kind)
    if got is None:
        import tempfile

        base = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
        got = _OWN[kind] = Path(tempfile.mkdtemp(prefix=f"feeder-{kind}-{os.getpid()}-", dir=base))
    return got


def cannot_keep(what: str, where, e: OSError, instead: str, said: str) -> str:
    """The one line that says a kind of entry cannot be kept in the cache directory and what this
    process does instead (issue 44.2), logged once while it stays the same (`said`: the last)."""
    why = (f"{what} cannot be kept in {where} ({type(e).__name__}: {e.strerror or e}); each feeder process "
           f"{instead} instead, not shared: give this user a writable --cache-dir with room")
    if why != said:
        log.warning(why)
    return why


def fsync(path: str | os.PathLike) -> None:
    """Flush a file, or a directory's entries, to stable storage."""
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if os.path.isdir(path) else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_back(fd: int, at: int, n: int) -> None:
    """Start writing bytes [at, at + n) of file `fd` to disk now, without waiting (Linux's
    sync_file_range; elsewhere nothing): an entry written in parts then has little left for
    the fsync that seals it. Joining 1.3 GB of packing, that fsync took 0.5-1 s after the last
    part; with each part sent on as it is written, ~0 s. Durability is still the fsync's."""
    if _SYNC_FILE_RANGE is not None:
        _SYNC_FILE_RANGE(fd, at, n, 2)   # SYNC_FILE_RANGE_WRITE (an error: the fsync reports it)


def copy_range(src: int, src_at: int, dst: int, dst_at: int, n: int) -> bool:
    """n bytes of file `src` from src_at into file `dst` at dst_at, copied by the kernel from page
    cache to page cache (copy_file_range). False where the file system or the platform cannot
    (nothing written: the caller writes the bytes itself); EOFError where `src` ends before.
    On a 2-vCPU VM the kernel copied 3.5-4 GB/s, writes of the same bytes from a process's
    buffer 0.45-0.7 GB/s."""
    copy = getattr(os, "copy_file_range", None)
    if copy is None:
        return False
    done = 0
    while done < n:
        try:
            got = copy(src, dst, n - done, src_at + done, dst_at + done)
        except OSError as e:
            if done == 0 and e.errno in (errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL):
                return False
            raise
        if got == 0:
            raise EOFError(f"the file ends {n - done:,} bytes before the range copied")
        done += got
    return True


def _libc_sync_file_range():
    try:
        import ctypes

        f = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):   # not Linux
        return None
    f.argtypes = (ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)
    return f


_SYNC_FILE_RANGE = _libc_sync_file_range()


def publish(tmp: str | os.PathLike, final: str | os.PathLike) -> None:
    """Move a complete entry (a file, or a directory of files) from `tmp` to `final` durably:
    its content, then the rename, are on disk before this returns. Raises OSError as
    os.replace does (a directory `final` that exists: another process published it first)."""
    tmp = Path(tmp)
    if tmp.is_dir():
        for p in tmp.rglob("*"):
            if p.is_file():
                fsync(p)
    fsync(tmp)
    os.replace(tmp, final)
    fsync(Path(final).parent)


def identity(path: str | os.PathLike) -> tuple | None:
    """Which file or directory is at `path` now (device, inode), or None: taken before an entry is
    checked, so that only that one is removed if it fails."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def remove_damaged(path: str | os.PathLike, seen: tuple | None, kind: str, what: str, why: str) -> bool:
    """Remove the damaged entry at `path` if it is still the one checked (`seen`, its identity
    then): another process may have removed it and published its rebuild meanwhile, which must
    not go. Moved aside first (one rename: a reader sees the entry whole or not at all), counted
    and said (`damaged`) by the process whose rename took it, then deleted. True if this call
    removed it."""
    path = Path(path)
    if seen is None or identity(path) != seen:
        return False
    aside = path.with_name(f".{path.name}.damaged-{os.getpid()}-{threading.get_ident()}")
    try:
        os.replace(path, aside)
    except OSError:
        return False
    damaged(kind, what, why)
    if aside.is_dir():
        shutil.rmtree(aside, ignore_errors=True)
    else:
        aside.unlink(missing_ok=True)
    return True


def damaged(kind: str, what: str, why: str) -> None:
    """An entry of `kind` was found damaged (and is being removed, to be rebuilt): said once, in
    the log, and counted. Callers call this once per entry they remove, so a damage is logged
    once however many ranks meet it."""
    with _lock:
        _damaged[kind] = _damaged.get(kind, 0) + 1
    log.error("cache: %s %s is damaged (%s): removed, to be built again; nothing of it was served", kind, what, why)


def damaged_counts() -> dict[str, int]:
    """{kind: entries this process found damaged}, every kind named (metrics, status)."""
    with _lock:
        return dict(_damaged)

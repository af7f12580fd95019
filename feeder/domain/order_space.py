"""Where torch's large orders are drawn and kept on this host (feeder.domain.order_store builds
them): the cache directory's orders/, the scratch space a build runs in (huge pages, /dev/shm or
the cache directory itself, by the filesystem under it and the memory there is), and what a
builder killed on this host left behind."""
from __future__ import annotations

import fcntl
import glob
import logging
import os
import socket

from feeder.core.errors import InvalidArgument

log = logging.getLogger("feeder.orders")

HUGE_FROM = 256 << 20   # orders this large are drawn on huge pages (below, the page tables fit in cache)


def orders_directory(cache_dir: str) -> str:
    """The cache directory's orders/, made if missing (InvalidArgument when it cannot be: a
    file, no permission, a read-only filesystem are the operator's to fix)."""
    path = os.path.join(cache_dir, "orders")
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise InvalidArgument(f"--cache-dir {cache_dir}: {e.strerror}; expected a directory this user can create "
                              "and write") from None
    return path


HOST = socket.gethostname().replace(".", "_")


def remove_orphans(cache: str) -> None:
    """Partial orders whose builder on this host is gone (SIGKILL, a crash): a build in
    /dev/shm holds memory until its file is removed. Named .NAME.HOST.PID.part; another host's
    are left to that host (its pids mean nothing here)."""
    for where in (cache, "/dev/shm"):
        for path in glob.glob(os.path.join(where, f".randperm-*.{HOST}.*.part")):
            pid = path.rsplit(".", 2)[-2]
            try:
                os.kill(int(pid), 0)
                continue   # (alive: its own build)
            except ProcessLookupError:
                pass
            except (ValueError, PermissionError):
                continue
            try:
                os.unlink(path)
                log.info("order cache: removed %s, left by a build that did not finish", path)
            except OSError:
                pass
    # Lock and progress files of builds nobody holds (the builder was killed): a lock no process
    # holds is taken here for a moment and removed. (A process that opened it just before may
    # still take it and build: then two build the same order, each under its own part name, and
    # the second rename puts the same bytes in place. Never a wrong order, and rare.)
    for lock_path in glob.glob(os.path.join(cache, "randperm-*.lock")):
        try:
            with open(lock_path, "a+b") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                for stale in (lock_path, lock_path[:-len(".lock")] + ".progress"):
                    if os.path.exists(stale):
                        os.unlink(stale)
        except (BlockingIOError, OSError):
            continue   # (held: a build under way, here or on another host)


def memory_backed(path: str) -> bool:
    return fs_type(path) in ("tmpfs", "ramfs")


def fs_type(path: str) -> str:
    """The filesystem type of `path` from /proc/mounts (longest mount point that holds it)."""
    path = os.path.realpath(path)
    best, kind = "", ""
    try:
        with open("/proc/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) > 2 and (path == parts[1] or path.startswith(parts[1].rstrip("/") + "/")) \
                        and len(parts[1]) > len(best):
                    best, kind = parts[1], parts[2]
    except OSError:
        pass
    return kind


def huge_pages_for(size: int) -> bool:
    """Draw an order of `size` bytes on huge pages: a large one, where the kernel gives
    transparent huge pages to madvise (or always), with the memory for it twice over."""
    if size < HUGE_FROM:
        return False
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            if "[never]" in f.read():
                return False
        with open("/proc/meminfo") as f:
            available = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return False
    return available > 2 * size


def shm_dir(size: int) -> str | None:
    """/dev/shm when it has room for a build twice over (else build in the cache directory)."""
    try:
        st = os.statvfs("/dev/shm")
    except OSError:
        return None
    return "/dev/shm" if st.f_bavail * st.f_frsize > 2 * size else None

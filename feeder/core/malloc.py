"""glibc malloc settings for processes that move multi-MiB buffers at a high rate
(standard library only: the feeder, the trainer's client and the bench share it)."""
from __future__ import annotations

MMAP_THRESHOLD = 32 << 20   # allocations up to this come from the heap
TRIM_THRESHOLD = 64 << 20   # free memory the heap keeps before returning any
_applied: bool | None = None


def keep_freed_memory() -> bool:
    """Let glibc's malloc reuse freed multi-megabyte buffers instead of mapping fresh pages
    for each. A feeder builds and frees a few-MiB reply ~100 times a second per process, and
    gRPC's client allocates the receive buffers and the message of each reply as often. With
    the defaults most of them came from new mmaps (or a heap trimmed back each time) and were
    faulted in page by page: ~700 page faults per 4 MiB reply, nearly half of what building it
    cost in the feeder, and ~30 % of a grpcio reader's CPU per byte. Allocations up to 32 MiB
    now come from the heap, which keeps up to 64 MiB of free memory before returning any.
    Process-wide, and applied once per process. False where this is not glibc."""
    global _applied
    if _applied is None:
        try:
            import ctypes

            libc = ctypes.CDLL("libc.so.6")
            M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
            _applied = bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(
                libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
        except (OSError, AttributeError):
            _applied = False
    return _applied

"""An order file's format: the ids (uint32, uint64 past 2^32), then a trailer of the checks made
when it was drawn (feeder.core.order.order_checks), and how a file is verified before any of it
is served (see feeder.domain.order_store's module doc for what each check catches)."""
from __future__ import annotations

import mmap
import os
import struct

import numpy as np

from feeder.core import order

# After the ids: magic, then the order's identity (n, the seed as torch takes it, which loop drew
# it), then feeder.order.CHECK_FIELDS as built (little-endian u64 each). The identity is checked
# against the order asked for, not only the file against itself: another job's order of the same
# size copied over this one's name (a bad sync, an operator's copy) is a sound permutation with
# sound checks, and was served as this job's (outside review 5). Version 1's trailer had n only:
# such a file is rebuilt.
TRAILER = struct.Struct("<8sQQQ6Q")
MAGIC = b"FDORDER2"


def identity(n: int, seed: int, kind: str) -> tuple[int, int, int]:
    """(n, seed, loop) as a trailer records them: torch seeds MT19937 with the seed's low 32
    bits, and draws with the inside-out loop (1) or the forward one (0) by release and size."""
    return n, seed & 0xFFFFFFFF, int(order.inside_out(kind, n))


def verified(fd: int, size: int, n: int, dtype: np.dtype, seed: int, kind: str) -> tuple[str, mmap.mmap | None]:
    """Why the order file open as `fd` cannot be served as the order of (n, seed, kind) ("" when
    it can), and its ids mapped read-only when it can."""
    body = n * dtype.itemsize
    if size != body + TRAILER.size:   # truncated, a crash before its trailer, another size's copied in
        return f"{size:,} bytes, not the {body + TRAILER.size:,} of {n:,} ids and their trailer", None
    magic, got_n, got_seed, got_loop, *recorded = TRAILER.unpack(os.pread(fd, TRAILER.size, body))
    if magic != MAGIC or got_n != n:
        return f"its trailer is not an order's of {n:,} ids (magic {magic!r}, n {got_n:,})", None
    want = identity(n, seed, kind)
    if (got_n, got_seed, got_loop) != want:
        return (f"it is another order: its trailer names seed {got_seed} ({'inside-out' if got_loop else 'forward'} "
                f"loop), not seed {want[1]} ({'inside-out' if want[2] else 'forward'} loop)"), None
    mm = mmap.mmap(fd, body, prot=mmap.PROT_READ)
    checks = order.order_checks(np.frombuffer(mm, dtype=dtype))
    why = order.not_a_permutation(n, checks)
    if why:
        why = f"not a permutation of [0, {n:,}): its {why} differ"
    else:
        moved = [f for f, got, built in zip(order.CHECK_FIELDS[4:], checks[4:], recorded[4:]) if got != built]
        if moved:   # a permutation still, but not the one drawn: ids swapped
            why = f"its {' and '.join(moved)} differ from the build's: ids were moved"
    return why, (None if why else mm)


def trailer(n: int, ids: np.ndarray, seed: int, kind: str) -> bytes:
    """The trailer of a drawn order: its identity and checks, refused if it is not a permutation
    (memory that flipped under the draw is not published to every process of the region)."""
    checks = order.order_checks(ids)
    why = order.not_a_permutation(n, checks)
    if why:
        raise RuntimeError(f"the drawn order of {n:,} ids is not a permutation ({why} wrong): not kept")
    return TRAILER.pack(MAGIC, *identity(n, seed, kind), *checks)

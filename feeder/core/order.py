"""An epoch's order: the permutation of [0, n) that DistributedSampler deals from.

Pure: numpy (and the C loops of feeder/_shuffle.c), no I/O. An order is anything that gives
the ids at given positions, `order[positions]` or `order[a:b:step]` (int arrays), and its
`len`. Three kinds:

* torch's: exactly `torch.randperm(n, generator=manual_seed(seed + epoch))` of the client's
  torch (`torch_randperm`). A sequential shuffle: it can only be materialized, O(n) once, then
  read at random (feeder.order_store builds it once per (n, seed), memory-mapped and shared).
  torch 2.7 changed the algorithm from 214,748,364 samples on (pytorch#143682); below that
  every release agrees, so the kind a job names matters only for larger orders.
* stateless (`Stateless`): a seeded random-access bijection of [0, n) (a Feistel network,
  cycle-walked), O(1) memory and time per id at any n; a new one per seed + epoch.
* identity (`Identity`): shuffle off.

Permutation kinds (`OrderKind`, `register`: the one place a kind is named, with its properties
and its cursor byte) are what a client asks for and a cursor records, by byte:
  ""             no kind named (an older client or cursor): torch's, valid only where every
                 torch release agrees (n < TORCH_INSIDE_OUT_FROM)
  "torch"        torch >= 2.7: forward below 214,748,364 samples, inside-out from there
  "torch-legacy" torch < 2.7: the forward loop at every n
  "stateless"    the Feistel order
`agreed` maps a kind to the one that decides a stream's samples ("" wherever all torch kinds
agree, or nothing is shuffled), so ranks and cursors are compared on what makes a difference.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from feeder.core.errors import FailedPrecondition

try:
    from feeder import _shuffle as _c
except ImportError:  # no C compiler at install: torch's kinds are refused, stateless runs in numpy
    _c = None

TORCH_INSIDE_OUT_FROM = (2**32 - 1) // 20   # torch: n < numeric_limits<uint32_t>::max() / 20
CHOICES = ("torch", "stateless")            # what a user chooses (FeederDataset(permutation=...))


@dataclass(frozen=True)
class OrderKind:
    """One kind of epoch order, registered once by name (`register`). Everything that depends on
    the kind asks its properties here instead of comparing names.

    `byte` is what every cursor stores for the kind: fixed forever once released (a cursor
    written today must name the same kind in ten years), so bytes are only ever added;
    tests/test_order.py holds the table of those released."""
    name: str
    byte: int
    make: Callable[[int, int], Any]   # (n, seed) -> the order (order[positions] -> ids; len)
    # Drawn whole (torch's randperm: O(n), cached when small, built once into the cache
    # directory when large, ahead of need) rather than computed per position.
    materialized: bool
    needs_c: bool = False             # drawn by feeder/_shuffle.c: refused where it was not built
    torch: bool = False               # a torch release's randperm (all draw alike below TORCH_INSIDE_OUT_FROM)


_BY_NAME: dict[str, OrderKind] = {}
_BY_BYTE: dict[int, OrderKind] = {}


def register(kind: OrderKind) -> OrderKind:
    """Add a kind of order: its name and its cursor byte must both be new."""
    if not 0 <= kind.byte < 256:
        raise ValueError(f"an order kind's cursor byte is 0..255, got {kind.byte}")
    for taken, what in ((_BY_NAME.get(kind.name), "name"), (_BY_BYTE.get(kind.byte), "cursor byte")):
        if taken is not None:
            raise ValueError(f"order kind {kind.name!r}: its {what} is {taken.name!r}'s already")
    _BY_NAME[kind.name] = _BY_BYTE[kind.byte] = kind
    return kind


def kind_of(name: str) -> OrderKind:
    got = _BY_NAME.get(name)
    if got is None:
        raise FailedPrecondition(f"permutation {name!r} is not known to this feeder (it knows "
                                 f"{', '.join(k for k in kinds() if k)}); another feeder may", elsewhere=True)
    return got


def by_byte(byte: int) -> OrderKind | None:
    return _BY_BYTE.get(byte)


def kinds() -> tuple[str, ...]:
    """The registered kinds' names, in cursor-byte order."""
    return tuple(k.name for _, k in sorted(_BY_BYTE.items()))


def make(name: str, n: int, seed: int):
    """Kind `name`'s order of [0, n) under `seed`."""
    return kind_of(name).make(n, seed)


def torch_kind(version: str) -> str:
    """The kind of a torch release's randperm ("2.6.0+cu124" -> "torch-legacy")."""
    try:
        major, minor = (int(p) for p in version.split("+")[0].split(".")[:2])
    except ValueError:
        return "torch"   # a build we cannot read is a recent one (nightlies, local builds)
    return "torch" if (major, minor) >= (2, 7) else "torch-legacy"


def agreed(kind: str, largest: int, shuffle: bool) -> str:
    """The kind that decides the orders of a stream whose largest permutation has `largest`
    ids: "" where every torch release draws the same (or nothing is shuffled)."""
    if not shuffle or (kind_of(kind).torch and largest < TORCH_INSIDE_OUT_FROM):
        return ""
    if kind == "":
        raise FailedPrecondition(
            f"shuffling {largest:,} samples (>= {TORCH_INSIDE_OUT_FROM:,}) depends on the torch version (2.7 changed "
            "randperm there), and this client does not say which it has: upgrade feeder_client on the ranks")
    return kind


def why_not_served(kind: str) -> str:
    """Why this feeder cannot draw orders of `kind` ("" when it can)."""
    known = _BY_NAME.get(kind)
    if known is not None and known.needs_c and kind and _c is None:
        return f"this feeder was installed without its C shuffle (feeder/_shuffle.c), which {kind!r} orders need"
    return ""


class Identity:
    """Shuffle off: position i holds id i."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, key):
        if isinstance(key, slice):
            return np.arange(*key.indices(self.n), dtype=np.int64)
        return np.asarray(key, dtype=np.int64).copy()


ROUNDS = 6   # a Feistel network's pseudo-randomness needs >= 4 rounds; 6 for margin
_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer (as in feeder/_shuffle.c), on uint64 arrays."""
    x = x ^ (x >> np.uint64(30))
    x = x * _M1
    x = x ^ (x >> np.uint64(27))
    x = x * _M2
    return x ^ (x >> np.uint64(31))


def _round_keys(seed: int) -> np.ndarray:
    """The network's keys: a splitmix64 stream from the seed (seed + epoch, as torch's)."""
    state = np.uint64(seed % (1 << 64))
    keys = np.empty(ROUNDS, dtype=np.uint64)
    with np.errstate(over="ignore"):
        for k in range(ROUNDS):
            state = state + np.uint64(0x9E3779B97F4A7C15)
            keys[k] = _mix64(np.array([state], dtype=np.uint64))[0]
    return keys


class Stateless:
    """A seeded bijection of [0, n), computed per position: O(1) memory, any n up to 2^62.

    A balanced Feistel network over 2h bits (the smallest even width with 4^h >= n) is a
    bijection of [0, 4^h) whatever its round function; walking its cycles until the value falls
    below n makes it one of [0, n). 4^h < 4n, so a walk is under 4 steps on average. Grain's
    index_shuffle, the usual stateless shuffle, is not a bijection at 2^k + 1 for even k >= 16;
    this one is at every n (tests/test_order.py)."""

    def __init__(self, n: int, seed: int):
        self.n, self.seed = n, seed
        bits = max(2, (max(n, 2) - 1).bit_length())
        self.half = (bits + 1) // 2
        self.keys = _round_keys(seed)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, key):
        if isinstance(key, slice):
            positions = np.arange(*key.indices(self.n), dtype=np.int64)
        else:
            positions = np.ascontiguousarray(key, dtype=np.int64)
            if positions.size and (positions.min() < 0 or positions.max() >= self.n):
                raise IndexError(f"positions outside [0, {self.n})")
        if self.n <= 1:
            return positions.copy()
        out = np.empty_like(positions)
        if _c is not None:
            _c.feistel(positions, out, self.n, self.half, self.keys)
            return out
        return self.walk(positions)

    def _network(self, x: np.ndarray, inverse: bool = False) -> np.ndarray:
        half, mask = np.uint64(self.half), np.uint64((1 << self.half) - 1)
        left, right = x >> half, x & mask
        keys = self.keys[::-1] if inverse else self.keys
        with np.errstate(over="ignore"):
            for k in keys:
                if inverse:
                    left, right = right ^ (_mix64(left ^ k) & mask), left
                else:
                    left, right = right, left ^ (_mix64(right ^ k) & mask)
        return (left << half) | right

    def walk(self, positions: np.ndarray, inverse: bool = False) -> np.ndarray:
        """The ids at `positions` in numpy (the reference for the C loop); inverse=True gives
        the positions of ids instead."""
        x = np.asarray(positions, dtype=np.int64).astype(np.uint64)
        out = self._network(x, inverse)
        todo = np.flatnonzero(out >= np.uint64(self.n))
        while todo.size:
            out[todo] = self._network(out[todo], inverse)
            todo = todo[out[todo] >= np.uint64(self.n)]
        return out.astype(np.int64)

    def position_of(self, ids: np.ndarray) -> np.ndarray:
        """Where each id lies in the order: the inverse permutation."""
        if self.n <= 1:
            return np.asarray(ids, dtype=np.int64).copy()
        return self.walk(ids, inverse=True)


def order_dtype(n: int) -> np.dtype:
    """The narrowest type a materialized order of n ids is stored in."""
    return np.dtype(np.uint32) if n <= 1 << 32 else np.dtype(np.uint64)


def inside_out(kind: str, n: int) -> bool:
    """Whether torch's randperm of `kind` draws n ids with the inside-out loop."""
    return kind == "torch" and n >= TORCH_INSIDE_OUT_FROM


def torch_randperm(n: int, seed: int, kind: str, out: np.ndarray | None = None,
                   progress: np.ndarray | None = None) -> tuple[np.ndarray, bool]:
    """torch.randperm(n) under manual_seed(seed), as torch of `kind` draws it, into `out` (a
    new array of order_dtype(n) by default) -> (out, stopped). `progress`: int64[2], the steps
    done (written as it runs) and a stop flag (set by another thread: returns early, stopped)."""
    if _c is None:
        raise FailedPrecondition(why_not_served(kind or "torch"), elsewhere=True)
    if out is None:
        out = np.empty(n, dtype=order_dtype(n))
    stopped = _c.randperm(out, seed % (1 << 64), inside_out(kind, n), progress)
    return out, stopped


def torch_prefix(n: int, k: int, seed: int, kind: str, progress: np.ndarray | None = None) -> tuple[np.ndarray, bool]:
    """The ids at positions [0, k) of torch_randperm(n, seed, kind), without drawing the rest
    (feeder/_shuffle.c: O(k) for the forward loop; all n draws but no array of n for the
    inside-out one, ~7x faster than the whole) -> (ids of order_dtype(n), stopped). `progress`
    as torch_randperm's. What a large order's ranks are served while the whole is built."""
    if _c is None:
        raise FailedPrecondition(why_not_served(kind or "torch"), elsewhere=True)
    out = np.empty(min(k, n), dtype=order_dtype(n))
    stopped = _c.prefix(out, n, seed % (1 << 64), inside_out(kind, n), progress)
    return out, stopped


# -- what a stored order must satisfy (feeder.domain.order_store verifies its files by these) --

try:
    from feeder._native import order_check as _order_check
except ImportError:  # no C compiler at install: numpy, in parts, ~10x slower
    _order_check = None

_M64 = (1 << 64) - 1
CHECK_FIELDS = ("sum", "sum_sq", "xor", "max", "weighted", "blocks_crc32c")
CHECK_BLOCK_BYTES = 16 << 20   # the unit of the CRC digest (fixed: the digest is part of the file format)
_FNV_PRIME, _FNV_OFFSET = 0x100000001B3, 0xCBF29CE484222325


def permutation_sums(n: int) -> tuple[int, int, int]:
    """(sum, sum of squares mod 2^64, xor) of any permutation of [0, n): what a stored order's
    ids must add up to whatever their positions."""
    m = n - 1
    xor = 0 if n <= 0 else (m, 1, m + 1, 0)[m % 4]   # 0 ^ 1 ^ ... ^ m
    return (n * m // 2) & _M64, (m * n * (2 * m + 1) // 6) & _M64, xor


def order_checks(ids: np.ndarray, threads: int = 0) -> tuple[int, ...]:
    """CHECK_FIELDS of an order (uint32 or uint64 ids, any length), all mod 2^64: the sums a
    permutation fixes, the largest id, and two that depend on where each id lies (Σ (i+1)·x_i;
    the CRC-32C of each CHECK_BLOCK_BYTES block, folded in order, FNV-1a style, into 64 bits).
    Blocks are checked on `threads` threads (0: up to 8, as the cores allow), each in one pass
    at memory bandwidth (C): torch's 10^9 order, 4 GB, in ~0.3 s on 8 cores of a server."""
    ids = np.ascontiguousarray(ids)
    if ids.dtype not in (np.uint32, np.uint64):
        raise ValueError(f"an order is uint32 or uint64, got {ids.dtype}")
    per = CHECK_BLOCK_BYTES // ids.itemsize
    starts = range(0, len(ids), per)
    threads = threads or min(8, os.cpu_count() or 1, max(1, len(starts)))
    if threads > 1:
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(threads, thread_name_prefix="feeder-order-check") as pool:
            parts = list(pool.map(lambda at: _block_checks(ids[at:at + per]), starts))
    else:
        parts = [_block_checks(ids[at:at + per]) for at in starts]
    s = q = x = m = w = 0
    digest = _FNV_OFFSET
    for at, (bs, bq, bx, bm, bw, crc) in zip(starts, parts):   # (one step per 16 MB block)
        s, q, x, m = s + bs, q + bq, x ^ bx, max(m, bm)
        w += bw + at * bs    # the block's Σ (i+1)·x_i counted i from its start
        digest = ((digest ^ crc) * _FNV_PRIME) & _M64
    return s & _M64, q & _M64, x, m, w & _M64, digest


def _block_checks(ids: np.ndarray) -> tuple[int, ...]:
    """One block's sums (Σ (i+1)·x_i with i from the block's start) and CRC-32C, in C where built."""
    if _order_check is not None:
        out = np.zeros(6, dtype=np.uint64)
        _order_check(ids.view(np.uint8).reshape(-1), ids.itemsize, out)
        return tuple(int(v) for v in out)
    import google_crc32c   # (only a build without the C extension: the wire's CRC library)

    with np.errstate(over="ignore"):
        v = ids.astype(np.uint64)
        w = int((v * np.arange(1, len(v) + 1, dtype=np.uint64)).sum(dtype=np.uint64))
        return (int(v.sum(dtype=np.uint64)), int((v * v).sum(dtype=np.uint64)),
                int(np.bitwise_xor.reduce(v)) if len(v) else 0, int(v.max()) if len(v) else 0, w,
                google_crc32c.value(ids.tobytes()))


def not_a_permutation(n: int, checks: tuple[int, ...]) -> str:
    """Why ids with these order_checks cannot be a permutation of [0, n) ("" when they may be).
    Catches any damage that changes which ids the order holds: an entry overwritten or zeroed
    (one changed entry always moves the sum; changes that keep the sum move the sum of squares
    or the xor, short of a contrived coincidence), an id ≥ n. Swaps keep all three: only a
    digest of positions (Σ (i+1)·x_i, a CRC) recorded at build catches those."""
    s, q, x, m = checks[:4]
    want = permutation_sums(n)
    wrong = [name for name, got, exp in (("sum", s, want[0]), ("sum of squares", q, want[1]), ("xor", x, want[2]))
             if got != exp]
    if n and m >= n:
        wrong.append(f"largest id {m:,} ≥ n")
    return ", ".join(wrong)
# The kinds released so far, with their cursor bytes (append only).
register(OrderKind("", 0, lambda n, seed: torch_randperm(n, seed, "")[0], materialized=True, needs_c=True, torch=True))
register(OrderKind("torch", 1, lambda n, seed: torch_randperm(n, seed, "torch")[0], materialized=True, needs_c=True,
                   torch=True))
register(OrderKind("torch-legacy", 2, lambda n, seed: torch_randperm(n, seed, "torch-legacy")[0], materialized=True,
                   needs_c=True, torch=True))
register(OrderKind("stateless", 3, lambda n, seed: Stateless(n, seed), materialized=False))

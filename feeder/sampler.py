"""Which rank gets which sample: exactly torch's DistributedSampler, plus elastic re-dealing.

Pure: no I/O, no gRPC. The permutation is torch.randperm's (same generator,
same seed + epoch) so ids match torch id by id; everything else is integer arithmetic.

A *segment* generalises DistributedSampler for elastic restarts: the epoch's global order
from position `base` on is dealt over `world` ranks with DistributedSampler's padding or
dropping. base = 0 is exactly DistributedSampler. When ranks that each consumed `pos`
samples of segment (base, W) restart with another world size, the next segment starts at
base + W * pos: those are exactly the samples already consumed (the rank lists interleave
the global order), so nothing is lost or repeated.
"""
from __future__ import annotations

import threading
from collections import OrderedDict

import numpy as np

from feeder.errors import FailedPrecondition


def n_samples(n_tokens: int, seq_len: int) -> int:
    """Samples cut from a packed stream of n_tokens: sample i is tokens [i*L, i*L + L + 1)."""
    return max(0, (n_tokens - 1) // seq_len)


def per_rank(m: int, world: int, drop_last: bool) -> int:
    """DistributedSampler.num_samples for m samples over `world` ranks."""
    if m <= 0:
        return 0
    return m // world if drop_last else -(-m // world)


_ORDER_CACHE: "OrderedDict[tuple, np.ndarray]" = OrderedDict()
_ORDER_LOCK = threading.Lock()
# Bounded in bytes, not entries: ranks of a job drift apart by up to their prefetch, and on a
# small dataset that is many epochs (each rank recomputed every epoch's order when this held
# 8); on a huge one a single order is gigabytes. The newest two always stay.
_ORDER_CACHE_ENTRIES = 256
_ORDER_CACHE_BYTES = 256 << 20
_order_bytes = 0


def epoch_order(n: int, seed: int, epoch: int, shuffle: bool) -> np.ndarray:
    """The epoch's global order of sample ids (shape [n], read-only).

    Cached: every rank of a job, and every job with the same (n, seed, epoch), shares one.
    int32 when it fits, which halves the memory of a large permutation.
    """
    global _order_bytes
    key = (n, seed, epoch, shuffle)
    with _ORDER_LOCK:
        hit = _ORDER_CACHE.get(key)
        if hit is not None:
            _ORDER_CACHE.move_to_end(key)
            return hit
    dtype = np.int32 if n < 2**31 else np.int64
    if shuffle:
        order = randperm(n, seed + epoch).astype(dtype, copy=False)
    else:
        order = np.arange(n, dtype=dtype)
    order.setflags(write=False)
    with _ORDER_LOCK:
        if key not in _ORDER_CACHE:   # another thread may have drawn it meanwhile
            _ORDER_CACHE[key] = order
            _order_bytes += order.nbytes
        while len(_ORDER_CACHE) > 2 and (len(_ORDER_CACHE) > _ORDER_CACHE_ENTRIES
                                         or _order_bytes > _ORDER_CACHE_BYTES):
            _order_bytes -= _ORDER_CACHE.popitem(last=False)[1].nbytes
    return order


def randperm(n: int, seed: int) -> np.ndarray:
    """torch.randperm(n, generator=torch.Generator().manual_seed(seed)), without torch.

    torch's CPU generator is MT19937 seeded with the low 32 bits of the seed (the classic
    init_genrand, which numpy's legacy RandomState also uses), and for n < 2^32/20 randperm
    is the Fisher-Yates loop `swap(r[i], r[i + draw % (n - i)])` over its 32-bit draws. The
    loop runs in C (feeder/_shuffle.c) so the feeder need not import torch (~500 MB resident).
    tests/test_sampler.py checks it against torch itself.
    """
    try:
        from feeder._shuffle import fisher_yates
    except ImportError:  # no C compiler at install: torch's own, at the cost of its memory
        fisher_yates = None
    if fisher_yates is None or n >= 2**32 // 20:
        try:
            import torch  # torch switches to another algorithm for huge n: use it there
        except ImportError:  # torch is the client extra's: a feeder host may well not have it
            why = "this many samples" if fisher_yates else "a feeder built without a C compiler"
            raise FailedPrecondition(f"shuffling {n:,} samples needs torch's randperm ({why}): "
                                     "pip install 'token-feeder[client]' on the feeder hosts") from None

        g = torch.Generator()
        g.manual_seed(seed)
        return torch.randperm(n, generator=g).numpy()
    draws = _mt19937(seed).randint(0, 2**32, size=max(n - 1, 0), dtype=np.uint32)
    order = np.arange(n, dtype=np.int64)
    fisher_yates(order, draws)
    return order


_RNG = threading.local()


def _mt19937(seed: int) -> np.random.RandomState:
    """This thread's legacy MT19937, seeded with init_genrand(seed mod 2^32). Reseeding one costs
    2 us; constructing a RandomState costs 220 us (it seeds from SeedSequence first), which was
    most of an epoch's planning on a small dataset."""
    rs = getattr(_RNG, "rs", None)
    if rs is None:
        rs = _RNG.rs = np.random.RandomState()
    rs.seed(seed & 0xFFFFFFFF)
    return rs


def rank_ids(order: np.ndarray, *, base: int, world: int, rank: int, drop_last: bool,
             start: int, stop: int) -> np.ndarray:
    """Ids at positions [start, stop) of `rank`'s list in segment (base, world). int64 [k]."""
    m = len(order) - base
    stop = min(stop, per_rank(m, world, drop_last))
    if start >= stop:
        return np.empty(0, dtype=np.int64)
    first, last = rank + start * world, rank + (stop - 1) * world
    if last < m:
        # No padding in reach: a strided view, copied once. (np.arange, the arithmetic and the
        # fancy indexing below each release the GIL even for a few elements, and under load a
        # feeder's builder thread then waits milliseconds to get it back from the event loop.)
        return order[base + first:base + last + 1:world].astype(np.int64)
    g = rank + np.arange(start, stop, dtype=np.int64) * world
    # DistributedSampler pads by cycling the list from its start: padded[g] = R[g mod m].
    g %= m
    return order[base + g].astype(np.int64)


def reshard_base(*, n: int, base: int, world: int, pos: int) -> int:
    """Start of the next segment when every rank of (base, world) consumed `pos` samples."""
    return base + min(world * pos, n - base)

"""Which rank gets which sample: exactly torch's DistributedSampler, plus elastic re-dealing.

Pure: no I/O, no gRPC. The permutation is the epoch's order (feeder.order: torch.randperm's, same generator, same
seed + epoch, so ids match torch id by id; or the stateless one); everything else is integer
arithmetic over positions of it.

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

from feeder.core import order


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
# 8). Orders larger than SMALL_ORDER are not here: the order store keeps them (memory-mapped
# files, built once and shared by every process). The newest two always stay.
_ORDER_CACHE_ENTRIES = 256
_ORDER_CACHE_BYTES = 256 << 20
_order_bytes = 0
SMALL_ORDER = 1 << 22   # drawn in memory here (~40 ms); larger ones by the order store


class OrderPending(Exception):
    """The order a stream needs next is being built (elsewhere, or in the background): the
    plan says so to its rank and asks again (str(e) says what is being built, how far)."""


class Early:
    """The first `known` positions of an epoch's order whose whole is still being built (the
    order store draws them apart, in a fraction of the build: feeder.core.order.torch_prefix):
    served meanwhile, so a rank's first batch does not wait for an O(n) shuffle. An order like
    any other (`len`, `order[positions]`) for positions it has; any other raises OrderPending
    (`pending()` says how far the whole is). `reach` keeps a stream's runs within it."""

    def __init__(self, ids: np.ndarray, n: int, pending):
        self.ids, self.n, self.known, self.pending = ids, n, len(ids), pending

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, key):
        if isinstance(key, slice):
            r = range(*key.indices(self.n))
            if r and max(r[0], r[-1]) >= self.known:
                raise OrderPending(self.pending())
            return self.ids[r.start:r.stop if r.stop >= 0 else None:r.step]
        at = np.asarray(key)
        if at.size and int(at.max()) >= self.known:
            raise OrderPending(self.pending())
        return self.ids[at]


def reach(order, *, base: int, world: int, rank: int, start: int, stop: int, per_batch: int) -> int:
    """How far positions [start, stop) of `rank`'s list in segment (base, world) can be served
    from `order`: `stop` when it is whole; when it is Early, the end of the last whole batch of
    `per_batch` (counted from `start`) whose ids it has: `start` when not one (then the stream
    waits for the whole). Padding (the list cycling back to its start) only follows the last
    position of the epoch, which an Early order never has."""
    known = getattr(order, "known", None)
    if known is None:
        return stop
    have = (known - base - rank + world - 1) // world   # positions j of the list with base + rank + j*world < known
    if have >= stop:
        return stop
    return start + max(0, have - start) // per_batch * per_batch


def _draw_in_memory(n: int, seed: int, kind: str, early: bool = False):
    return order.torch_randperm(n, seed, kind)[0]


# Torch's orders larger than SMALL_ORDER come from the caller's order store (`orders`: get(n,
# seed, kind) -> an array, or OrderPending; prepare(n, seed, kind) starts building one ahead of
# need; feeder.domain.order_store), which a server hands its plans (feeder.sources.Context);
# without one (tests, audit, tools) they are drawn in memory, synchronously, when asked.


def prepare_order(n: int, seed: int, epoch: int, shuffle: bool, kind: str = "", orders=None) -> None:
    """Have epoch's order built ahead of need, where it is built at all (large, torch's, with a store)."""
    if shuffle and order.kind_of(kind).torch and n > SMALL_ORDER and orders is not None:
        orders.prepare(n, seed + epoch, kind)


def epoch_order(n: int, seed: int, epoch: int, shuffle: bool, kind: str = "", orders=None, early: bool = False):
    """The epoch's global order of sample ids (an order: `order[positions]`, `len(order)`).

    `kind` is the permutation (feeder.core.order.kinds()): torch's (materialized: cached here when
    small, the order store's when large, so every rank of a job and every job with the same
    (n, seed + epoch) share one) or stateless (computed per position). Raises OrderPending
    while a large torch order is being built; with `early`, gives its first positions (Early)
    as soon as they are drawn instead, to a caller that keeps within them (`reach`)."""
    if not shuffle:
        return order.Identity(n)
    k = order.kind_of(kind)
    if not k.materialized:   # computed per position: nothing to draw or keep
        return k.make(n, seed + epoch)
    if n > SMALL_ORDER and k.torch:   # built once into the cache directory (the order store)
        return (orders.get if orders is not None else _draw_in_memory)(n, seed + epoch, kind, early)
    return _cached(n, seed + epoch, kind)


def _cached(n: int, seed: int, kind: str) -> np.ndarray:
    global _order_bytes
    key = (n, seed, order.inside_out(kind, n))   # (every kind draws the same where the loop is the same)
    with _ORDER_LOCK:
        hit = _ORDER_CACHE.get(key)
        if hit is not None:
            _ORDER_CACHE.move_to_end(key)
            return hit
    drawn = np.asarray(order.make(kind, n, seed))
    drawn.setflags(write=False)
    with _ORDER_LOCK:
        if key not in _ORDER_CACHE:   # another thread may have drawn it meanwhile
            _ORDER_CACHE[key] = drawn
            _order_bytes += drawn.nbytes
        while len(_ORDER_CACHE) > 2 and (len(_ORDER_CACHE) > _ORDER_CACHE_ENTRIES
                                         or _order_bytes > _ORDER_CACHE_BYTES):
            _order_bytes -= _ORDER_CACHE.popitem(last=False)[1].nbytes
    return drawn


def randperm(n: int, seed: int, kind: str = "") -> np.ndarray:
    """torch.randperm(n, generator=torch.Generator().manual_seed(seed)), without torch, as
    torch of `kind` draws it (feeder.order: the C loops of feeder/_shuffle.c; the feeder never
    imports torch, ~500 MB resident). uint32 up to 2^32 ids. tests/test_order.py checks it
    against torch itself, on both sides of torch 2.7's threshold."""
    return order.torch_randperm(n, seed, kind)[0]


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

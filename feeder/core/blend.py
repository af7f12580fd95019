"""Mixtures: which source fills each position of an epoch, and with which of its samples.

Pure: no I/O, no gRPC. An epoch of a mixture has N = epoch_samples positions, dealt to ranks
exactly as a dataset of N samples would be (feeder.sampler: DistributedSampler, segments for
elastic re-dealing). What fills position p (0-based, in the epoch's unshuffled order):

* its source is Megatron-LM's blending rule over the blending's slots (`blend`): with weights
  normalized to sum 1, slot j goes to the source d with the largest w_d * max(j, 1) - count_d,
  ties to the first named. Normally slot j is position j; after a mid-epoch remix the slots are
  the positions not consumed before it, in ascending order (`Mixture.mix_base`).
* its sample is the source's next draw: the k-th draw from source d is the (k mod n_d)-th id
  of the source's (k div n_d)-th permutation (`source_order`): without replacement, a source
  repeats a sample only after all of its samples were drawn. Draw counters run on across
  epochs (Mixture.offsets: the draws before epoch ref_epoch) and across remixes.

A remix (a cursor of another mixture, resumed with remix=True) re-deals what the epoch has
not consumed, from the same place reshard would (sampler.reshard_base), under the new
weights; every draw the old mixture had assigned in that epoch is skipped rather than made
again (so nothing repeats early), and a source new to the mixture starts at its first draw.
"""
from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict

import numpy as np

from feeder.core import order, sampler
from feeder.core.cursor import Mixture
from feeder.core.errors import FailedPrecondition

try:
    from feeder._native import blend as _native_blend
    from feeder._native import blend_at as _native_blend_at
    from feeder._native import blend_checkpoints as _native_checkpoints
    from feeder._native import blend_couple as _native_couple
except ImportError:  # no C compiler at install: the loop below, ~100x slower, and no huge mixtures
    _native_blend = _native_blend_at = _native_checkpoints = _native_couple = None


def normalized(weights) -> tuple[float, ...]:
    """Weights over their sum, in float64 as Megatron's `normalize` computes them."""
    w = np.asarray(weights, dtype=np.float64)
    return tuple((w / np.sum(w)).tolist())


_BLEND_CACHE: "OrderedDict[tuple, tuple[np.ndarray, np.ndarray, np.ndarray]]" = OrderedDict()
_BLEND_LOCK = threading.Lock()
_BLEND_BYTES = 256 << 20


def blend(weights: tuple[float, ...], size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(source int16 [size], draw int64 [size], counts int64 [D]) of Megatron's blending of
    `size` slots under normalized `weights`: slot j's source, the draws of that source before
    slot j, and each source's total. Cached (every rank of a job shares one), read-only."""
    key = (weights, size)
    with _BLEND_LOCK:
        hit = _BLEND_CACHE.get(key)
        if hit is not None:
            _BLEND_CACHE.move_to_end(key)
            return hit
    w = np.asarray(weights, dtype=np.float64)
    index = np.empty(size, dtype=np.int16)
    draw = np.empty(size, dtype=np.int64)
    if _native_blend is not None:
        _native_blend(w, index, draw)
    else:
        count = [0] * len(w)
        wl = w.tolist()
        for i in range(size):
            at = float(max(i, 1))
            best = max(range(len(wl)), key=lambda d: (wl[d] * at - count[d], -d))
            index[i], draw[i] = best, count[best]
            count[best] += 1
    counts = np.bincount(index, minlength=len(w)).astype(np.int64)
    for a in (index, draw, counts):
        a.setflags(write=False)
    out = (index, draw, counts)
    with _BLEND_LOCK:
        _BLEND_CACHE[key] = out
        while len(_BLEND_CACHE) > 2 and sum(i.nbytes + d.nbytes for i, d, _ in _BLEND_CACHE.values()) > _BLEND_BYTES:
            _BLEND_CACHE.popitem(last=False)
    return out


# Blendings larger than this are not materialized: each source's count every BLEND_EVERY slots
# (Checkpoints) answers any slot in at most BLEND_EVERY steps. 8 bytes a source per 2048 slots:
# 10^10 positions of 3 sources hold 117 MB, where the whole blending would take 100 GB.
BLEND_EVERY = 2048
BLEND_INLINE = 1 << 27   # slots scanned while the rank waits (~0.3 s); more in the background
# Up to this many sources, a checkpoint is computed on its own by coupling from the past
# (_native.c blend_couple): ~10 us from a few thousand slots before it, so a mixture of any size
# needs neither the pass from slot 0 (12 s at 10^10 positions) nor its table. Beyond, or where
# the candidates have not met within COUPLE_MAX_WINDOW slots, the table is built as before.
COUPLE_SOURCES = 4
COUPLE_WINDOW = 1 << 11
COUPLE_MAX_WINDOW = 1 << 17
COUPLED_ROWS = 1 << 16   # coupled checkpoints kept (32 bytes each at 4 sources)
# The table's limit: more sources than COUPLE_SOURCES, or weights whose candidates do not meet
# (a weight 0 named after a weighted source, weights ~10^9 apart), are served from the table up
# to this size, 2.7·10^10 positions of 5 sources; beyond, the request is refused, not left
# waiting on an allocation that fails.
TABLE_MAX_BYTES = 1 << 30


class Checkpoints:
    """Megatron's blending of one weight vector at any slot, from each source's count before
    every BLEND_EVERY-th slot. The blending does not depend on the epoch's size, so one table
    per weight vector serves every size, grown as far as a job needs it. Up to COUPLE_SOURCES
    sources, a checkpoint past the table is computed alone (coupled) instead of growing it."""

    def __init__(self, weights: tuple[float, ...]):
        self.weights = np.asarray(weights, dtype=np.float64)
        self.table = np.zeros((1, len(weights)), dtype=np.int64)   # row k: counts before slot k * EVERY
        self.progress = np.zeros(2, dtype=np.int64)
        self._lock = threading.Lock()
        self._growing: threading.Thread | None = None
        self._want = 0
        self._coupled: "OrderedDict[int, np.ndarray]" = OrderedDict()
        self._uncoupled = False   # candidates once failed to meet: these weights use the table
        self._error = ""          # the background scan failed (or was stopped): said to every rank

    def covers(self, size: int) -> bool:
        return size // BLEND_EVERY < len(self.table)

    def ensure(self, size: int) -> None:
        """Make slots [0, size] answerable; OrderPending while a long scan runs in the background."""
        if self.covers(size):
            return
        if _native_checkpoints is None:
            raise FailedPrecondition(f"a mixture of {size:,} positions needs the feeder's C extension "
                                     "(feeder/_native.c), which this install lacks", elsewhere=True)
        need = (size // BLEND_EVERY + 1) * len(self.weights) * 8
        if need > TABLE_MAX_BYTES:
            k = len(self.weights)
            most = TABLE_MAX_BYTES // (8 * k) * BLEND_EVERY
            why = (f"a mixture of more than {COUPLE_SOURCES} sources is blended from a table" if k > COUPLE_SOURCES else
                   "these weights' blending cannot be computed per position (a weight 0 named after a weighted "
                   "source, or weights about 10^9 apart), so it is blended from a table")
            raise FailedPrecondition(f"{why}, which over {size:,} positions would take {need / 2**30:.1f} GiB "
                                     f"(the limit is {TABLE_MAX_BYTES / 2**30:.0f} GiB): use at most {most:,} "
                                     f"positions, or at most {COUPLE_SOURCES} sources with positive weights")
        if self._error:
            raise FailedPrecondition(f"the mixture's blending could not be computed: {self._error}", elsewhere=True)
        with self._lock:
            if self.covers(size):
                return
            have = (len(self.table) - 1) * BLEND_EVERY
            if size - have <= BLEND_INLINE and self._growing is None:
                self._grow(size)
                return
            self._want = max(self._want, size)
            if self._growing is None:
                self._growing = threading.Thread(target=self._grow_in_background, daemon=True,
                                                 name="feeder-blend")
                self._growing.start()
            done = int(self.progress[0]) * BLEND_EVERY
        raise sampler.OrderPending(f"computing the mixture's blending over {size:,} positions: {done / size:.0%}")

    def _grow(self, size: int) -> None:
        rows = size // BLEND_EVERY + 1
        table = np.zeros((rows, self.table.shape[1]), dtype=np.int64)
        table[:len(self.table)] = self.table
        self.progress[0] = len(self.table) - 1
        if _native_checkpoints(self.weights, table, BLEND_EVERY, len(self.table) - 1, self.progress):
            raise RuntimeError("stopped: the feeder is shutting down")   # (rows past the stop are not counts)
        self.table = table

    def _grow_in_background(self) -> None:
        try:
            while True:
                with self._lock:
                    size = self._want
                    if self.covers(size):
                        return
                self._grow(size)
        except Exception as e:   # (out of memory, stopped): every waiting rank is told, none waits forever
            self._error = str(e) or type(e).__name__
        finally:
            with self._lock:
                self._growing = None

    def coupled(self, row: int) -> np.ndarray | None:
        """The counts before slot row * BLEND_EVERY without the pass from slot 0 (None: the
        coupling does not apply here; the table must be grown)."""
        with self._lock:
            got = self._coupled.get(row)
            if got is not None:
                self._coupled.move_to_end(row)
                return got
        if _native_couple is None or len(self.weights) > COUPLE_SOURCES or self._uncoupled:
            return None
        target, window = row * BLEND_EVERY, COUPLE_WINDOW
        out = np.empty(len(self.weights), dtype=np.int64)
        while window <= COUPLE_MAX_WINDOW:
            left = _native_couple(self.weights, max(0, target - window), target, out)
            if left == 1:
                with self._lock:
                    self._coupled[row] = out
                    while len(self._coupled) > COUPLED_ROWS:
                        self._coupled.popitem(last=False)
                return out
            if left == 0:
                return None
            window *= 4
        self._uncoupled = True   # (and not tried again at every poll: each try scans ~10^5 slots per candidate)
        return None

    def _row(self, row: int) -> np.ndarray | None:
        return self.table[row] if row < len(self.table) else self.coupled(row)

    def at(self, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(source, draw) of each slot, as blend()'s index and draw arrays hold them."""
        slots = np.ascontiguousarray(slots, dtype=np.int64)
        src, draw = np.empty_like(slots), np.empty_like(slots)
        if not slots.size:
            return src, draw
        if not self.covers(int(slots.max())):
            # Past the table: each slot from its own checkpoint, coupled (slots grouped by row).
            by_row = np.argsort(slots, kind="stable")
            rows = slots[by_row] // BLEND_EVERY
            cuts = np.flatnonzero(np.diff(rows)) + 1
            groups = np.split(by_row, cuts)
            first_rows = rows[np.concatenate([[0], cuts])].tolist()
            states = [self._row(r) for r in first_rows]
            if all(st is not None for st in states):
                for g, r, st in zip(groups, first_rows, states):
                    s, d = np.empty(len(g), np.int64), np.empty(len(g), np.int64)
                    _native_blend_at(self.weights, st[None], BLEND_EVERY, slots[g], s, d, r)
                    src[g], draw[g] = s, d
                return src, draw
        self.ensure(int(slots.max()))
        _native_blend_at(self.weights, self.table, BLEND_EVERY, slots, src, draw)
        return src, draw

    def counts(self, size: int) -> np.ndarray:
        """Each source's slots among the first `size` (blend()'s counts)."""
        row = size // BLEND_EVERY
        start = self._row(row)
        if start is None:
            self.ensure(size)
            start = self.table[row]
        src, _ = self.at(np.arange(row * BLEND_EVERY, size, dtype=np.int64))
        return start + np.bincount(src, minlength=len(self.weights))


_CHECKPOINTS: "OrderedDict[tuple, Checkpoints]" = OrderedDict()


def stop() -> None:
    """SIGTERM: end every blending scan under way (its loop looks at the flag every BLEND_EVERY
    slots) and forget the weight vectors' checkpoints (a later server in this process starts anew)."""
    with _BLEND_LOCK:
        for cp in _CHECKPOINTS.values():
            cp.progress[1] = 1
        _CHECKPOINTS.clear()


def checkpoints(weights: tuple[float, ...]) -> Checkpoints:
    """The weight vector's checkpoints (kept for the last 16 weight vectors)."""
    with _BLEND_LOCK:
        got = _CHECKPOINTS.get(weights)
        if got is None:
            got = _CHECKPOINTS[weights] = Checkpoints(weights)
            while len(_CHECKPOINTS) > 16:
                _CHECKPOINTS.popitem(last=False)
        _CHECKPOINTS.move_to_end(weights)
        return got


def counts_of(weights: tuple[float, ...], size: int) -> np.ndarray:
    """Each source's slots among the first `size` of the blending."""
    if size <= FILL_TABLE_MAX:
        return blend(weights, size)[2]
    return checkpoints(weights).counts(size)


def interleave(weights: tuple[float, ...], slot: int, counts: list[int], n: int) -> list[int]:
    """The topics of slots [slot, slot + n) of a follow-mode mixture's record stream, each topic's
    count of slots before `slot` given in `counts` (advanced in place: the next of a topic's
    records fills each of its slots). Megatron's blending rule over slots without end, the rule
    an epoch's positions follow (slot k goes to the topic with the largest w_d * max(k, 1) -
    count_d, ties to the first), in the same double arithmetic. The counts before slot k are
    themselves a function of the weights and k, so the interleave is a pure function of the
    weights and the slot; a stream carries its counts (each topic's records taken) to go on from
    any slot in O(1), where the checkpoints of a huge epoch answer a slot in up to BLEND_EVERY
    steps each."""
    w, out = [float(x) for x in weights], []
    rest = range(1, len(w))
    for k in range(slot, slot + n):
        at = float(k) if k > 1 else 1.0
        best, err = 0, w[0] * at - counts[0]
        for d in rest:
            e = w[d] * at - counts[d]
            if e > err:
                best, err = d, e
        counts[best] += 1
        out.append(best)
    return out


def source_seed(seed: int, name: str) -> int:
    """The seed of a source's permutations: the job's seed moved by the source's name, so two
    sources of one size draw in different orders."""
    return (seed + int.from_bytes(hashlib.sha256(name.encode()).digest()[:4], "big")) % (1 << 63)


def source_order(n: int, seed: int, name: str, cycle: int, shuffle: bool, kind: str = "", orders=None):
    """The source's `cycle`-th permutation of its n sample ids (identity without shuffle):
    torch.randperm(n) under seed source_seed(seed, name) + cycle, as an epoch's order is.
    Cached with the epoch orders, except small ones: an upsampled small source needs a new
    permutation every n draws, thousands an epoch, and caching those would evict the job's
    epoch orders (256 entries) for permutations cheaper to draw again than to look up."""
    if n < SMALL_SOURCE and shuffle and order.kind_of(kind).materialized:
        return order.make(kind, n, source_seed(seed, name) + cycle)
    return sampler.epoch_order(n, source_seed(seed, name), cycle, shuffle, kind, orders)


SMALL_SOURCE = 1 << 12


def offsets_at(mix: Mixture, epoch: int) -> np.ndarray:
    """Each source's draws made before `epoch` (>= mix.ref_epoch) under this mixture (a source
    dropped from it keeps its counter)."""
    off = np.asarray(mix.offsets, dtype=np.int64)
    if epoch == mix.ref_epoch:
        return off
    k, w = mix.k, mix.weights[:mix.k]
    first = counts_of(w, mix.epoch_samples - mix.mix_base)
    full = counts_of(w, mix.epoch_samples)
    out = off.copy()
    out[:k] += first + (epoch - mix.ref_epoch - 1) * full
    return out


def consumed(mix: Mixture, order) -> np.ndarray:
    """The positions of ref_epoch consumed before a remix, sorted (`order`: that epoch's).
    O(mix_base): the one part of a mixture still linear in its positions (a mid-epoch remix)."""
    return np.sort(np.asarray(order[:mix.mix_base], dtype=np.int64))


def sources_of(mix: Mixture, epoch: int, positions: np.ndarray, done: np.ndarray | None = None, *,
               clip: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """(source index, draw number) of each position of `epoch`. In ref_epoch after a remix,
    `done` is `consumed(mix, that epoch's order)`: the blending's slots skip those positions."""
    positions = np.asarray(positions, dtype=np.int64)
    slots = positions
    size = mix.epoch_samples
    if epoch == mix.ref_epoch and mix.mix_base:
        slots = positions - np.searchsorted(done, positions)   # rank among the unconsumed
        size -= mix.mix_base
        if clip:   # (a consumed position past the last unconsumed one: never served)
            slots = np.minimum(slots, max(size - 1, 0))
    if size <= FILL_TABLE_MAX:
        index, draw, _ = blend(mix.weights[:mix.k], size)
        src, draw = index[slots].astype(np.int64), draw[slots]
    else:   # not materialized: from checkpoints
        src, draw = checkpoints(mix.weights[:mix.k]).at(slots)
    return src, offsets_at(mix, epoch)[src] + draw


def sample_ids(mix: Mixture, sizes: tuple[int, ...], src: np.ndarray, draws: np.ndarray, *, seed: int,
               shuffle: bool, kind: str = "", orders=None) -> np.ndarray:
    """The id within its source of each draw: draw k of source d is source_order(...,
    k // n_d)[k % n_d]."""
    out = np.empty(len(draws), dtype=np.int64)
    for d, n in enumerate(sizes):
        at = np.flatnonzero(src == d)
        if not len(at):
            continue
        k = draws[at]
        lo, hi = int(k.min()) // n, int(k.max()) // n
        if lo == hi:   # a run's draws of a source nearly always lie in one of its permutations
            out[at] = source_order(n, seed, mix.names[d], lo, shuffle, kind, orders)[k - lo * n]
            continue
        cycles, r = np.divmod(k, n)
        if n == 1 or not shuffle:   # every permutation is the identity
            out[at] = r
            continue
        # Grouped by permutation in one sort (a small source upsampled in a large epoch spans
        # thousands: a mask per permutation made this quadratic, seconds per epoch).
        by = np.argsort(cycles, kind="stable")
        cs = cycles[by]
        cuts = [0, *(np.flatnonzero(cs[1:] != cs[:-1]) + 1).tolist(), len(cs)]
        for a, b in zip(cuts[:-1], cuts[1:]):
            sel = by[a:b]
            out[at[sel]] = source_order(n, seed, mix.names[d], int(cs[a]), shuffle, kind, orders)[r[sel]]
    return out


def remixed(old: Mixture, new: Mixture, *, epoch: int, base: int) -> Mixture:
    """The position of `new`'s mixture resumed where `old`'s stood: blending from `base` of
    `epoch`'s global order (the epoch's first position when `epoch` is past the old one's
    last), every source's counter past all the draws the old mixture assigned up to the end
    of the epoch the old cursor stood in. A source new to the mixture starts at 0; one the old
    position had dropped goes on from its kept counter; one the new mixture drops is kept
    (after the mixed ones, weight 0) for a later remix that mixes it in again."""
    stood = epoch if base else epoch - 1          # the last epoch the old mixture assigned draws in
    after = offsets_at(old, stood + 1)
    by_name = dict(zip(old.names, after.tolist()))
    fp_of = dict(zip(old.names, old.fingerprints))
    kept = [n for n in old.names if n not in new.names]
    return Mixture(names=(*new.names, *kept), fingerprints=(*new.fingerprints, *(fp_of[n] for n in kept)),
                   weights=(*new.weights, *(0.0 for _ in kept)),
                   offsets=tuple(by_name.get(n, 0) for n in (*new.names, *kept)), epoch_samples=new.epoch_samples,
                   ref_epoch=epoch, mix_base=base, active=len(new.names) if kept else 0)


# Epochs of up to this many positions get a fill table (16 bytes a position); larger ones are
# filled run by run (sources_of, sample_ids), which costs more CPU and no memory.
FILL_TABLE_MAX = 1 << 24
_FILL_CACHE: "OrderedDict[tuple, tuple[np.ndarray, np.ndarray]]" = OrderedDict()
_FILL_LOCK = threading.Lock()
_FILL_BYTES = 256 << 20
_fill_bytes = 0   # held by _FILL_CACHE (summing its values per insert hashed every key: an
                  # OrderedDict looks each value up by its key, and a Mixture hashes field by field)


def fills(mix: Mixture, epoch: int, sizes: tuple[int, ...], *, seed: int, shuffle: bool, kind: str = "",
          orders=None) -> tuple[np.ndarray, np.ndarray]:
    """(source int64 [N], id int64 [N]): what fills each position of `epoch`, as sources_of and
    sample_ids give it, for every position at once. Cached (every rank of a job shares one), so
    a run of batches costs two takes instead of a pass per source. Positions a remix found
    consumed hold a value that is never served."""
    key = (mix, epoch, sizes, seed, shuffle, kind)
    with _FILL_LOCK:
        hit = _FILL_CACHE.get(key)
        if hit is not None:
            _FILL_CACHE.move_to_end(key)
            return hit
    positions = np.arange(mix.epoch_samples, dtype=np.int64)
    done = None
    if epoch == mix.ref_epoch and mix.mix_base:
        done = consumed(mix, sampler.epoch_order(mix.epoch_samples, seed, epoch, shuffle, kind, orders))
    src, draws = sources_of(mix, epoch, positions, done, clip=True)
    ids = sample_ids(mix, sizes, src, draws, seed=seed, shuffle=shuffle, kind=kind, orders=orders)
    for a in (src, ids):
        a.setflags(write=False)
    global _fill_bytes
    with _FILL_LOCK:
        if key not in _FILL_CACHE:   # another thread may have filled it meanwhile
            _FILL_CACHE[key] = (src, ids)
            _fill_bytes += src.nbytes + ids.nbytes
        while len(_FILL_CACHE) > 2 and _fill_bytes > _FILL_BYTES:
            a, b = _FILL_CACHE.popitem(last=False)[1]
            _fill_bytes -= a.nbytes + b.nbytes
    return src, ids


__all__ = ["normalized", "fills", "blend", "interleave", "source_order", "source_seed", "offsets_at", "consumed", "sources_of", "sample_ids",
           "remixed"]

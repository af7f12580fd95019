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

from feeder import sampler
from feeder.cursor import Mixture

try:
    from feeder._native import blend as _native_blend
except ImportError:  # no C compiler at install: the loop below, ~100x slower
    _native_blend = None


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


def source_seed(seed: int, name: str) -> int:
    """The seed of a source's permutations: the job's seed moved by the source's name, so two
    sources of one size draw in different orders."""
    return (seed + int.from_bytes(hashlib.sha256(name.encode()).digest()[:4], "big")) % (1 << 63)


def source_order(n: int, seed: int, name: str, cycle: int, shuffle: bool) -> np.ndarray:
    """The source's `cycle`-th permutation of its n sample ids (identity without shuffle):
    torch.randperm(n) under seed source_seed(seed, name) + cycle, as an epoch's order is.
    Cached with the epoch orders, except small ones: an upsampled small source needs a new
    permutation every n draws, thousands an epoch, and caching those would evict the job's
    epoch orders (256 entries) for permutations cheaper to draw again than to look up."""
    if n < SMALL_SOURCE:
        return sampler.randperm(n, source_seed(seed, name) + cycle) if shuffle else np.arange(n, dtype=np.int64)
    return sampler.epoch_order(n, source_seed(seed, name), cycle, shuffle)


SMALL_SOURCE = 1 << 12


def offsets_at(mix: Mixture, epoch: int) -> np.ndarray:
    """Each source's draws made before `epoch` (>= mix.ref_epoch) under this mixture (a source
    dropped from it keeps its counter)."""
    off = np.asarray(mix.offsets, dtype=np.int64)
    if epoch == mix.ref_epoch:
        return off
    k, w = mix.k, mix.weights[:mix.k]
    first = blend(w, mix.epoch_samples - mix.mix_base)[2]
    full = blend(w, mix.epoch_samples)[2]
    out = off.copy()
    out[:k] += first + (epoch - mix.ref_epoch - 1) * full
    return out


def consumed(mix: Mixture, order: np.ndarray) -> np.ndarray:
    """The positions of ref_epoch consumed before a remix, sorted (`order`: that epoch's)."""
    return np.sort(order[:mix.mix_base])


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
    index, draw, _ = blend(mix.weights[:mix.k], size)
    src = index[slots].astype(np.int64)
    return src, offsets_at(mix, epoch)[src] + draw[slots]


def sample_ids(mix: Mixture, sizes: tuple[int, ...], src: np.ndarray, draws: np.ndarray, *, seed: int,
               shuffle: bool) -> np.ndarray:
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
            out[at] = source_order(n, seed, mix.names[d], lo, shuffle)[k - lo * n]
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
            out[at[sel]] = source_order(n, seed, mix.names[d], int(cs[a]), shuffle)[r[sel]]
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


def fills(mix: Mixture, epoch: int, sizes: tuple[int, ...], *, seed: int, shuffle: bool
          ) -> tuple[np.ndarray, np.ndarray]:
    """(source int64 [N], id int64 [N]): what fills each position of `epoch`, as sources_of and
    sample_ids give it, for every position at once. Cached (every rank of a job shares one), so
    a run of batches costs two takes instead of a pass per source. Positions a remix found
    consumed hold a value that is never served."""
    key = (mix, epoch, sizes, seed, shuffle)
    with _FILL_LOCK:
        hit = _FILL_CACHE.get(key)
        if hit is not None:
            _FILL_CACHE.move_to_end(key)
            return hit
    positions = np.arange(mix.epoch_samples, dtype=np.int64)
    done = None
    if epoch == mix.ref_epoch and mix.mix_base:
        done = consumed(mix, sampler.epoch_order(mix.epoch_samples, seed, epoch, shuffle))
    src, draws = sources_of(mix, epoch, positions, done, clip=True)
    ids = sample_ids(mix, sizes, src, draws, seed=seed, shuffle=shuffle)
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


__all__ = ["normalized", "fills", "blend", "source_order", "source_seed", "offsets_at", "consumed", "sources_of", "sample_ids",
           "remixed"]

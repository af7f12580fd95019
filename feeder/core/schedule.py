"""Mixture schedules: weights that change with training progress (docs/mixtures.md, "Schedules").

Pure: numpy only. A scheduled mixture is keyed by *progress*: the index of a sample in the job's
global order over all epochs, g = epoch * N + i, where i is its index in the epoch's
DistributedSampler order (what rank i mod W consumes at its step i div W). g counts samples
consumed by the whole job, the same for every rank and for any accumulation, micro-batch or
world size. (Tokens: g * seq_len; a schedule given in tokens is converted once, by `parse`.)

The rule, per source d with weight w_d(x) (normalized) at progress x:

* T_d(x) = the integral of w_d from 0 to x, in closed form per segment: on segment k, active on
  [at_k, at_{k+1}) and ramping linearly from weights a_k at `from_k` to b_k at `until_k`,
  T_d(x) = D_kd + u * (a_kd + u * h_kd) with u = x - from_k, h_kd = (b_kd - a_kd) / (2 (until_k - from_k))
  (0 for a constant segment), and D_kd such that T is continuous at at_k.
* slot j goes to the source with the largest T_d(max(j, 1)) - count_d (its slots before j), ties
  to the first named: Megatron's blending rule, to which a constant schedule reduces bit for bit
  (D = 0, u = x: the same w_d * x).
* the sample is the source's next draw, as in a fixed mixture: draw k of source d is the
  (k mod n_d)-th id of its (k div n_d)-th permutation (feeder.core.blend.sample_ids). Draws run
  on across epochs: a scheduled mixture's slots never restart.

Progress is mapped to slots in blocks of BLOCK: within a block the slots are shuffled (a fixed
permutation per block and seed), so that ranks dealt round robin each see every source; the
blend's own order alternates sources strictly (50/50 over two ranks would give each rank one
source). Every window of BLOCK samples holds the block's blend exactly.

A live change (`spliced`) replaces the schedule from progress P on, P a multiple of BLOCK past
everything any rank was sent: the segments before P keep their coefficients bit for bit (a cut
segment keeps its own ramp), so no slot before P changes, and T_d runs on from its value at P.
"""
from __future__ import annotations

import hashlib
import json
import math
import threading
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from feeder.core.errors import FailedPrecondition, InvalidArgument

try:
    from feeder._native import sched_at as _native_at
    from feeder._native import sched_checkpoints as _native_checkpoints
except ImportError:  # no C compiler at install: the loop below, ~100x slower
    _native_at = _native_checkpoints = None

BLOCK = 256             # progress slots shuffled together (and where a live change may take effect)
EVERY = 4096            # the blending's checkpoint interval (slots)
MAX_SEGMENTS = 256
MAX_HISTORY = MAX_SEGMENTS * 4   # segments of a schedule with its live changes spliced in
MAX_PROGRESS = 1 << 62  # a segment boundary, in samples


@dataclass(frozen=True)
class Segment:
    at: int                       # active from this progress (to the next segment's `at`)
    start: int                    # where its ramp starts (== at unless a live change cut it)
    until: int                    # where its ramp ends (0: a constant segment)
    weights: tuple[float, ...]    # normalized, at `start`
    to: tuple[float, ...]         # normalized, at `until` (== weights when constant)


@dataclass(frozen=True)
class Schedule:
    """A validated schedule over named sources (in order). `version` counts live changes: 0 is
    the schedule the job was started with (`base` is its digest), n the n-th change."""
    names: tuple[str, ...]
    segments: tuple[Segment, ...]
    version: int = 0
    base: str = ""

    def canonical(self) -> str:
        """The schedule as compact JSON, the same bytes on every host (floats as repr)."""
        return json.dumps({"sources": list(self.names), "version": self.version, "base": self.base,
                           "segments": [[s.at, s.start, s.until, list(s.weights), list(s.to)] for s in self.segments]},
                          separators=(",", ":"))

    @property
    def digest(self) -> str:
        """Of the weights alone (not the version): what two schedules are compared on."""
        body = json.dumps([list(self.names), [[s.at, s.start, s.until, list(s.weights), list(s.to)]
                                              for s in self.segments]], separators=(",", ":"))
        return hashlib.sha256(body.encode()).hexdigest()[:32]

    @classmethod
    def from_canonical(cls, text: str) -> "Schedule":
        """What `canonical` wrote (a cursor's, a request's, a record's), checked again."""
        try:
            obj = json.loads(text)
            names = tuple(obj["sources"])
            segs = tuple(Segment(at=int(a), start=int(s), until=int(u), weights=tuple(map(float, w)),
                                 to=tuple(map(float, t))) for a, s, u, w, t in obj["segments"])
            out = cls(names=names, segments=segs, version=int(obj.get("version", 0)), base=str(obj.get("base", "")))
        except (ValueError, KeyError, TypeError) as e:
            raise InvalidArgument(f"mixture_schedule is not a schedule the client wrote: {e}") from None
        _check(out)
        return out

    def coefficients(self) -> tuple[np.ndarray, ...]:
        """(at i8[S], start i8[S], D f8[S, K], a f8[S, K], h f8[S, K]): T_d(x) = D + u (a + u h)."""
        k = len(self.names)
        at = np.array([s.at for s in self.segments], dtype=np.int64)
        start = np.array([s.start for s in self.segments], dtype=np.int64)
        a = np.array([s.weights for s in self.segments], dtype=np.float64).reshape(-1, k)
        h = np.zeros_like(a)
        D = np.zeros_like(a)
        for j, s in enumerate(self.segments):
            if s.until:
                h[j] = (np.asarray(s.to) - np.asarray(s.weights)) / (2.0 * float(s.until - s.start))
        # T continuous: D_j + F_j(at_j - start_j) = T_{j-1}(at_j); the first segment's D is 0.
        for j in range(1, len(self.segments)):
            prev_u = float(at[j] - start[j - 1])
            t_end = D[j - 1] + prev_u * (a[j - 1] + prev_u * h[j - 1])
            u0 = float(at[j] - start[j])
            D[j] = t_end - u0 * (a[j] + u0 * h[j])
        return at, start, D, a, h

    def weights_at(self, x: int) -> np.ndarray:
        """w_d(x), normalized."""
        s = self.segments[segment_of(self, x)]
        if not s.until:
            return np.asarray(s.weights)
        f = min(max((x - s.start) / (s.until - s.start), 0.0), 1.0)
        return np.asarray(s.weights) + f * (np.asarray(s.to) - np.asarray(s.weights))

    def target(self, x: int) -> np.ndarray:
        """T_d(x): each source's share of the first x slots, as the blend tracks it."""
        at, start, D, a, h = self.coefficients()
        j = segment_of(self, x)
        u = float(max(x, 1) - start[j]) if x else 0.0
        return D[j] + u * (a[j] + u * h[j])

    def shown(self) -> str:
        parts = []
        for s in self.segments:
            w = ",".join(f"{n}={v:.3g}" for n, v in zip(self.names, s.weights))
            if s.until:
                w += " -> " + ",".join(f"{n}={v:.3g}" for n, v in zip(self.names, s.to)) + f" by {s.until:,}"
            parts.append(f"from {s.at:,}: {w}")
        return "; ".join(parts)


def segment_of(schedule: Schedule, x: int) -> int:
    j = 0
    for k, s in enumerate(schedule.segments):
        if s.at <= x:
            j = k
    return j


def _normalized(weights: dict, names: tuple[str, ...], where: str) -> tuple[float, ...]:
    if not isinstance(weights, dict) or not weights:
        raise InvalidArgument(f"{where}: weights must be a table of source = weight, got {weights!r:.80}")
    unknown = [n for n in weights if n not in names]
    if unknown:
        raise InvalidArgument(f"{where}: source {unknown[0]!r} is not one of the schedule's sources {list(names)} "
                              "(the first segment, or `sources`, names them)")
    w = []
    for n in names:
        v = weights.get(n, 0.0)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
            raise InvalidArgument(f"{where}: the weight of {n!r} must be a finite number >= 0, got {v!r:.40}")
        w.append(float(v))
    try:
        total = math.fsum(w)
    except OverflowError:
        total = math.inf
    if not math.isfinite(total):
        raise InvalidArgument(f"{where}: weights too large to add up (their sum overflows a float), got "
                              f"{weights!r:.80}; scale them down (only their ratios count)")
    if total <= 0:
        raise InvalidArgument(f"{where}: weights must not all be 0, got {weights!r:.80}")
    return tuple((np.asarray(w, dtype=np.float64) / np.sum(np.asarray(w, dtype=np.float64))).tolist())


def parse(obj, *, seq_len: int = 0) -> Schedule:
    """A schedule from its TOML/dict form:

        unit = "samples"            # or "tokens" (converted with seq_len, rounded up)
        sources = ["web", "code"]   # optional: the first segment's names, in its order
        [[segment]]                 # constant until 10^6 samples
        until = 1_000_000
        weights = {web = 0.7, code = 0.3}
        [[segment]]                 # linear from these weights to `to` by 2 * 10^6
        until = 2_000_000
        weights = {web = 0.7, code = 0.3}
        to = {web = 0.2, code = 0.8}
        [[segment]]                 # the last: constant, without end
        weights = {web = 0.2, code = 0.8}

    `obj` may also be a list of segments (the [[segment]] tables)."""
    if isinstance(obj, Schedule):
        return obj
    if isinstance(obj, (list, tuple)):
        obj = {"segment": list(obj)}
    if not isinstance(obj, dict):
        raise InvalidArgument(f"mixture_schedule must be a table with [[segment]]s (or a TOML file of one), got "
                              f"{type(obj).__name__}")
    extra = set(obj) - {"unit", "sources", "segment", "segments"}
    if extra:
        raise InvalidArgument(f"mixture_schedule has unknown keys {sorted(extra)}; it takes unit, sources and "
                              "[[segment]] tables")
    unit = obj.get("unit", "samples")
    if unit not in ("samples", "tokens"):
        raise InvalidArgument(f"mixture_schedule unit must be samples or tokens, got {unit!r:.40}")
    if unit == "tokens" and seq_len <= 0:
        raise InvalidArgument("a schedule in tokens needs the stream's seq_len to convert it (seq_len= in the "
                              "client, --seq-len on the command line)")
    segs = obj.get("segment", obj.get("segments"))
    if not isinstance(segs, list) or not segs:
        raise InvalidArgument("mixture_schedule needs at least one [[segment]] with weights")
    if len(segs) > MAX_SEGMENTS:
        raise InvalidArgument(f"mixture_schedule has {len(segs)} segments; at most {MAX_SEGMENTS}")
    names = obj.get("sources")
    if names is None:
        first = segs[0].get("weights") if isinstance(segs[0], dict) else None
        if not isinstance(first, dict) or not first:
            _normalized(first, (), "mixture_schedule segment 1")   # (says what the weights must be)
        names = list(first)
    if not isinstance(names, (list, tuple)) or not names or not all(isinstance(n, str) and n for n in names) \
            or len(set(names)) != len(names):
        raise InvalidArgument(f"mixture_schedule sources must be distinct source names, got {names!r:.80}")
    names = tuple(names)
    out, at = [], 0
    for k, seg in enumerate(segs):
        where = f"mixture_schedule segment {k + 1}"
        if not isinstance(seg, dict) or set(seg) - {"until", "weights", "to"}:
            raise InvalidArgument(f"{where}: a segment has weights, and optionally until and to, got {seg!r:.80}")
        last = k == len(segs) - 1
        until = seg.get("until")
        if until is None and not last:
            raise InvalidArgument(f"{where}: every segment but the last needs `until` (where it ends)")
        if until is not None:
            if isinstance(until, bool) or not isinstance(until, int) or until <= 0 or until > MAX_PROGRESS:
                raise InvalidArgument(f"{where}: until must be a positive whole number of {unit}, got {until!r:.40}")
            if unit == "tokens":
                until = -(-until // seq_len)
            if until <= at:
                raise InvalidArgument(f"{where}: until ({until:,} samples) must be past where it starts ({at:,})")
        w = _normalized(seg.get("weights"), names, where)
        to = w
        if "to" in seg:
            if until is None or last:
                raise InvalidArgument(f"{where}: the last segment has no end, so it cannot ramp to `to`; end it with "
                                      "`until` and add a constant segment after it")
            to = _normalized(seg["to"], names, where)
        ramp = until if to != w else 0
        out.append(Segment(at=at, start=at, until=ramp or 0, weights=w, to=to))
        at = until if until is not None else at
    sched = Schedule(names=names, segments=tuple(out))
    return Schedule(names=names, segments=sched.segments, version=0, base=sched.digest)


def _check(s: Schedule) -> None:
    k = len(s.names)
    if len(s.segments) > MAX_HISTORY:
        raise InvalidArgument(f"mixture_schedule: a job's schedule holds at most {MAX_HISTORY} segments over all its "
                              f"live changes, this one {len(s.segments)} (a change splices its segments in after "
                              "those already in force): change it with fewer segments, or start a new job")
    if not s.segments or s.segments[0].at != 0:
        raise InvalidArgument("mixture_schedule: the first segment must start at 0")
    prev = -1
    for seg in s.segments:
        if seg.at <= prev or seg.start > seg.at or (seg.until and seg.until <= seg.start) \
                or len(seg.weights) != k or len(seg.to) != k:
            raise InvalidArgument("mixture_schedule: segments out of order or of another number of sources")
        for w in (seg.weights, seg.to):
            if not all(math.isfinite(v) and v >= 0 for v in w) or not 0.999 < math.fsum(w) < 1.001:
                raise InvalidArgument("mixture_schedule: weights must be normalized and >= 0")
        prev = seg.at
    if s.segments[-1].until and s.segments[-1].weights != s.segments[-1].to:
        pass   # (a cut ramp stays a ramp past its end only if a later segment follows: checked by use)


def check_spec(text, names: tuple[str, ...], remix: bool) -> None:
    """A stream's mixture_schedule (its canonical JSON), with the `mixture` and `remix` it came with."""
    if not isinstance(text, str) or len(text) > 1 << 20:
        raise InvalidArgument("mixture_schedule must be a schedule's JSON of at most 1 MiB")
    sched = Schedule.from_canonical(text)
    if names != sched.names:
        raise InvalidArgument(f"a scheduled mixture names its sources in `mixture` as its schedule does: the "
                              f"schedule has {list(sched.names)}, mixture has {list(names)}")
    if remix:
        raise InvalidArgument("remix does not apply to a scheduled mixture: change its schedule from a position "
                              "on instead (feeder mix), which every rank follows without a restart")


def spliced(old: Schedule, new: Schedule, at: int) -> Schedule:
    """`old` up to progress `at`, `new` from there (version old.version + 1). The sources must be
    the same, in the same order."""
    if new.names != old.names:
        raise InvalidArgument(f"a live change keeps the mixture's sources {list(old.names)} in their order, got "
                              f"{list(new.names)}")
    if at % BLOCK:
        raise ValueError("a change takes effect at a block boundary")
    before = [s for s in old.segments if s.at < at] or [old.segments[0]]
    after = []
    for j, s in enumerate(new.segments):
        end = new.segments[j + 1].at if j + 1 < len(new.segments) else None
        if end is not None and end <= at:
            continue
        after.append(s if s.at >= at else Segment(at=at, start=s.start, until=s.until, weights=s.weights, to=s.to))
    if at == 0:
        before = []
    out = Schedule(names=old.names, segments=tuple(before + after), version=old.version + 1, base=old.base)
    _check(out)
    return out


def diverges(a: Schedule, b: Schedule) -> int | None:
    """The first progress (a block boundary) from which `a` and `b` may draw differently; None:
    they never do. T_d at x depends only on the segments that start at or before x, so two
    schedules draw alike up to their first differing segment (a live change's point)."""
    if a.names != b.names:
        return 0
    for x, y in zip(a.segments, b.segments):
        if x != y:
            return min(x.at, y.at) // BLOCK * BLOCK
    if len(a.segments) == len(b.segments):
        return None
    longer = a if len(a.segments) > len(b.segments) else b
    return longer.segments[min(len(a.segments), len(b.segments))].at // BLOCK * BLOCK


def shifted(s: Schedule, by: int) -> Schedule:
    """The schedule moved `by` samples later (a live change given relative to where it takes effect)."""
    return Schedule(names=s.names, version=s.version, base=s.base, segments=tuple(
        Segment(at=g.at + by, start=g.start + by, until=g.until + by if g.until else 0, weights=g.weights, to=g.to)
        for g in s.segments))


# ---- progress -> slot: a fixed shuffle within each block ---------------------------------------------------------

_M = np.uint64(0xFFFFFFFFFFFFFFFF)


def _splitmix(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        z = x + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def block_perms(seed: int, blocks: np.ndarray) -> np.ndarray:
    """int64 [len(blocks), BLOCK]: row j holds the slots of block blocks[j] (offsets in it), in
    the order its progress indexes take them: the offsets sorted by splitmix64(offset + key),
    key = splitmix64(seed ^ splitmix64(block)), in uint64 arithmetic."""
    with np.errstate(over="ignore"):
        key = _splitmix(np.uint64(seed % (1 << 64)) ^ _splitmix(np.asarray(blocks, dtype=np.uint64)))
        keys = _splitmix(np.arange(BLOCK, dtype=np.uint64)[None, :] + key[:, None])
    return np.argsort(keys, axis=1, kind="stable").astype(np.int64)


def slots_of(progress: np.ndarray, seed: int, cache: dict | None = None) -> np.ndarray:
    """The blend slot of each progress index (a bijection within each block). `cache` keeps a
    stream's recent blocks' permutations (a run touches a few)."""
    progress = np.asarray(progress, dtype=np.int64)
    blocks, off = np.divmod(progress, BLOCK)
    ub, inv = np.unique(blocks, return_inverse=True)
    if cache is None or len(ub) > 64:
        perms = block_perms(seed, ub)
    else:
        todo = [b for b in ub.tolist() if b not in cache]
        if todo:
            for b, row in zip(todo, block_perms(seed, np.asarray(todo, dtype=np.int64))):
                cache[b] = row
            while len(cache) > 256:
                cache.pop(next(iter(cache)))
        perms = np.stack([cache[b] for b in ub.tolist()])
    return blocks * BLOCK + perms[inv.reshape(-1), off]


# ---- the blending: each source's count every EVERY slots, grown as far as a job needs ---------------------------

INLINE = 1 << 26          # slots scanned while the rank waits (~0.3 s at 8 sources); more in the background
TABLE_MAX_BYTES = 1 << 30


class Pending(Exception):
    """The blending up to a slot is being computed in the background (the plan yields PENDING)."""


class Blending:
    """A schedule's blending at any slot. Row r of `table` holds each source's count before slot
    r * EVERY: one pass from slot 0 (C, ~1-3 ns a slot and source) fills it once per schedule, for
    every rank of every job that uses it; a slot is then answered from its row, at most EVERY steps."""

    def __init__(self, schedule: Schedule):
        self.schedule = schedule
        self.coef = schedule.coefficients()
        self.k = len(schedule.names)
        self.table = np.zeros((1, self.k), dtype=np.int64)
        self.progress = np.zeros(2, dtype=np.int64)
        self._lock = threading.Lock()
        self._growing: threading.Thread | None = None
        self._want = 0
        self._error = ""

    def covers(self, slot: int) -> bool:
        return slot // EVERY < len(self.table)

    def ensure(self, slot: int) -> None:
        if self.covers(slot):
            return
        need = (slot // EVERY + 1) * self.k * 8
        if need > TABLE_MAX_BYTES:
            raise FailedPrecondition(f"a scheduled mixture's blending up to progress {slot:,} would take "
                                     f"{need / 2**30:.1f} GiB of checkpoints (the limit is "
                                     f"{TABLE_MAX_BYTES / 2**30:.0f} GiB)")
        if self._error:
            raise FailedPrecondition(f"the mixture schedule's blending could not be computed: {self._error}",
                                     elsewhere=True)
        with self._lock:
            if self.covers(slot):
                return
            have = (len(self.table) - 1) * EVERY
            if slot - have <= INLINE and self._growing is None:
                self._grow(slot)
                return
            self._want = max(self._want, slot)
            if self._growing is None:
                self._growing = threading.Thread(target=self._grow_in_background, daemon=True, name="feeder-blend")
                self._growing.start()
            done = int(self.progress[0]) * EVERY
        raise Pending(f"computing the mixture schedule's blending up to progress {slot:,}: {done / slot:.0%}")

    def _grow(self, slot: int) -> None:
        rows = slot // EVERY + 1
        table = np.zeros((rows, self.k), dtype=np.int64)
        table[:len(self.table)] = self.table
        self.progress[0] = len(self.table) - 1
        if _native_checkpoints is not None:
            if _native_checkpoints(*self.coef, table, EVERY, len(self.table) - 1, self.progress):
                raise RuntimeError("stopped: the feeder is shutting down")
        else:
            count = table[len(self.table) - 1].copy()
            for r in range(len(self.table), rows):
                _py_scan(self.coef, count, (r - 1) * EVERY, r * EVERY, None)
                table[r] = count
        self.table = table

    def _grow_in_background(self) -> None:
        try:
            while True:
                with self._lock:
                    want = self._want
                    if self.covers(want):
                        return
                self._grow(want)
        except Exception as e:
            self._error = str(e) or type(e).__name__
        finally:
            with self._lock:
                self._growing = None

    def at(self, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(source, draw) of each slot: its source, and that source's slots before it."""
        slots = np.asarray(slots, dtype=np.int64)
        src, draw = np.empty_like(slots), np.empty_like(slots)
        if not slots.size:
            return src, draw
        self.ensure(int(slots.max()))
        by = np.argsort(slots, kind="stable")
        ordered = np.ascontiguousarray(slots[by])
        s, d = np.empty_like(ordered), np.empty_like(ordered)
        if _native_at is not None:
            _native_at(*self.coef, self.table, EVERY, ordered, s, d)
        else:
            for row in np.unique(ordered // EVERY).tolist():
                at = np.flatnonzero(ordered // EVERY == row)
                count = self.table[row].copy()
                _py_scan(self.coef, count, row * EVERY, int(ordered[at[-1]]) + 1, (ordered[at], at, s, d))
        src[by], draw[by] = s, d
        return src, draw

    def counts(self, slot: int) -> np.ndarray:
        """Each source's slots before `slot` (the shares so far)."""
        self.ensure(slot)
        row = slot // EVERY
        count = self.table[row].copy()
        if slot % EVERY:
            src, _ = self.at(np.arange(row * EVERY, slot, dtype=np.int64))
            count += np.bincount(src, minlength=self.k)
        return count


def _py_scan(coef, count: np.ndarray, i: int, end: int, want) -> None:
    """The C loop's arithmetic in Python (no C extension): counts before `end` from those before
    i; `want` = (ascending slots, their indexes, src out, draw out)."""
    at, start, D, a, h = coef
    k = len(count)
    c = [int(x) for x in count]
    wi = 0
    for j in range(i, end):
        g = int(np.searchsorted(at, j, side="right")) - 1
        u = float(max(j, 1) - int(start[g]))
        best, err = 0, None
        for d in range(k):
            e = (float(D[g, d]) + u * (float(a[g, d]) + u * float(h[g, d]))) - float(c[d])
            if err is None or e > err:
                best, err = d, e
        if want is not None:
            slots, idx, so, dv = want
            while wi < len(slots) and slots[wi] == j:
                so[idx[wi]], dv[idx[wi]] = best, c[best]
                wi += 1
        c[best] += 1
    count[:] = c


_BLENDINGS: "OrderedDict[str, Blending]" = OrderedDict()
_BLENDINGS_LOCK = threading.Lock()


def blending(schedule: Schedule) -> Blending:
    """The schedule's blending, shared (the last 16 schedules)."""
    key = schedule.digest
    with _BLENDINGS_LOCK:
        got = _BLENDINGS.get(key)
        if got is None:
            got = _BLENDINGS[key] = Blending(schedule)
            while len(_BLENDINGS) > 16:
                _BLENDINGS.popitem(last=False)
        _BLENDINGS.move_to_end(key)
        return got


def stop() -> None:
    """SIGTERM: end every scan under way."""
    with _BLENDINGS_LOCK:
        for b in _BLENDINGS.values():
            b.progress[1] = 1
        _BLENDINGS.clear()


__all__ = ["BLOCK", "Schedule", "Segment", "parse", "spliced", "slots_of", "block_perms", "segment_of", "Blending", "blending", "Pending", "stop"]

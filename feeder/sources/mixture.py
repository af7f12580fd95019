"""A mixture of a feeder's named sources, served as one stream (`MixtureSource`, `MixturePlan`).

The positions of an epoch are dealt by a StreamPlan over N = epoch_samples virtual samples
(so DistributedSampler, cursors, resume, reshard and DataLoader workers are exactly those of
one dataset); this plan then says, per position, which source fills it and with which of its
samples (feeder.mixture has the rules), and locates the rows in that source. Runs carry the
source of each sample (`PlannedRun.sources`), which reaches the rank as `batch.sources`.
"""
from __future__ import annotations

import bisect
import dataclasses
import hashlib
from typing import Iterator

import numpy as np

from feeder.core import blend as mx
from feeder.core import sampler
from feeder.core.config import StreamSpec
from feeder.core.cursor import Cursor, Mixture, Scheduled
from feeder.core.errors import DataLoss, FailedPrecondition, NotFound, WrongReplica
from feeder.core.planning import PENDING, PlanBase, PlannedRun, Start, StreamPlan
from feeder.core.rows import Rows
from feeder.core.layout import Bounds
from feeder.sources import NO_CONTEXT, ChunkTable, Context, PerJob, packed_samples
from feeder.sources.posix import locate_bounds, locate_rows


# A scheduled mixture's plan (feeder.sources.scheduled.ScheduledPlan, which builds on MixturePlan
# below): registered by that module when it is imported (the engine does), as position kinds are.
SCHEDULED_PLAN = None


def packed_fingerprint(names, tables) -> str:
    """A packed mixture's fingerprint (its cursors'): of its sources' packings, so a cursor of
    concat samples never resumes it."""
    return "mix-" + hashlib.sha256("\0".join(f"{n}\0{t.fingerprint}" for n, t in zip(names, tables)).encode()
                                   ).hexdigest()[:32]


def shown_mixture(names, weights) -> str:
    return ",".join(f"{n}={w:.6g}" for n, w in zip(names, weights))


def check_fit(names, parts) -> None:
    """The sources of a mixture share one vocabulary, EOS and token dtype, or it is refused."""
    first = parts[0]
    for name, src in zip(names, parts):
        for what in ("vocab_size", "eos_id", "dtype"):
            if getattr(src, what) != getattr(first, what):
                raise FailedPrecondition(
                    f"mixture source {name!r} has {what} {getattr(src, what)}, but {names[0]!r} has "
                    f"{getattr(first, what)}: the sources of a mixture must share one "
                    f"{'token dtype' if what == 'dtype' else 'tokenizer'}")


class Joined:
    """The sources of a mixture as one chunk table, end to end (source d's token t is token
    base[d] + t here), so a block's rows from every source are located in one pass
    (posix.locate_rows) rather than one per source and a merge."""

    def __init__(self, names, parts):
        self.names, self.parts, self.dtype = names, parts, parts[0].dtype
        self.base = [0]
        for p in parts:
            self.base.append(self.base[-1] + p.n_tokens)
        self.n_tokens = self.base[-1]
        self.base_np = np.asarray(self.base[:-1], dtype=np.int64)
        self._owner = [(d, k) for d, p in enumerate(parts) for k in range(len(p.chunk_starts) - 1)]
        self.chunk_starts = np.concatenate([p.chunk_starts[:-1] + b for p, b in zip(parts, self.base)]
                                         + [np.asarray([self.n_tokens], dtype=np.int64)])

    def chunk(self, k: int) -> np.ndarray:
        d, local = self._owner[k]
        try:
            return self.parts[d].chunk(local)
        except DataLoss as e:   # sources' shards often share names: say whose it is
            raise DataLoss(f"mixture source {self.names[d]!r}: {e}") from None

    def doc_starts(self, k: int) -> np.ndarray:
        d, local = self._owner[k]
        return self.parts[d].doc_starts(local) + self.base[d]

    def read(self, start: int, out: np.ndarray) -> None:
        d = bisect.bisect_right(self.base, start) - 1
        try:
            self.parts[d].read(start - self.base[d], out)
        except DataLoss as e:
            raise DataLoss(f"mixture source {self.names[d]!r}: {e}") from None


class MixtureSource:
    """The sources a mixture names, as served here. Sources on files are checked to fit together
    at once; a bounded Kafka topic's data is fixed only when a job starts (a `PerJob` source), so
    a stream's plan first takes the job's epoch of each (its snapshot, built once), and the
    blending starts from their sizes then. Tailed (follow-mode) topics are mixed only with each
    other, record by record: their own plan (kafka/mixed.py)."""

    def __init__(self, mixture: tuple[tuple[str, float], ...], sources: dict):
        missing = [n for n, _ in mixture if n not in sources]
        if missing:
            raise NotFound(f"mixture source {missing[0]!r} is not served here (served: {sorted(sources)})",
                           elsewhere=True)
        self.names = tuple(n for n, _ in mixture)
        self.served = [sources[n] for n in self.names]
        self.weights = mx.normalized([w for _, w in mixture])
        self.name = "+".join(self.names)
        tailed = [isinstance(p, PerJob) and p.tailed for p in self.served]
        if any(tailed) and not all(tailed):
            followed = self.names[tailed.index(True)]
            fixed = self.names[tailed.index(False)]
            raise FailedPrecondition(
                f"mixture source {followed!r} is a followed Kafka topic (mode=follow) and {fixed!r} is not: a "
                "followed topic is mixed only with other followed topics (record by record); bounded topics and "
                "files are mixed with each other (by epoch positions)")
        self.tailed = bool(tailed) and all(tailed)
        # Without a source a job fixes, the parts are the same for every stream: checked now.
        self.fixed = None if any(isinstance(p, PerJob) for p in self.served) else \
            MixtureParts(self.names, self.weights, self.served, tuple(p.fingerprint for p in self.served))
        # Info (a Source's): of the parts where they are fixed; else a job's plan has them (0: unknown yet)
        info = self.fixed or self.served[0]
        self.vocab_size, self.eos_id, self.dtype = info.vocab_size, info.eos_id, info.dtype
        self.fingerprint = self.fixed.fingerprint if self.fixed else ""
        self.n_tokens = self.fixed.n_tokens if self.fixed else 0
        self.n_documents = self.fixed.n_documents if self.fixed else 0

    def plan(self, spec: StreamSpec, cursor: Cursor | None, ctx: Context = NO_CONTEXT):
        """A stream's plan: its parts (each bounded topic's epoch for the job: the cursor's, or
        the one agreed for the job), then the blending over their sizes. May block."""
        if self.tailed:
            if spec.mixture_schedule:
                raise FailedPrecondition("a mixture of followed Kafka topics (mode=follow) is interleaved record by "
                                         "record without epochs; a schedule applies to files and bounded topics")
            return self.served[0].interleave(self.names, self.weights, self.served, spec, cursor)
        if self.fixed is not None:
            return self.fixed.plan(spec, cursor, ctx)
        pinned = {}
        if cursor is not None and type(cursor.src) in (Mixture, Scheduled):
            pinned = dict(zip(cursor.src.names, cursor.src.fingerprints))
        parts, keys, held, skipped = [], [], [], 0
        try:
            for name, src in zip(self.names, self.served):
                if isinstance(src, PerJob):
                    key, part = src.epoch(spec, pinned.get(name, ""))
                    held.append((src, src.hold(spec.job, key)))
                    skipped += part.bad_records
                else:
                    key, part = src.fingerprint, src
                parts.append(part)
                keys.append(key)
            plan = MixtureParts(self.names, self.weights, parts, tuple(keys)).plan(spec, cursor, ctx)
        except BaseException:
            for src, token in held:
                src.release(spec.job, token)
            raise
        plan.held, plan.bad_records = held, skipped   # (as a topic served alone reports its epoch's)
        return plan

    def close(self) -> None:
        """The parts are the feeder's own sources: they close with it."""


class MixtureParts:
    """The sources of a mixture as one job reads them, checked to fit together (one vocabulary,
    EOS and dtype). `keys` name each in a cursor: its fingerprint, or a Kafka epoch's ranges (what
    rebuilds it anywhere); the mixture's fingerprint is of the parts' data."""

    def __init__(self, names: tuple[str, ...], weights: tuple[float, ...], parts: list, keys: tuple[str, ...]):
        self.names, self.weights, self.parts = names, weights, parts
        check_fit(names, parts)
        first = self.parts[0]
        self.fingerprints = keys
        self.fingerprint = "mix-" + hashlib.sha256(
            "\0".join(f"{n}\0{p.fingerprint}" for n, p in zip(self.names, self.parts)).encode()).hexdigest()[:32]
        self.name = "+".join(self.names)
        self.vocab_size, self.eos_id, self.dtype = first.vocab_size, first.eos_id, first.dtype
        self.n_tokens = sum(p.n_tokens for p in self.parts)
        self.n_documents = sum(p.n_documents for p in self.parts)
        # Sources on files are chunk tables, joined so a block is located in one pass; a source
        # that only says where rows lie (the Source seam's least) is asked source by source.
        self.joined = Joined(self.names, self.parts) if all(isinstance(p, ChunkTable) for p in self.parts) else None

    def tables(self, spec: StreamSpec, ctx: Context = NO_CONTEXT) -> list | None:
        """Each source's samples under the stream's packing (feeder.sources.packed_samples), or
        None for concat (the sources' own windows)."""
        tables = [packed_samples(p, spec, ctx) for p in self.parts]
        return None if tables[0] is None else tables

    def sizes(self, seq_len: int, tables: list | None = None) -> tuple[int, ...]:
        """Each source's samples at seq_len (in `tables`, a packing's); a source too small for one is refused."""
        sizes = tuple(t.n_samples for t in tables) if tables is not None else \
            tuple(sampler.n_samples(p.n_tokens, seq_len) for p in self.parts)
        for name, n, p in zip(self.names, sizes, self.parts):
            if n == 0:
                raise FailedPrecondition(f"mixture source {name!r} has {p.n_tokens} tokens, too few for one sample "
                                         f"of seq_len + 1 = {seq_len + 1} tokens")
        return sizes

    def plan(self, spec: StreamSpec, cursor: Cursor | None, ctx: Context = NO_CONTEXT) -> "MixturePlan":
        if spec.expected_fingerprint and spec.expected_fingerprint != self.fingerprint:
            raise WrongReplica(f"mixture fingerprint mismatch: the job expects {spec.expected_fingerprint}, this "
                               f"feeder's sources {self.name!r} make {self.fingerprint}; refusing to serve other data")
        if spec.mixture_schedule:
            if SCHEDULED_PLAN is None:
                raise FailedPrecondition("this feeder cannot serve a scheduled mixture (feeder.sources.scheduled is "
                                         "not loaded)", elsewhere=True)
            return SCHEDULED_PLAN(self, spec, cursor, ctx)
        return MixturePlan(self, spec, cursor, ctx)


class MixturePlan(PlanBase):
    """One rank's stream over a mixture (a `Plan`)."""

    held: list = []      # (source, token) of each bounded topic's epoch the stream keeps agreed

    def __init__(self, src: MixtureParts, spec: StreamSpec, cursor: Cursor | None, ctx: Context = NO_CONTEXT):
        self.orders = ctx.orders     # where large torch orders come from (the epoch's and the sources')
        packed = src.tables(spec, ctx)
        self.sizes = src.sizes(spec.seq_len, packed)
        n = spec.epoch_samples or sum(self.sizes)   # (the request's, or the sources' samples summed)
        spec = dataclasses.replace(spec, epoch_samples=n)
        self.src, self.spec = src, spec
        self.n, self.fingerprint, self.dtype = n, src.fingerprint, src.dtype
        # Where each source's samples lie: the sources themselves, or their bins. A packed
        # mixture's fingerprint (the cursor's) is of its sources' packings, so a cursor of concat
        # samples never resumes it; the cursor still names each source by its key (a bounded
        # topic's by its epoch's ranges: what rebuilds that epoch on any feeder).
        self.tables = src.parts
        if packed is not None:
            self.tables = packed
            self.fingerprint = packed_fingerprint(src.names, self.tables)
        # Counters from epoch 0: a stream that starts at epoch e draws what epoch e of a run
        # from epoch 0 draws.
        want = Mixture(names=src.names, fingerprints=src.fingerprints, weights=src.weights,
                       offsets=(0,) * len(src.names), epoch_samples=n, ref_epoch=0, mix_base=0)
        self.mix, remix = (want, False) if cursor is None else self._resume(cursor, want)
        if remix:   # the cursor's fingerprint is the old mixture's; each source's was checked above
            cursor = dataclasses.replace(cursor, fingerprint=self.fingerprint)
        # A remix re-deals as reshard does, so the cursor may name another world size (and the
        # plan checks the rest of the cursor before the re-deal below reads its fields).
        # (the sources' permutations are orders too: the largest decides which torch releases agree)
        self.inner = StreamPlan(dataclasses.replace(spec, reshard=True) if remix else spec,
                                n_tokens=n * spec.seq_len + 1, fingerprint=self.fingerprint, cursor=cursor, src=self.mix,
                                largest=max(self.sizes), orders=ctx.orders)
        self.spec = dataclasses.replace(spec, permutation=self.inner.spec.permutation)
        if remix:
            self.mix, self.inner.start = self._remix(cursor, cursor.src, want)
            self.inner.src = self.mix
        self.start = self.inner.start
        self.waiting = ""
        self._done = None   # after a remix: the positions of its epoch consumed before it

    def _resume(self, c: Cursor, want: Mixture) -> tuple[Mixture, bool]:
        """The mixture position a cursor resumes, and whether the stream remixes from it."""
        old = c.src
        if type(old) is not Mixture:
            raise FailedPrecondition("cursor does not fit this stream: it was written for one dataset, "
                                     "this stream asks for a mixture")
        if old.epoch_samples != want.epoch_samples:
            raise FailedPrecondition(f"cursor does not fit this stream: epoch_samples differs: the cursor has "
                                     f"{old.epoch_samples}, the request has {want.epoch_samples}")
        theirs = dict(zip(old.names, old.fingerprints))
        for name, fp in zip(want.names, want.fingerprints):
            if name in theirs and theirs[name] != fp:
                raise FailedPrecondition(
                    f"cursor does not fit this stream: source {name!r} has another fingerprint here: the cursor "
                    f"has {theirs[name]}, this feeder's {fp}", elsewhere=True)
        mixed = (old.names[:old.k], old.weights[:old.k])
        if mixed == (want.names, want.weights):
            return old, False
        if not self.spec.remix:
            raise FailedPrecondition(
                f"cursor does not fit this stream: mixture differs: the cursor has "
                f"{shown_mixture(*mixed)}, the request has {shown_mixture(want.names, want.weights)}"
                " (set remix to continue under the new mixture)")
        return want, True

    def _remix(self, c: Cursor, old: Mixture, want: Mixture) -> tuple[Mixture, Start]:
        """The position and start of a remix: the epoch's unconsumed positions are re-dealt from
        where reshard would re-deal them."""
        s, n = self.spec, want.epoch_samples
        if c.pos >= sampler.per_rank(n - c.base, c.world_size, s.drop_last):
            return (mx.remixed(old, want, epoch=c.epoch + 1, base=0),
                    Start(epoch=c.epoch + 1, base=0, world=s.world_size, pos=0, step=0))
        base = sampler.reshard_base(n=n, base=c.base, world=c.world_size, pos=c.pos)
        return mx.remixed(old, want, epoch=c.epoch, base=base), Start(epoch=c.epoch, base=base, world=s.world_size,
                                                                      pos=0, step=c.step)

    def runs(self, max_batches: int = 64) -> Iterator[PlannedRun]:
        for run in self.inner.runs(max_batches):
            if run is PENDING:   # the epoch's order is being built
                self.waiting = self.inner.waiting
                yield run
                continue
            while True:   # a source's permutation, or the blending of a huge epoch, being built
                try:
                    src, ids = self._fill(run)
                    break
                except sampler.OrderPending as e:
                    self.waiting = str(e)
                    yield PENDING
            self.waiting = ""
            yield dataclasses.replace(run, ids=ids, sources=src, positions=run.ids)   # (an elastic run's step fields too)

    def _fill(self, run: PlannedRun) -> tuple[np.ndarray, np.ndarray]:
        """(source, id within it) of each position of the run."""
        s, mix = self.spec, self.mix
        if self.n <= mx.FILL_TABLE_MAX:   # the epoch's table, shared by the job's ranks: two takes
            src, ids = mx.fills(mix, run.epoch, self.sizes, seed=s.seed, shuffle=s.shuffle, kind=s.permutation,
                                orders=self.orders)
            return src[run.ids], ids[run.ids]
        if run.epoch == mix.ref_epoch and mix.mix_base and self._done is None:   # once per stream
            self._done = mx.consumed(mix, sampler.epoch_order(self.n, s.seed, run.epoch, s.shuffle, s.permutation,
                                                              self.orders))
        src, draws = mx.sources_of(mix, run.epoch, run.ids, self._done)
        return src, mx.sample_ids(mix, self.sizes, src, draws, seed=s.seed, shuffle=s.shuffle, kind=s.permutation,
                                  orders=self.orders)

    def locate(self, starts: np.ndarray, n: int, sources: np.ndarray | None = None) -> Rows:
        """Where each row lies: `starts` are within each row's own source."""
        joined = self.src.joined
        if joined is not None and self.tables is self.src.parts:
            return locate_rows(joined, starts + joined.base_np[sources], n)
        bufs: list[np.ndarray] = []
        which = np.empty(len(starts), dtype=np.int64)
        offs = np.empty(len(starts), dtype=np.int64)
        for d in np.unique(sources).tolist():   # each source's Rows, merged
            at = np.flatnonzero(sources == d)
            rows = self.tables[d].locate(starts[at], n)
            if not isinstance(rows, Rows):
                rows = Rows.of(rows)
            which[at] = rows.which + len(bufs)
            offs[at] = rows.offs
            bufs += rows.bufs
        return Rows(bufs, which, offs, n)

    def boundaries(self, starts: np.ndarray, n: int, sources: np.ndarray | None = None) -> Bounds:
        """Where documents start inside each row (`starts` within each row's own source)."""
        joined = self.src.joined
        if joined is not None and self.tables is self.src.parts:
            return locate_bounds(joined, starts + joined.base_np[sources], n)
        order = np.argsort(sources, kind="stable")   # each source's, then back in the rows' order
        parts = [self.tables[d].boundaries(starts[sources == d], n) for d in np.unique(sources).tolist()]
        b = Bounds.join(parts)
        ptr = b.ptr()
        inv = np.empty_like(order)
        inv[order] = np.arange(len(order))
        from feeder.core.layout import ranges

        at = ranges(ptr[:-1][inv], b.counts[inv])
        return Bounds(b.counts[inv], b.lengths[inv], b.starts[at])

    def cursor_template(self) -> Cursor:
        return self.inner.cursor_template()

    def close(self) -> None:
        for src, token in self.held:
            src.release(self.spec.job, token)

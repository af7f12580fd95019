"""A scheduled mixture's stream (`ScheduledPlan`): weights that change with training progress.

The deal is a fixed mixture's (DistributedSampler, reshard, elastic steps: a StreamPlan over N
positions per epoch), but over *progress*: the plan deals the indexes of the epoch's global
order (identity), and index i of epoch e is progress g = e * N + i, which
feeder.core.schedule maps to a blend slot and a (source, draw); a source's draws are its own
permutations, as a fixed mixture's are (feeder.core.blend.sample_ids). So the samples are a pure
function of the schedule and progress, the same on any feeder, for any world or accumulation.

A live change (feeder.domain.schedules) swaps the job's schedule from a progress P past every
run planned; runs take the job's schedule as they are planned, and their cursors carry it.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from feeder.core import blend as mx
from feeder.core import order, sampler
from feeder.core import schedule as sc
from feeder.core.config import StreamSpec
from feeder.core.cursor import Cursor, Scheduled
from feeder.core.errors import FailedPrecondition
from feeder.core.planning import PENDING, PlannedRun, StreamPlan
from feeder.sources import NO_CONTEXT, Context
from feeder.sources import mixture
from feeder.sources.mixture import MixturePlan, packed_fingerprint


RUN_BATCHES = 16


class ProgressPlan(StreamPlan):
    """A StreamPlan whose epochs' order is the identity: its runs' ids are indexes in the
    epoch's global order (what a scheduled mixture is keyed by), whatever `shuffle` says (the
    sources' permutations shuffle the samples)."""

    def _order(self, epoch: int, early: bool):
        return order.Identity(self.n)
        yield   # (a generator, as StreamPlan's: it never waits)


class _Alone:
    """A job's schedule where no server keeps its live changes (feeder.domain.schedules): tools,
    tests, audit. The schedule the stream asks for, or a later one a cursor carries."""

    hold = None

    def __init__(self, schedule: sc.Schedule):
        self.schedule = schedule

    @property
    def version(self) -> int:
        return self.schedule.version

    def take(self, upto: int) -> sc.Schedule:
        return self.schedule

    def adopt(self, newer: sc.Schedule) -> None:
        if newer.version > self.schedule.version:
            self.schedule = newer


class _NoBooks:
    def book(self, job: str, base: sc.Schedule) -> _Alone:
        return _Alone(base)


def _books(ctx: Context):
    """The server's books of live changes (Context.schedules), or a plan's own schedule alone."""
    got = getattr(ctx, "schedules", None)
    return got if got is not None else _NoBooks()


class ScheduledPlan(MixturePlan):
    """One rank's stream over a scheduled mixture (a `Plan`)."""

    def __init__(self, src, spec: StreamSpec, cursor: Cursor | None, ctx: Context = NO_CONTEXT):
        self.orders = ctx.orders
        packed = src.tables(spec, ctx)
        self.sizes = src.sizes(spec.seq_len, packed)
        n = spec.epoch_samples or sum(self.sizes)
        spec = dataclasses.replace(spec, epoch_samples=n)
        self.src, self.spec, self.n, self.dtype = src, spec, n, src.dtype
        self.tables = src.parts if packed is None else packed
        self.fingerprint = src.fingerprint if packed is None else packed_fingerprint(src.names, packed)
        base = sc.Schedule.from_canonical(spec.mixture_schedule)
        self.book = _books(ctx).book(spec.job, base)
        theirs = self._resume(cursor, base) if cursor is not None else None
        self.schedule = self.book.schedule
        self.pos = self._position(self.schedule)
        self.inner = ProgressPlan(spec, n_tokens=n * spec.seq_len + 1, fingerprint=self.fingerprint, cursor=cursor,
                                  src=self.pos, largest=max(self.sizes), orders=None)
        self.spec = dataclasses.replace(spec, permutation=self.inner.spec.permutation)
        if theirs is not None:   # (only a cursor the inner plan found to be of this stream: job, seed, ...)
            self._take_schedule_of(cursor, theirs)
        self.start = self.inner.start
        self.waiting = ""
        self._perms: dict = {}
        self._named = _Names(src.names)
        self._template: Cursor | None = None
        self.reached = 0   # progress below which this stream has planned (exclusive)

    def _position(self, schedule: sc.Schedule) -> Scheduled:
        return Scheduled(names=self.src.names, fingerprints=self.src.fingerprints, epoch_samples=self.n,
                         schedule=schedule.canonical())

    def _resume(self, c: Cursor, base: sc.Schedule) -> sc.Schedule:
        """The cursor's schedule, once its mixture is this stream's."""
        got = c.src
        if type(got) is not Scheduled:
            raise FailedPrecondition("cursor does not fit this stream: it was not written for a scheduled mixture, and "
                                     "this stream asks for one (a fixed mixture's cursor cannot continue under a schedule)")
        if got.names != self.src.names or got.epoch_samples != self.n:
            raise FailedPrecondition(f"cursor does not fit this stream: the cursor's scheduled mixture has sources "
                                     f"{list(got.names)} and {got.epoch_samples} positions an epoch, this stream "
                                     f"{list(self.src.names)} and {self.n}")
        for name, theirs, ours in zip(got.names, got.fingerprints, self.src.fingerprints):
            if theirs != ours:
                raise FailedPrecondition(f"cursor does not fit this stream: source {name!r} has another fingerprint "
                                         f"here: the cursor has {theirs}, this feeder's {ours}", elsewhere=True)
        theirs = sc.Schedule.from_canonical(got.schedule)
        if theirs.base != base.base:
            raise FailedPrecondition(f"cursor does not fit this stream: its job started from another mixture schedule "
                                     f"(digest {theirs.base}) than this stream asks for ({base.base})")
        return theirs

    def _take_schedule_of(self, c: Cursor, theirs: sc.Schedule) -> None:
        """A later schedule a cursor carries is the job's from now on (a change this feeder
        missed); an earlier one must not have been served past the change since."""
        if theirs.version > self.book.version:
            self.book.adopt(theirs)
            self.schedule = self.book.schedule
            self.pos = self.inner.src = self._position(self.schedule)
        elif theirs.version < self.book.version:
            self._check_behind(c, theirs)
        elif theirs.digest != self.book.schedule.digest:
            raise FailedPrecondition(f"cursor does not fit this stream: its mixture schedule version {theirs.version} "
                                     f"differs from this feeder's version {self.book.version} of job "
                                     f"{self.spec.job!r} (two changes under one number)")

    def runs(self, max_batches: int = 64):
        # (short runs: a live change takes effect past everything planned, so planning far ahead
        # of what is sent would put it later than it need be)
        for run in self.inner.runs(min(max_batches, RUN_BATCHES)):
            if run is PENDING:
                yield run
                continue
            while True:
                try:
                    src, ids, schedule = self._fill_scheduled(run)
                    break
                except (sc.Pending, sampler.OrderPending) as e:
                    self.waiting = str(e)
                    yield PENDING
            self.waiting = ""
            cursors = run.cursors
            if schedule is not self.schedule:   # a live change: this run's cursors carry the new schedule
                self.schedule, self.pos = schedule, self._position(schedule)
                self.inner.src = self.pos
            if self.pos is not self._template_src:
                cursors = self._cursors(run)
            yield dataclasses.replace(run, ids=ids, sources=src, positions=run.ids, cursors=cursors)

    @property
    def _template_src(self):
        return None if self._template is None else self._template.src

    def cursor_template(self) -> Cursor:
        self._template = self.inner.cursor_template()
        return self._template

    def _check_behind(self, c: Cursor, theirs: sc.Schedule) -> None:
        """A cursor of a schedule before this feeder's: the rank must not have been sent anything
        past the change's point (it would have been drawn under the old schedule, by a feeder that
        did not know the change: Book.adopt). Its last sample, where the cursor names it (a
        DistributedSampler dealing: index base + (rank + (pos-1)*world) mod (N - base))."""
        d = sc.diverges(theirs, self.book.schedule)
        if d is None or self.spec.elastic or c.pos <= 0 or c.base >= self.n:
            return
        last = c.epoch * self.n + c.base + (c.rank + (c.pos - 1) * c.world_size) % (self.n - c.base)
        if last >= d:
            raise FailedPrecondition(
                f"cursor does not fit this stream: it was written under mixture schedule version {theirs.version} "
                f"after progress {last:,}, past change {self.book.version} at {d:,} that job {self.spec.job!r} made "
                "there: a feeder that did not know the change served this rank the old mixture past its point; "
                f"resume every rank from a checkpoint taken before progress {d:,}")

    def _check_switch(self, schedule: sc.Schedule) -> None:
        """A live change reaches this stream: it must not have planned past the change's point
        (the hold of feeder mix sees to it). It has only when the change came from a rank's
        cursor to a feeder that never heard of it (Book.adopt): what this stream sent past the
        point was drawn under the old schedule, so it ends rather than go on under the new."""
        d = sc.diverges(self.schedule, schedule)
        if d is not None and self.reached > d:
            raise FailedPrecondition(
                f"job {self.spec.job!r}: this rank was sent progress up to {self.reached:,} under mixture schedule "
                f"version {self.schedule.version}, past change {schedule.version} at progress {d:,} that this feeder "
                "learned only later from another rank's cursor (feeder mix did not target it, and it did not start "
                "after the change was recorded in its cache directory); resume every rank from a checkpoint taken "
                f"before progress {d:,}")

    def _cursors(self, run: PlannedRun) -> tuple[Cursor, ...]:
        if run.cursors is not None:   # (an elastic run's)
            return tuple(dataclasses.replace(c, src=self.pos) for c in run.cursors)
        t = self._template or self.inner.cursor_template()
        return tuple(dataclasses.replace(t, world_size=run.world, epoch=run.epoch, base=run.base, pos=int(stop),
                                         step=run.step + j + 1, src=self.pos)
                     for j, stop in enumerate(run.stops.tolist()))

    def _fill_scheduled(self, run: PlannedRun) -> tuple[np.ndarray, np.ndarray, sc.Schedule]:
        """(source, id within it) of each sample of the run, and the schedule they were drawn under."""
        g = run.epoch * self.n + run.ids
        upto = int(g.max()) + 1 if len(g) else 0
        schedule = self.book.take(upto)
        if schedule is not self.schedule:
            self._check_switch(schedule)
        self.reached = max(self.reached, upto)
        slots = sc.slots_of(g, self.spec.seed, self._perms)
        src, draws = sc.blending(schedule).at(slots)
        s = self.spec
        ids = mx.sample_ids(self._named, self.sizes, src, draws, seed=s.seed, shuffle=s.shuffle, kind=s.permutation,
                            orders=self.orders)
        return src, ids, schedule


@dataclasses.dataclass(frozen=True)
class _Names:
    names: tuple[str, ...]


mixture.SCHEDULED_PLAN = ScheduledPlan

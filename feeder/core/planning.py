"""A rank's stream as runs of planned batches: ids and the cursor after each.

No threads, no I/O: the arithmetic of where a stream starts (fresh, resumed, or re-dealt
to another world size) and which ids each batch holds. It sits in the core, below both
`feeder.sources` and `feeder.pipeline`, because every source makes the plans of its streams
(`Source.plan`) and must not import the pipeline that consumes them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import dataclasses

import numpy as np

from feeder.core import order, sampler, steps
from feeder.core.config import StreamSpec
from feeder.core.cursor import Cursor, Position
from feeder.core.errors import FailedPrecondition
from feeder.core.sampling_key import CURSOR, DEAL, cursor_mismatch


@dataclass(frozen=True)
class Start:
    epoch: int
    base: int
    world: int
    pos: int
    step: int


@dataclass(frozen=True)
class ElasticStart:
    """Where an elastic stream starts: global step `step` of `epoch`; under shrink, at position
    `pos` of every rank's list in segment (base, world); its first `skip` parts already delivered."""
    epoch: int
    step: int
    base: int
    world: int
    pos: int
    skip: int


@dataclass(frozen=True)
class PlannedBatch:
    epoch: int
    step: int
    ids: np.ndarray        # int64 [k]
    cursor: Cursor         # resume right after this batch
    samples_in_epoch: int  # this rank's total for the epoch (for progress)
    tokens: np.ndarray | None = None   # set by plans that read tokens themselves (Kafka follow)


class Pending:
    """What a plan yields when its next run is not ready yet (a tailed topic has no new record):
    the pipeline sends what it has built and asks again. A plan of a fixed dataset never does."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "PENDING"


PENDING = Pending()


@dataclass(frozen=True)
class PlannedRun:
    """Consecutive batches of one epoch, column-wise: batch j holds positions
    [stops[j-1], stops[j]) of the rank's list (the first from `start`) and has step step + j.

    `tokens` and `cursors` are set only by a plan that reads its samples itself and whose
    position is not (epoch, base, pos, step) alone (Kafka follow); otherwise the pipeline reads
    the rows where `Plan.locate` says they lie, and writes the cursors from the columns."""
    epoch: int
    base: int
    world: int
    start: int
    step: int
    ids: np.ndarray        # int64 [stops[-1] - start]
    stops: np.ndarray      # int64 [k]: the rank's position after each batch (its cursor's pos)
    samples_in_epoch: int
    tokens: np.ndarray | None = None          # [len(ids), seq_len + 1], read by the plan
    cursors: tuple[Cursor, ...] | None = None  # [k], written by the plan
    sources: np.ndarray | None = None          # int64 [len(ids)]: a mixture's source of each sample,
    positions: np.ndarray | None = None        # and the epoch position it fills (for the ledger)
    # An elastic stream's (feeder.core.steps): int64 [k, 5], per batch this replica's micro-batches
    # in the step, the batch's index among them, the whole step's samples, and the base and
    # position of the cursor after the step. Every batch of the run is of global step `step` then
    # (one run is one step's part).
    elastic: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.stops)

    def one(self, j: int) -> "PlannedRun":
        """Batch j alone, as a run."""
        return self._part(j, j + 1)

    def split(self, k: int) -> tuple["PlannedRun", "PlannedRun"]:
        """The first k batches, and the rest."""
        return self._part(0, k), self._part(k, len(self))

    def _part(self, i: int, j: int) -> "PlannedRun":
        """Batches i..j-1, as a run (views of this run's arrays)."""
        a = (int(self.stops[i - 1]) if i else self.start) - self.start   # their samples: [a, b)
        b = int(self.stops[j - 1]) - self.start if j > i else a
        tok, cur, src, at, el = self.tokens, self.cursors, self.sources, self.positions, self.elastic
        return PlannedRun(epoch=self.epoch, base=self.base, world=self.world, start=self.start + a,
                          step=self.step + (i if el is None else 0), ids=self.ids[a:b], stops=self.stops[i:j],
                          elastic=None if el is None else el[i:j],
                          samples_in_epoch=self.samples_in_epoch, tokens=None if tok is None else tok[a:b],
                          cursors=None if cur is None else cur[i:j], sources=None if src is None else src[a:b],
                          positions=None if at is None else at[a:b])


class PlanBase:
    """What every plan has unless it says otherwise (feeder.sources.Plan is what each must do).

    A plan derives from this and overrides what differs: Kafka's follow plan brings its own
    thread (`executor`), lag and skipped records, and passes `taken` on to a consumer group;
    an order being built says so in `waiting`."""

    executor = None      # the thread messages are built on: None, the shared pool (nothing here blocks)
    bad_records = 0      # records skipped under bad_records=skip (Kafka)
    waiting = ""         # why the next run is not ready, for the rank to hear ("": nothing to say)

    @property
    def lag(self) -> dict[int, int]:
        """{partition: records behind the topic's end} (Kafka follow)."""
        return {}

    def taken(self, step: int) -> None:
        """The rank's training loop has taken the batch of `step` (Kafka: group commits)."""

    def close(self) -> None:
        """The stream ended: let go of what the plan holds (a reader thread, a register entry)."""


class StreamPlan(PlanBase):
    """The plan of a rank's stream over a fixed dataset of n_tokens tokens (a `Plan`).

    `data` is where the rows lie (its `locate(starts, n)` and `dtype`: a PosixSource, or the
    snapshot of a Kafka epoch); None for plans used only for their arithmetic (tests, audit)."""

    def __init__(self, spec: StreamSpec, *, n_tokens: int, fingerprint: str, cursor: Cursor | None,
                 src: Position = None, data=None, largest: int = 0, n_samples: int = 0, orders=None):
        self.fingerprint = fingerprint
        self.orders = orders         # where large torch orders come from (feeder.sources.Context)
        self.src = src               # carried in every cursor (Kafka bounded: the frozen epoch, KafkaEpoch)
        self.data = data
        self.dtype = data.dtype if data is not None else np.dtype(np.uint32)
        # (n_samples: a layout of its own, best-fit bins; else concat windows of the tokens)
        self.n = n_samples or sampler.n_samples(n_tokens, spec.seq_len)
        if self.n == 0:
            raise FailedPrecondition(f"the dataset has {n_tokens} tokens, too few for one sample of "
                                     f"seq_len + 1 = {spec.seq_len + 1} tokens")
        if sampler.per_rank(self.n, spec.start_replicas or spec.world_size, spec.drop_last) == 0:
            what = (f"the mixture's epoch_samples is {self.n}" if spec.mixture else
                    f"the dataset yields {self.n} samples of seq_len {spec.seq_len}")
            raise FailedPrecondition(f"{what}, fewer than world_size {spec.world_size}: with drop_last every rank "
                                     "would get none")
        # The permutation as it decides this stream's samples (feeder.order.agreed): ranks and
        # cursors are compared on it, so torch releases that draw the same orders here agree.
        # `largest`: the largest permutation the stream draws (a mixture's sources' too).
        self.largest = max(largest, self.n)
        self.spec = spec = dataclasses.replace(spec, permutation=order.agreed(spec.permutation, self.largest,
                                                                               spec.shuffle))
        if spec.shuffle and order.kind_of(spec.permutation).needs_c and order.why_not_served("torch"):
            raise FailedPrecondition(order.why_not_served("torch"), elsewhere=True)
        self.waiting = ""   # why the next run is not ready (an order being built), for the rank
        self.start = self._elastic_start(cursor) if spec.elastic else self._start(cursor)

    def _start(self, c: Cursor | None) -> Start:
        s = self.spec
        if c is None:
            return Start(epoch=s.epoch, base=0, world=s.world_size, pos=0, step=0)
        c = dataclasses.replace(c, permutation=self._cursor_permutation(c))
        wrong = cursor_mismatch(c, s, self.fingerprint)
        if wrong is not None:
            raise wrong
        self._check_position(c)
        # reshard re-deals what is left of the epoch over a new world size, from where the old
        # ranks stood (in lockstep). A cursor of a dealing over this very world size already
        # names that place in it, for every rank: they go on in that dealing. Re-dealing it
        # would start a new segment, whose padding comes from another place in the order
        # (soak seed 600466: a resharded rank's new pass, with reshard still set, began its
        # own segment 6 steps ahead of the others, and its last batch differed from the one
        # the feeder had served for that step; `feeder audit` found the conflict).
        if s.reshard and c.world_size != s.world_size:
            if c.pos >= sampler.per_rank(self.n - c.base, c.world_size, s.drop_last):
                # The old dealing ran to its end, and so did the epoch: what drop_last left out
                # of it stays out, as in an uninterrupted run, rather than be dealt again.
                return Start(epoch=c.epoch + 1, base=0, world=s.world_size, pos=0, step=0)
            base = sampler.reshard_base(n=self.n, base=c.base, world=c.world_size, pos=c.pos)
            return Start(epoch=c.epoch, base=base, world=s.world_size, pos=0, step=c.step)
        return Start(epoch=c.epoch, base=c.base, world=c.world_size, pos=c.pos, step=c.step)

    def _elastic_start(self, c: Cursor | None) -> "ElasticStart":
        """Where an elastic stream starts: global step first_step (constant: a pure function of
        it; shrink: step 0, or where the cursor after the last committed step says), or inside
        a step whose first parts the cursor's stream already delivered (a broken stream resumed)."""
        s, n = self.spec, self.n
        mb, steps_of = s.micro_batch, s.micro_batch * s.accumulation
        if s.global_batch == "constant":
            spe = steps.steps_per_epoch(sampler.per_rank(n, s.start_replicas, s.drop_last), mb, s.accumulation)
            step, skip = s.first_step, 0
            if c is not None:
                self._check_elastic_cursor(c)
                step, skip = c.step, c.pos
                if skip and (c.world_size, c.rank) != (s.world_size, s.rank):
                    raise self._mid_step(c)
            return ElasticStart(epoch=s.epoch + step // spe, step=step, base=0, world=s.world_size, pos=0, skip=skip)
        if c is None:
            if s.first_step:
                raise FailedPrecondition(
                    f"global_batch=shrink: where step {s.first_step} begins depends on the worlds of the steps "
                    "committed before it, and no cursor was sent and none was recorded for this job: send the cursor "
                    "after the last committed step (ElasticFeeder.commit records it with the feeders)")
            return ElasticStart(epoch=s.epoch, step=0, base=0, world=s.world_size, pos=0, skip=0)
        self._check_elastic_cursor(c)
        epoch, base, pos, skip = c.epoch, c.base, c.pos, 0
        per = sampler.per_rank(n - base, c.world_size, s.drop_last)
        if pos % steps_of and pos < per:   # inside a step: only its own stream goes on in it
            if (c.world_size, c.rank) != (s.world_size, s.rank):
                raise self._mid_step(c)
            skip, pos = pos % steps_of // mb, pos - pos % steps_of
        elif c.world_size != s.world_size:   # a new world from the last committed step on
            base, pos = sampler.reshard_base(n=n, base=base, world=c.world_size, pos=pos), 0
        if pos >= sampler.per_rank(n - base, s.world_size, s.drop_last):   # the epoch ended with that step
            epoch, base, pos = epoch + 1, 0, 0
        return ElasticStart(epoch=epoch, step=c.step, base=base, world=s.world_size, pos=pos, skip=skip)

    def _check_elastic_cursor(self, c: Cursor) -> None:
        c = dataclasses.replace(c, permutation=self._cursor_permutation(c))
        wrong = cursor_mismatch(c, self.spec, self.fingerprint, fields=tuple(f for f in CURSOR if f not in DEAL))
        if wrong is not None:
            raise wrong
        if not 0 <= c.rank < c.world_size or c.base > self.n:
            raise FailedPrecondition("cursor does not fit this stream: it names no place in it "
                                     f"(rank {c.rank} of {c.world_size}, base {c.base} of {self.n} samples)")

    def _mid_step(self, c: Cursor) -> FailedPrecondition:
        s = self.spec
        return FailedPrecondition(
            f"cursor does not fit this stream: it is inside step {c.step} as replica {c.rank} of {c.world_size}, and "
            f"this stream is replica {s.rank} of {s.world_size}; a step is dealt again whole when the world changes: "
            f"ask step {c.step} without a cursor (constant) or with the cursor after the last committed step (shrink)")

    def _cursor_permutation(self, c: Cursor) -> str:
        """The cursor's permutation as it decides this stream's orders (as the spec's is)."""
        try:
            return order.agreed(c.permutation, self.largest, c.shuffle)
        except FailedPrecondition as e:
            if c.permutation:   # a kind this feeder does not know: a newer feeder's
                raise
            raise FailedPrecondition(
                f"cursor does not fit this stream: it was written before feeders recorded which torch randperm drew "
                f"its order, and at {self.largest:,} samples torch releases disagree (2.7 changed it); restart the "
                "epoch without the cursor, or resume on the feeder release that wrote it") from e

    def _check_position(self, c: Cursor) -> None:
        """A cursor that fits the stream but names no place in it (only a hand-made one can,
        under the deployment's secret) is refused rather than served as an empty stream."""
        why = None
        if not 0 <= c.rank < c.world_size:
            why = f"rank {c.rank} of world_size {c.world_size}"
        elif c.base > self.n:
            why = f"base {c.base} past the epoch's {self.n} samples"
        elif c.pos > (per := sampler.per_rank(self.n - c.base, c.world_size, self.spec.drop_last)):
            why = f"position {c.pos} past the rank's {per} samples"
        elif c.step > self.n:   # (after a reshard pos restarts at 0 and step goes on: not bounded by pos)
            why = f"step {c.step} past the epoch's {self.n} samples"
        if why is not None:
            raise FailedPrecondition(f"cursor does not fit this stream: it names no place in it ({why})")

    def locate(self, starts: np.ndarray, n: int):
        """Where rows [starts[i], starts[i] + n) of the dataset lie (Rows, or the tokens)."""
        return self.data.locate(starts, n)

    def boundaries(self, starts: np.ndarray, n: int):
        """Where documents start inside those rows (feeder.layout.Bounds)."""
        return self.data.boundaries(starts, n)

    def runs(self, max_batches: int = 64) -> Iterator["PlannedRun"]:
        """The stream as runs of up to `max_batches` consecutive batches of one epoch, each
        planned with one vectorized sampler call (the feeder's fast path reads, checksums and
        frames a run at a time). An elastic stream's runs are its parts of successive steps."""
        if self.spec.elastic:
            yield from self._step_runs()
            return
        s, n, mb = self.spec, self.n, self.spec.micro_batch
        epoch, end = self.start.epoch, s.end_epoch
        while epoch < end:
            ids_of = yield from self._order(epoch, early=True)
            ahead = epoch + 1 >= end   # the next epoch's order asked for (or none to ask for)
            if epoch == self.start.epoch:
                base, world, pos, step = self.start.base, self.start.world, self.start.pos, self.start.step
            else:
                base, world, pos, step = 0, s.world_size, 0, 0
            per = sampler.per_rank(n - base, world, s.drop_last)
            while pos < per:
                if isinstance(ids_of, sampler.Early):   # the whole takes over once it is built
                    try:
                        ids_of = sampler.epoch_order(n, s.seed, epoch, s.shuffle, s.permutation, self.orders,
                                                     early=True)
                    except sampler.OrderPending:
                        pass
                if not ahead and not isinstance(ids_of, sampler.Early):
                    # The next epoch's order is built while this one is served, once this one is
                    # whole: not beside its build (two orders' memory at once: outside review).
                    sampler.prepare_order(n, s.seed, epoch + 1, s.shuffle, s.permutation, self.orders)
                    ahead = True
                stop = min(pos + max_batches * mb, per)
                # The early part of an order still being built holds the first batches; past it, the whole.
                stop = sampler.reach(ids_of, base=base, world=world, rank=s.rank, start=pos, stop=stop, per_batch=mb)
                if stop == pos:
                    ids_of = yield from self._order(epoch, early=False)
                    continue
                ids = sampler.rank_ids(ids_of, base=base, world=world, rank=s.rank, drop_last=s.drop_last,
                                       start=pos, stop=stop)
                # Batch j ends at pos + (j + 1) * mb; only an epoch's last batch may be short.
                stops = np.array([*range(pos + mb, stop, mb), stop], dtype=np.int64)   # (see rank_ids)
                yield PlannedRun(epoch=epoch, base=base, world=world, start=pos, step=step, ids=ids, stops=stops,
                                 samples_in_epoch=per)
                step += len(stops)
                pos = stop
            epoch += 1

    def _step_runs(self) -> Iterator["PlannedRun"]:
        """This replica's parts of steps start.step, start.step + 1, ... (feeder.core.steps), a run each."""
        s, n, st = self.spec, self.n, self.start
        epoch, step, base, pos, skip = st.epoch, st.step, st.base, st.pos, st.skip
        deal = dict(replica=s.rank, replicas=s.world_size, micro_batch=s.micro_batch, accumulation=s.accumulation,
                    drop_last=s.drop_last)
        while epoch < s.end_epoch:
            ids_of = yield from self._order(epoch, early=False)
            if s.global_batch == "constant":
                spe = steps.steps_per_epoch(sampler.per_rank(n, s.start_replicas, s.drop_last), s.micro_batch,
                                            s.accumulation)
                for t in range(step - (epoch - s.epoch) * spe, spe):
                    part = steps.constant_part(ids_of, n=n, epoch=epoch, t=t, step=step, start_replicas=s.start_replicas,
                                               **deal)
                    yield self._step_run(part, skip, base=0, pos=0, spe=spe)
                    step, skip = step + 1, 0
            else:
                per = sampler.per_rank(n - base, s.world_size, s.drop_last)
                while pos < per:
                    part = steps.shrink_part(ids_of, n=n, epoch=epoch, base=base, pos=pos, step=step, **deal)
                    yield self._step_run(part, skip, base=base, pos=pos)
                    step, skip, pos = step + 1, 0, pos + sum(part.counts)
                base, pos = 0, 0
            epoch += 1

    def _step_run(self, part: "steps.Part", skip: int, *, base: int, pos: int, spe: int = 0) -> "PlannedRun":
        """One step's part as a run, with the cursor after each of its batches: inside the step
        (resumed only by this replica of this world), or after it (the next step's start: the
        cursor a shrink job's next step begins from once this one commits)."""
        s, k = self.spec, len(part.counts)
        stops = np.cumsum(part.counts, dtype=np.int64)
        cursors = []
        for j in range(k):
            if j + 1 < k:
                at = dict(epoch=part.epoch, step=part.step, pos=j + 1 if spe else pos + int(stops[j]))
            elif spe:   # constant: the next step's epoch follows from its number
                at = dict(epoch=s.epoch + (part.step + 1) // spe, step=part.step + 1, pos=0)
            else:
                at = dict(epoch=part.epoch, step=part.step + 1, pos=pos + int(stops[j]))
            cursors.append(Cursor(job=s.job, fingerprint=self.fingerprint, seed=s.seed, shuffle=s.shuffle,
                                  drop_last=s.drop_last, seq_len=s.seq_len, world_size=s.world_size, rank=s.rank,
                                  base=base, src=self.src, permutation=s.permutation, **at))
        # (base and the position after the step, as the cursor after it says: which dealing of the
        # step this is, for the ledger; constant has one, shrink one per chain of committed worlds)
        elastic = np.empty((k, 5), dtype=np.int64)
        elastic[:, 0], elastic[:, 1], elastic[:, 2] = part.parts, np.arange(k), part.step_samples
        elastic[:, 3], elastic[:, 4] = base, cursors[-1].pos
        run = PlannedRun(epoch=part.epoch, base=base, world=s.world_size, start=0, step=part.step, ids=part.ids,
                         stops=stops, samples_in_epoch=self.n, cursors=tuple(cursors), elastic=elastic)
        return run if not skip else run._part(skip, k)

    def _order(self, epoch: int, early: bool):
        """The epoch's order (with `early`, maybe only its first positions: sampler.Early),
        yielding PENDING while it is being built: the rank is told so, and asks again."""
        s = self.spec
        while True:
            try:
                got = sampler.epoch_order(self.n, s.seed, epoch, s.shuffle, s.permutation, self.orders, early=early)
                break
            except sampler.OrderPending as e:
                self.waiting = str(e)
                yield PENDING
        self.waiting = ""
        return got

    def batches(self) -> Iterator[PlannedBatch]:
        s = self.spec
        for run in self.runs():
            at = run.start
            for j, stop in enumerate(run.stops.tolist()):
                cursor = Cursor(job=s.job, fingerprint=self.fingerprint, seed=s.seed, shuffle=s.shuffle,
                                drop_last=s.drop_last, seq_len=s.seq_len, world_size=run.world, rank=s.rank,
                                epoch=run.epoch, base=run.base, pos=stop, step=run.step + j + 1, src=self.src,
                                permutation=s.permutation)
                yield PlannedBatch(epoch=run.epoch, step=run.step + j, ids=run.ids[at - run.start:stop - run.start],
                                   cursor=cursor, samples_in_epoch=run.samples_in_epoch)
                at = stop

    def cursor_template(self) -> Cursor:
        """A cursor with this stream's fixed fields (for CursorWriter)."""
        s = self.spec
        return Cursor(job=s.job, fingerprint=self.fingerprint, seed=s.seed, shuffle=s.shuffle, drop_last=s.drop_last,
                      seq_len=s.seq_len, world_size=s.world_size, rank=s.rank, epoch=0, base=0, pos=0, step=0,
                      src=self.src, permutation=s.permutation)

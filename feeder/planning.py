"""A rank's stream as a sequence of planned batches: ids and the cursor after each.

No threads, no I/O: the arithmetic of where a stream starts (fresh, resumed, or re-dealt
to another world size) and which ids each batch holds. It sits below both `feeder.sources`
and `feeder.pipeline` (which re-exports it as `feeder.pipeline.plan`) because a source may
plan its own streams (Kafka) and must not import the pipeline that consumes it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import numpy as np

from feeder import sampler
from feeder.config import StreamSpec
from feeder.cursor import Cursor
from feeder.errors import FailedPrecondition


@dataclass(frozen=True)
class Start:
    epoch: int
    base: int
    world: int
    pos: int
    step: int


@dataclass(frozen=True)
class PlannedBatch:
    epoch: int
    step: int
    ids: np.ndarray        # int64 [k]
    cursor: Cursor         # resume right after this batch
    samples_in_epoch: int  # this rank's total for the epoch (for progress)
    tokens: np.ndarray | None = None   # set by plans that read tokens themselves (Kafka follow)


@dataclass(frozen=True)
class PlannedRun:
    """Consecutive batches of one epoch, column-wise: batch j holds positions
    [stops[j-1], stops[j]) of the rank's list (the first from `start`) and has step step + j."""
    epoch: int
    base: int
    world: int
    start: int
    step: int
    ids: np.ndarray        # int64 [stops[-1] - start]
    stops: np.ndarray      # int64 [k]: the rank's position after each batch (its cursor's pos)
    samples_in_epoch: int

    def __len__(self) -> int:
        return len(self.stops)

    def split(self, k: int) -> tuple["PlannedRun", "PlannedRun"]:
        """The first k batches, and the rest."""
        cut = int(self.stops[k - 1])
        head = PlannedRun(epoch=self.epoch, base=self.base, world=self.world, start=self.start, step=self.step,
                          ids=self.ids[:cut - self.start], stops=self.stops[:k], samples_in_epoch=self.samples_in_epoch)
        tail = PlannedRun(epoch=self.epoch, base=self.base, world=self.world, start=cut, step=self.step + k,
                          ids=self.ids[cut - self.start:], stops=self.stops[k:], samples_in_epoch=self.samples_in_epoch)
        return head, tail


class StreamPlan:
    def __init__(self, spec: StreamSpec, *, n_tokens: int, fingerprint: str, cursor: Cursor | None,
                 src: str = ""):
        self.spec = spec
        self.fingerprint = fingerprint
        self.src = src               # carried in every cursor (Kafka bounded: the frozen offset ranges)
        self.bad_records = 0
        self.n = sampler.n_samples(n_tokens, spec.seq_len)
        if self.n == 0:
            raise FailedPrecondition(f"the dataset has {n_tokens} tokens, too few for one sample of "
                                     f"seq_len + 1 = {spec.seq_len + 1} tokens")
        if sampler.per_rank(self.n, spec.world_size, spec.drop_last) == 0:
            raise FailedPrecondition(f"the dataset yields {self.n} samples of seq_len {spec.seq_len}, fewer than "
                                     f"world_size {spec.world_size}: with drop_last every rank would get none")
        self.start = self._start(cursor)

    def _start(self, c: Cursor | None) -> Start:
        s = self.spec
        if c is None:
            return Start(epoch=s.epoch, base=0, world=s.world_size, pos=0, step=0)
        mismatches = [(name, theirs, ours) for name, theirs, ours in (
            ("job", c.job, s.job),
            ("dataset fingerprint", c.fingerprint, self.fingerprint),
            ("seq_len", c.seq_len, s.seq_len),
            ("seed", c.seed, s.seed),
            ("shuffle", c.shuffle, s.shuffle),
            ("drop_last", c.drop_last, s.drop_last),
        ) if theirs != ours]
        if not s.reshard:
            mismatches += [(name, theirs, ours) for name, theirs, ours in (
                ("world_size", c.world_size, s.world_size), ("rank", c.rank, s.rank)) if theirs != ours]
        if mismatches:
            name, theirs, ours = mismatches[0]
            hint = " (set reshard to re-deal the epoch's remaining samples over a new world size)" \
                if name in ("world_size", "rank") else ""
            raise FailedPrecondition(f"cursor does not fit this stream: {name} differs: the cursor has "
                                     f"{theirs!r}, the request has {ours!r}{hint}",
                                     elsewhere=name == "dataset fingerprint")  # this replica's data
        if s.reshard:
            if c.pos >= sampler.per_rank(self.n - c.base, c.world_size, s.drop_last):
                # The old dealing ran to its end, and so did the epoch: what drop_last left out
                # of it stays out, as in an uninterrupted run, rather than be dealt again.
                return Start(epoch=c.epoch + 1, base=0, world=s.world_size, pos=0, step=0)
            base = sampler.reshard_base(n=self.n, base=c.base, world=c.world_size, pos=c.pos)
            return Start(epoch=c.epoch, base=base, world=s.world_size, pos=0, step=c.step)
        return Start(epoch=c.epoch, base=c.base, world=c.world_size, pos=c.pos, step=c.step)

    def close(self) -> None:
        pass

    def runs(self, max_batches: int = 64) -> Iterator["PlannedRun"]:
        """The stream as runs of up to `max_batches` consecutive batches of one epoch, each
        planned with one vectorized sampler call (the feeder's fast path reads, checksums and
        frames a run at a time)."""
        s, n, mb = self.spec, self.n, self.spec.micro_batch
        epoch, end = self.start.epoch, s.end_epoch
        while epoch < end:
            order = sampler.epoch_order(n, s.seed, epoch, s.shuffle)
            if epoch == self.start.epoch:
                base, world, pos, step = self.start.base, self.start.world, self.start.pos, self.start.step
            else:
                base, world, pos, step = 0, s.world_size, 0, 0
            per = sampler.per_rank(n - base, world, s.drop_last)
            while pos < per:
                stop = min(pos + max_batches * mb, per)
                ids = sampler.rank_ids(order, base=base, world=world, rank=s.rank, drop_last=s.drop_last,
                                       start=pos, stop=stop)
                # Batch j ends at pos + (j + 1) * mb; only an epoch's last batch may be short.
                stops = np.array([*range(pos + mb, stop, mb), stop], dtype=np.int64)   # (see rank_ids)
                yield PlannedRun(epoch=epoch, base=base, world=world, start=pos, step=step, ids=ids, stops=stops,
                                 samples_in_epoch=per)
                step += len(stops)
                pos = stop
            epoch += 1

    def batches(self) -> Iterator[PlannedBatch]:
        s = self.spec
        for run in self.runs():
            at = run.start
            for j, stop in enumerate(run.stops.tolist()):
                cursor = Cursor(job=s.job, fingerprint=self.fingerprint, seed=s.seed, shuffle=s.shuffle,
                                drop_last=s.drop_last, seq_len=s.seq_len, world_size=run.world, rank=s.rank,
                                epoch=run.epoch, base=run.base, pos=stop, step=run.step + j + 1, src=self.src)
                yield PlannedBatch(epoch=run.epoch, step=run.step + j, ids=run.ids[at - run.start:stop - run.start],
                                   cursor=cursor, samples_in_epoch=run.samples_in_epoch)
                at = stop

    def cursor_template(self) -> Cursor:
        """A cursor with this stream's fixed fields (for CursorWriter)."""
        s = self.spec
        return Cursor(job=s.job, fingerprint=self.fingerprint, seed=s.seed, shuffle=s.shuffle, drop_last=s.drop_last,
                      seq_len=s.seq_len, world_size=s.world_size, rank=s.rank, epoch=0, base=0, pos=0, step=0,
                      src=self.src)

"""Follow mode's plan: one rank's endless stream, its records (from `reader.FollowReader`)
packed into samples of seq_len + 1 tokens, and the cursor after each batch.

The topic is tailed without end; record k goes to rank k mod W, and each rank packs its
records into samples. The cursor holds the interleave's offsets and how far into a record the
next sample starts, so a restart replays exactly. No I/O here: that is the reader's.
"""
from __future__ import annotations

import dataclasses
import time
from collections import deque
from dataclasses import dataclass
from typing import Iterator

import numpy as np

from feeder.core.config import StreamSpec
from feeder.core.cursor import Cursor
from feeder.sources.kafka_positions import KafkaFollow
from feeder.core.errors import FailedPrecondition
from feeder.core.planning import PENDING, Pending, PlanBase, PlannedBatch, PlannedRun, Start
from feeder.core.sampling_key import DEAL, cursor_mismatch
from feeder.sources.kafka.reader import FollowReader, FollowState

try:
    from feeder._native import rows as _rows
except ImportError:   # built without the C extension: numpy's, the same rows
    _rows = None


@dataclass
class _Mark:
    at: int              # position, in this rank's token stream, of the record's first token
    state: FollowState   # interleave state just before the record


def take_rows(pieces: list[np.ndarray], skip: int, L: int, mb: int, dtype: np.dtype
              ) -> tuple[np.ndarray, list[np.ndarray]]:
    """mb rows of L + 1 tokens, row j from token skip + j*L of the pieces joined, and the pieces
    from token skip + mb*L on (views). One call, holding the GIL (_native.c's rows): a numpy call
    per record, or two per batch, each releasing the GIL to copy a few microseconds' worth,
    handed it to another stream's thread every time when a feeder's W follow streams are busy,
    and the feeder's CPU per token grew with W (issue 26)."""
    if _rows is not None:
        rows = np.frombuffer(_rows(pieces, skip, L, mb, dtype.itemsize), dtype=dtype).reshape(mb, L + 1)
    else:   # built without the C extension
        flat = np.concatenate(pieces)[skip:]
        rows = np.lib.stride_tricks.as_strided(flat, shape=(mb, L + 1), strides=(L * flat.itemsize, flat.itemsize),
                                               writeable=False).copy()
    cut, rest = skip + mb * L, []
    for p in pieces:
        if cut >= len(p):
            cut -= len(p)
            continue
        rest.append(p[cut:] if cut else p)
        cut = 0
    return rows, rest


# How long a followed topic may have nothing new before the rank is told so (WAITING notes).
QUIET_S = 0.5

class FollowPlan(PlanBase):
    """One rank's endless stream (a `Plan`): round-robin interleave, records dealt k mod W, packed.

    Reads through `reader` (by default a FollowReader of `src` opened here); `executor`, `lag`,
    `bad_records` and `close` are the reader's, for the pipeline. Its runs carry their tokens
    and cursors (the position is the interleave's offsets, not (epoch, base, pos, step))."""

    # `waiting` (PlanBase's): set once the topic has had no new record for QUIET_S, so the
    # stream tells the rank every second (it holds the stream, and does not fail over on its
    # idle timeout, or give up after retry_for_s, while producers are quiet); "" while records
    # flow, so a momentary gap between fetches costs nothing.
    _quiet_since: float | None = None

    def __init__(self, src, spec: StreamSpec, cursor: Cursor | None, policy: str, *,
                 reader: FollowReader | None = None):
        self._commit = src.commit_taken   # the job's consumer group, if it has one
        self.topic = src.url.topic
        self._open(spec, cursor, policy, reader if reader is not None else FollowReader.for_stream(src, spec, policy),
                   dtype=src.dtype, fingerprint=f"kafka-follow:{self.topic}")

    def _open(self, spec: StreamSpec, cursor: Cursor | None, policy: str, reader, *, dtype: np.dtype,
              fingerprint: str) -> None:
        """The stream's start, fresh or from `cursor` (shared with a mixture of topics: mixed.py)."""
        # Records are dealt in topic order: no permutation, so none to agree on.
        self.spec, self.policy = dataclasses.replace(spec, permutation=""), policy
        self.reader, self.dtype, self.fingerprint = reader, dtype, fingerprint
        self.n = 0
        # step -> offsets fully consumed once the batch of that step is taken (for group commits)
        self.offsets_after: deque[tuple[int, list[int]]] = deque(maxlen=4096)
        self.parts = self.reader.parts
        if cursor is None:
            self.state = self._fresh()
            self.i, skip, step = 0, 0, 0
        else:
            self.state, self.i, skip = self._resume(cursor)
            step = cursor.step
        self.start = Start(epoch=spec.epoch, base=0, world=spec.world_size, pos=self.i, step=step)
        self._skip = skip
        self._step = step

    def _fresh(self) -> FollowState:
        """Where a stream without a cursor starts: each partition's low watermark."""
        return FollowState(next=self.reader.first_offsets())

    def _resume(self, cursor: Cursor) -> tuple[FollowState, int, int]:
        """(interleave state, sample index, tokens to skip) of a cursor that fits this stream."""
        spec = self.spec
        # Records are dealt in topic order: no seed, shuffle or drop_last decides which a rank gets.
        wrong = cursor_mismatch(cursor, spec, self.fingerprint, fields=("fingerprint", "job", *DEAL, "seq_len"))
        if wrong is not None:
            raise wrong
        return self._from_position(cursor.src)

    def _from_position(self, pos) -> tuple[FollowState, int, int]:
        if type(pos) is not KafkaFollow:
            raise FailedPrecondition("cursor does not fit this stream: it is not from a Kafka follow stream")
        if pos.partitions != len(self.parts):
            raise FailedPrecondition(f"topic {self.topic} had {pos.partitions} partitions when this cursor was made "
                                     f"and has {len(self.parts)} now; a follow stream needs a fixed partition count")
        return FollowState(next=list(pos.next), turn=pos.turn, k=pos.k), pos.i, pos.skip

    def _position(self, state: FollowState, skip: int, i: int) -> KafkaFollow:
        """The cursor's source position: `state` before the record the next sample starts in."""
        return KafkaFollow(partitions=len(self.parts), next=tuple(state.next), turn=state.turn, k=state.k, skip=skip,
                           i=i)

    # -- the reader's, for the pipeline (stream.RankStream) and metrics
    @property
    def executor(self):
        """The thread the stream runs on: consume() blocks."""
        return self.reader.executor

    @property
    def lag(self) -> dict[int, int]:
        return self.reader.lag

    @property
    def bad_records(self) -> int:
        return self.reader.bad_records

    def close(self) -> None:
        """Stops the reader (see FollowReader.close)."""
        self.reader.close()

    def taken(self, step: int) -> None:
        """Pass on to the consumer group the offsets the rank's loop has taken."""
        offsets = self.offsets_at(step)
        if offsets is not None:
            s = self.spec
            self._commit(s.job, s.rank, s.world_size, offsets)

    def locate(self, starts: np.ndarray, n: int) -> np.ndarray:
        raise RuntimeError("a follow stream's runs carry their tokens: there are no rows to locate")

    def boundaries(self, starts: np.ndarray, n: int):
        raise RuntimeError("a follow stream serves no boundaries (KafkaSource.plan refuses such a stream)")

    def cursor_template(self) -> Cursor:
        return self._cursor(self.state, self._skip, self.i, self._step)

    # -- planning
    def runs(self, max_batches: int = 1) -> Iterator[PlannedRun | Pending]:
        """The batches (each one run: its own cursor, its tokens), PENDING whenever the reader
        has no record ready."""
        W = self.spec.world_size
        for b in self.batches():
            if b is None:
                now = time.monotonic()
                if self._quiet_since is None:
                    self._quiet_since = now
                elif now - self._quiet_since >= QUIET_S and not self.waiting:
                    self.waiting = (f"no new record on Kafka topic {self.topic} since "
                                    f"{time.strftime('%H:%M:%S', time.localtime(time.time() - (now - self._quiet_since)))}"
                                    ": the stream holds until its producers write again")
                yield PENDING
                continue
            self._quiet_since, self.waiting = None, ""
            yield PlannedRun(epoch=b.epoch, base=0, world=W, start=b.cursor.pos - len(b.ids), step=b.step,
                             ids=b.ids, stops=np.array([b.cursor.pos], dtype=np.int64), samples_in_epoch=0,
                             tokens=b.tokens, cursors=(b.cursor,))

    def offsets_at(self, step: int) -> dict[int, int] | None:
        """{partition: next offset} once the batch of `step` has been taken, if remembered."""
        for s, nxt in reversed(self.offsets_after):
            if s == step:
                return dict(zip(self.parts, nxt))
            if s < step:
                break
        return None

    def _cursor(self, state: FollowState, skip: int, i: int, step: int) -> Cursor:
        s = self.spec
        return Cursor(job=s.job, fingerprint=self.fingerprint, seed=s.seed, shuffle=False, drop_last=s.drop_last,
                      seq_len=s.seq_len, world_size=s.world_size, rank=s.rank, epoch=s.epoch, base=0, pos=i,
                      step=step, src=self._position(state, skip, i))

    def _passed(self, step: int, state: FollowState) -> None:
        """Once the batch of `step` is taken, the records before `state` are (for group commits)."""
        self.offsets_after.append((step, list(state.next)))

    def batches(self) -> Iterator[PlannedBatch | None]:
        """This rank's batches (tokens included), each with the cursor after it; None whenever
        the reader has no record ready (the caller flushes what it has and asks again)."""
        s = self.spec
        L, W, r, mb = s.seq_len, s.world_size, s.rank, s.micro_batch
        i, step = self.i, self._step
        # The records since sample i's start, as they came, copied once per batch (take_rows).
        pieces: list[np.ndarray] = []
        have = 0                            # tokens in pieces
        buf_at = i * L - self._skip         # stream position of pieces[0][0]
        span = mb * L + 1                   # a batch: mb samples of L + 1 tokens, each the next's first
        marks: deque[_Mark] = deque()
        first = True
        for item in self.reader.records(self.state):
            if item is None:
                yield None
                continue
            before, tokens = item
            if first:
                marks.append(_Mark(buf_at, before))
                first = False
            if tokens is None:
                continue
            marks.append(_Mark(buf_at + have, before))
            pieces.append(tokens)
            have += len(tokens)
            while buf_at + have >= i * L + span:        # samples i .. i + mb - 1 are complete
                rows, pieces = take_rows(pieces, i * L - buf_at, L, mb, self.dtype)
                i += mb
                nxt = buf_at = i * L
                have = sum(map(len, pieces))   # never 0: sample i's first token is the last one's last
                while len(marks) > 1 and marks[1].at <= nxt:
                    marks.popleft()
                mark = marks[0]
                ids = np.arange(i - mb, i, dtype=np.int64) * W + r
                cursor = self._cursor(mark.state, nxt - mark.at, i, step + 1)
                self._passed(step, mark.state)
                yield PlannedBatch(epoch=s.epoch, step=step, ids=ids, cursor=cursor, samples_in_epoch=0,
                                   tokens=rows)
                step += 1

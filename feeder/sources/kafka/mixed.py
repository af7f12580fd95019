"""Follow mode's mixtures of topics: a deterministic weighted interleave of records.

The mixed stream is a sequence of slots without end. Slot k is filled by a topic chosen by
Megatron's blending rule over the slots (feeder.mixture.interleave: the rule an epoch's positions
follow, run on without end) with the next record of that topic's own round-robin interleave over
its partitions (reader.py's order). Slot k is then dealt as a single topic's record k is: to rank
k mod W, which packs its records into samples (FollowPlan's packing, unchanged).

So the interleave is a pure function of (weights, each topic's record sequence), and a position
in it is each topic's interleave state plus the slots taken (cursor.KafkaFollowMix): a restart
anywhere (a feeder SIGKILL, a broker restart, a trainer resuming from its checkpoint) replays
exactly. A topic with no new record holds the stream when its turn comes, as a partition does in
one topic: the price of a deterministic order.

Each topic is read through its KafkaSource's shared window (shared.py) taking every record, so
the streams of a feeder process fetch a record once; only the records that fill this rank's slots
are decoded (`MixedReader.want`, asked as each record is taken).
"""
from __future__ import annotations

import hashlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Iterator

import numpy as np

from feeder.core import blend as mx
from feeder.core.config import StreamSpec
from feeder.core.cursor import Cursor
from feeder.sources.kafka_positions import KafkaFollow, KafkaFollowMix
from feeder.core.errors import FailedPrecondition, InvalidArgument
from feeder.sources.kafka.follow import FollowPlan
from feeder.sources.kafka.reader import FollowState
from feeder.sources.mixture import check_fit, shown_mixture

SLOTS = 4096   # slots of the interleave computed at once


@dataclass
class MixState:
    """Where a follow mixture stands: each topic's interleave (its k: its records taken so far)
    and the slots taken (the next record is slot k's)."""
    topics: list[FollowState]
    k: int = 0

    def copy(self) -> "MixState":
        return MixState([t.copy() for t in self.topics], self.k)


class MixedReader:
    """One rank's records of a follow mixture, in slot order: (state before the record, its
    tokens + EOS or None when another rank's or skipped), None when the topic whose turn it is
    has no record ready. The FollowReader interface FollowPlan reads through."""

    def __init__(self, weights: tuple[float, ...], sources: list, spec: StreamSpec):
        self.weights, self.rank, self.world = weights, spec.rank, spec.world_size
        self.subs = [src.subscribe(spec, spec.bad_records or src.url.bad_records, want=self.want) for src in sources]
        self.parts = [p for s in self.subs for p in s.parts]
        self.executor = ThreadPoolExecutor(1, thread_name_prefix=f"kafka-mix-r{spec.rank}")
        self._mine = False   # whether the record being taken fills one of this rank's slots

    def want(self, _k: int) -> bool:
        """Whether the topic's record being taken now is this rank's: its slot's, k mod W."""
        return self._mine

    def first(self) -> MixState:
        """Where a stream without a cursor starts: every topic at its low watermarks, slot 0."""
        return MixState([FollowState(next=s.first_offsets()) for s in self.subs])

    @property
    def bad_records(self) -> int:
        return sum(s.bad_records for s in self.subs)

    @property
    def lag(self) -> dict[int, int]:
        """Records behind the end, per partition number, summed over the topics."""
        out: dict[int, int] = {}
        for s in self.subs:
            for p, n in s.lag.items():
                out[p] = out.get(p, 0) + n
        return out

    def close(self) -> None:
        for s in self.subs:
            s.close()
        self.executor.shutdown(wait=False)

    def records(self, st: MixState) -> Iterator[tuple[MixState | None, np.ndarray | None] | None]:
        """From `st` (advanced in place), in slot order (see the module doc); the state before a
        record is given for the rank's own records only (None for the others')."""
        topics = [s.records(t) for s, t in zip(self.subs, st.topics)]   # each advances its st.topics[d]
        try:
            for it in topics:
                next(it)   # (a subscription's first item: the state it starts at)
            yield st.copy(), None
            ahead, counts = [], [t.k for t in st.topics]   # topics of the next slots, computed a block at a time
            while True:
                if not ahead:
                    ahead = mx.interleave(self.weights, st.k, counts, SLOTS)[::-1]
                d = ahead[-1]
                self._mine = mine = st.k % self.world == self.rank
                # (the state before another rank's record is never a cursor's: FollowPlan marks only
                # the rank's own records, and the stream's start)
                before = st.copy() if mine else None
                item = next(topics[d])
                if item is None:
                    yield None
                    continue
                ahead.pop()
                st.k += 1
                yield before, item[1]
        finally:
            for it in topics:
                it.close()


class FollowMixPlan(FollowPlan):
    """One rank's endless stream of a mixture of followed topics (a `Plan`): FollowPlan's packing
    over MixedReader's records; the cursor holds a KafkaFollowMix."""

    def __init__(self, names: tuple[str, ...], weights: tuple[float, ...], sources: list, spec: StreamSpec,
                 cursor: Cursor | None):
        if spec.remix or spec.reshard:
            raise FailedPrecondition("a Kafka follow-mode mixture is not remixed or re-dealt: resume it with the "
                                     "mixture and world size of its cursor (a new mixture starts a new job)")
        if spec.epoch_samples:
            raise InvalidArgument(f"epoch_samples ({spec.epoch_samples}) has no meaning for a mixture of followed Kafka "
                                  "topics: its stream has no epochs; leave it 0")
        check_fit(names, sources)
        self.names, self.weights = names, weights
        self.topics = tuple(src.url.topic for src in sources)
        self.topic = "+".join(self.topics)
        fingerprint = "kafka-follow-mix:" + hashlib.sha256(
            "\0".join(f"{n}\0{t}" for n, t in zip(names, self.topics)).encode()).hexdigest()[:32]
        reader = MixedReader(weights, sources, spec)
        try:
            self._open(spec, cursor, "", reader, dtype=sources[0].dtype, fingerprint=fingerprint)
        except BaseException:
            reader.close()
            raise

    def _fresh(self) -> MixState:
        return self.reader.first()

    def _from_position(self, pos) -> tuple[MixState, int, int]:
        if type(pos) is not KafkaFollowMix:
            raise FailedPrecondition("cursor does not fit this stream: it is not from a Kafka follow-mode mixture")
        if (pos.names, pos.weights) != (self.names, self.weights):
            raise FailedPrecondition(f"cursor does not fit this stream: mixture differs: the cursor has "
                                     f"{shown_mixture(pos.names, pos.weights)}, the request has "
                                     f"{shown_mixture(self.names, self.weights)} (a follow-mode mixture is not "
                                     "remixed)")
        for name, topic, t, sub in zip(self.names, self.topics, pos.topics, self.reader.subs):
            if t.partitions != len(sub.parts):
                raise FailedPrecondition(f"topic {topic} ({name!r}) had {t.partitions} partitions when this cursor "
                                         f"was made and has {len(sub.parts)} now; a follow stream needs a fixed "
                                         "partition count")
        if sum(t.k for t in pos.topics) != pos.k:   # (only a hand-made cursor, under the secret: it passed the MAC)
            raise FailedPrecondition(f"cursor does not fit this stream: it names no place in the mixture (its topics' "
                                     f"records taken, {sum(t.k for t in pos.topics)}, are not its slots, {pos.k})")
        state = MixState([FollowState(next=list(t.next), turn=t.turn, k=t.k) for t in pos.topics], pos.k)
        return state, pos.i, pos.skip

    def _position(self, state: MixState, skip: int, i: int) -> KafkaFollowMix:
        return KafkaFollowMix(names=self.names, weights=self.weights, k=state.k, skip=skip, i=i,
                              topics=tuple(KafkaFollow(partitions=len(t.next), next=tuple(t.next), turn=t.turn,
                                                       k=t.k, skip=0, i=0) for t in state.topics))

    def _passed(self, step: int, state: MixState) -> None:
        """No consumer-group commits for a mixture (the group option is a topic's)."""

    def taken(self, step: int) -> None:
        """(see _passed)"""

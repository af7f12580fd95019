"""Kafka's positions in a cursor (what the sampler cannot derive of a Kafka stream), registered
with the cursor by their owner: a bounded epoch's offset ranges, a follow stream's interleave,
and a follow mixture of topics. Pure: no Kafka client (a feeder without confluent_kafka still
reads and writes these cursors; feeder/sources/__init__.py imports this module)."""
from __future__ import annotations

import json
import struct
from dataclasses import dataclass

from feeder.core.cursor import PositionKind, register_position

KIND_KAFKA_EPOCH, KIND_KAFKA_FOLLOW, KIND_KAFKA_FOLLOW_MIX = 2, 3, 5   # cursor bytes: fixed forever


@dataclass(frozen=True)
class KafkaEpoch:
    """Kafka bounded: the offset ranges of the job's frozen epoch ("topic:p=lo-hi,...")."""
    ranges: str


@dataclass(frozen=True)
class KafkaFollow:
    """Kafka follow: where the rank's round-robin interleave over the partitions stands."""
    partitions: int            # the topic's partition count (a follow stream needs it fixed)
    next: tuple[int, ...]      # per partition, the next offset to read
    turn: int                  # the partition whose record comes next
    k: int                     # records dealt so far (record k goes to rank k mod W)
    skip: int                  # tokens of the current record that earlier samples took
    i: int                     # the rank's next sample index

    _FIXED = struct.Struct(">IIQQQ")

    def __post_init__(self):
        # A hand-made or old (JSON) position that cannot name a place in a topic is malformed.
        ints = (self.partitions, self.turn, self.k, self.skip, self.i, *self.next)
        if not all(type(x) is int and 0 <= x < 1 << 64 for x in ints) or len(self.next) != self.partitions \
                or not self.turn < max(self.partitions, 1):
            raise ValueError("a follow position needs one offset per partition and a turn among them")

    def pack(self) -> bytes:
        return self._FIXED.pack(self.partitions, self.turn, self.k, self.skip, self.i) + \
            struct.pack(f">{len(self.next)}Q", *self.next)

    @classmethod
    def unpack(cls, b: bytes) -> "KafkaFollow":
        p, turn, k, skip, i = cls._FIXED.unpack_from(b)
        nxt = struct.unpack_from(f">{p}Q", b, cls._FIXED.size)
        if cls._FIXED.size + 8 * p != len(b):
            raise struct.error(f"a follow position of {p} partitions has {len(b)} bytes")
        return cls(partitions=p, next=nxt, turn=turn, k=k, skip=skip, i=i)


@dataclass(frozen=True)
class KafkaFollowMix:
    """Kafka follow, a mixture of topics: which topic fills each slot of the mixed interleave is
    a pure function of the normalized weights and the slot (feeder.mixture.interleave), so the
    position is where each topic's own interleave stands (a KafkaFollow whose k counts the
    topic's records taken, and whose skip and i are 0), the slots taken (`k`: record k goes to
    rank k mod W), and the rank's packing (skip, i) as in KafkaFollow."""
    names: tuple[str, ...]
    weights: tuple[float, ...]
    topics: tuple[KafkaFollow, ...]
    k: int
    skip: int
    i: int

    _TAIL = struct.Struct(">QQQ")

    def __post_init__(self):
        if not 0 < len(self.names) == len(self.weights) == len(self.topics) <= 32767 \
                or not all(type(x) is int and 0 <= x < 1 << 64 for x in (self.k, self.skip, self.i)):
            raise ValueError("a follow mixture's position needs a name, weight and topic position per topic")

    def pack(self) -> bytes:
        out = [struct.pack(">H", len(self.names))]
        for name, w, t in zip(self.names, self.weights, self.topics):
            nb, tb = name.encode(), t.pack()
            out += [struct.pack(">H", len(nb)), nb, struct.pack(">dI", w, len(tb)), tb]
        out.append(self._TAIL.pack(self.k, self.skip, self.i))
        return b"".join(out)

    @classmethod
    def unpack(cls, b: bytes) -> "KafkaFollowMix":
        (n,), at = struct.unpack_from(">H", b), 2
        names, weights, topics = [], [], []
        for _ in range(n):
            (ln,) = struct.unpack_from(">H", b, at)
            names.append(b[at + 2:at + 2 + ln].decode())
            at += 2 + ln
            w, lt = struct.unpack_from(">dI", b, at)
            at += 12
            if at + lt > len(b):
                raise struct.error("a topic's position runs past the cursor's end")
            weights.append(w)
            topics.append(KafkaFollow.unpack(b[at:at + lt]))
            at += lt
        k, skip, i = cls._TAIL.unpack_from(b, at)
        if at + cls._TAIL.size != len(b):
            raise struct.error(f"a follow mixture's position of {n} topics has {len(b)} bytes")
        return cls(names=tuple(names), weights=tuple(weights), topics=tuple(topics), k=k, skip=skip, i=i)


def _legacy(text: str):
    """A cursor before version 3: a follow position as JSON, else a bounded epoch's ranges."""
    if text.startswith("{"):
        d = json.loads(text)
        return KafkaFollow(partitions=d["P"], next=tuple(d["next"]), turn=d["turn"], k=d["k"], skip=d["skip"], i=d["i"])
    return KafkaEpoch(text)


register_position(PositionKind(KIND_KAFKA_EPOCH, KafkaEpoch, lambda p: p.ranges.encode(),
                               lambda b: KafkaEpoch(b.decode()), legacy=_legacy))
register_position(PositionKind(KIND_KAFKA_FOLLOW, KafkaFollow, KafkaFollow.pack, KafkaFollow.unpack))
register_position(PositionKind(KIND_KAFKA_FOLLOW_MIX, KafkaFollowMix, KafkaFollowMix.pack, KafkaFollowMix.unpack))

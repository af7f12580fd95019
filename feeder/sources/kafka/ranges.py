"""A bounded epoch as text: `kafka:TOPIC:P=LO-HI,...`, the offset ranges [LO, HI) per partition
frozen when the job started. It is the dataset fingerprint of the epoch's snapshot's source,
travels in every cursor and is what the epoch register agrees on (pure: no Kafka client here)."""
from __future__ import annotations

from feeder.core.errors import FailedPrecondition


def format_ranges(topic: str, spans: list[tuple[int, int, int]]) -> str:
    """The epoch of (partition, low, high) spans."""
    return f"kafka:{topic}:" + ",".join(f"{p}={lo}-{hi}" for p, lo, hi in spans)


def parse_ranges(ranges: str) -> tuple[str, list[tuple[int, int, int]]]:
    """(topic, [(partition, low, high), ...]) of an epoch; FailedPrecondition if it is not one."""
    try:
        kind, topic, body = ranges.split(":", 2)
        if kind != "kafka":   # not an assert: those vanish under python -O
            raise ValueError(kind)
        spans = []
        for part in body.split(","):
            p, span = part.split("=")
            lo, hi = span.split("-")
            spans.append((int(p), int(lo), int(hi)))
        return topic, spans
    except ValueError:
        raise FailedPrecondition(f"{ranges!r} is not a Kafka epoch (kafka:TOPIC:P=LO-HI,...)") from None

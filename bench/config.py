"""The bench's settings, and its one way of telling the user where it is."""
from __future__ import annotations

import sys
from dataclasses import dataclass

CLIENT_PROCS = 2


@dataclass(frozen=True, kw_only=True)
class BenchConfig:
    """What `feeder bench` measures and for how long; the command line fills it."""

    data: str = "bench/data"
    ranks: int = 8
    seq_len: int = 2048
    micro_batch: int = 8
    seconds: float = 4.0
    # 256 batches (the most a message holds) of 8 x 2049 uint16 tokens: half the messages
    # of 4 MiB, so half the per-message GIL handoffs between the builders and the event loop.
    message_bytes: int = 8 << 20
    corpus_bytes: int = 12 << 20
    vocab: int = 32000
    kafka: str = "127.0.0.1:9092"     # "" to skip the Kafka figures
    quick: bool = False
    rounds: int = 3                    # of the ceilings and the feeder, interleaved; medians reported
    only: str = ""                     # "formats" | "mixture" | "scale" | "kafka" | "packing": only those figures (issues 19, 18, 25, 26, 27)

    def __post_init__(self):
        from feeder.core.config import _positive

        for name in ("ranks", "seq_len", "micro_batch", "message_bytes", "rounds"):
            _positive(name, getattr(self, name))


def say(msg: str) -> None:
    """Progress on stderr, so that stdout holds only the table."""
    print(f"bench: {msg}", file=sys.stderr, flush=True)


"""The Kafka source's URL and its options (pure: no Kafka client here).

kafka://HOST:PORT[,HOST:PORT...]/TOPIC[?mode=bounded|follow&bad_records=fail|skip
    &vocab_size=N&eos_id=N&max_record_bytes=N&spool=DIR&group=NAME&epoch_ttl_s=SECONDS&window_bytes=N]
"""
from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import parse_qs, urlparse

from feeder.core.errors import InvalidArgument

MODES = ("bounded", "follow")
POLICIES = ("fail", "skip")
EPOCH_TTL_S = 24 * 3600.0   # the engine's job idle TTL (pipeline.jobs.Jobs): a forgotten job's name is free
WINDOW_BYTES = 64 << 20     # follow mode: the records a feeder process keeps for its ranks to share (shared.py)
OPTIONS = ("mode", "bad_records", "vocab_size", "eos_id", "max_record_bytes", "spool", "group", "epoch_ttl_s",
           "window_bytes")


@dataclass(frozen=True, kw_only=True)
class KafkaURL:
    """A parsed Kafka source URL: where the topic is and how to read it."""

    bootstrap: str
    topic: str
    mode: str = "bounded"
    bad_records: str = "fail"
    vocab_size: int = 0
    eos_id: int = -1
    max_record_bytes: int = 16 << 20
    spool: str = ""
    group: str = ""
    epoch_ttl_s: float = EPOCH_TTL_S
    window_bytes: int = WINDOW_BYTES

    @classmethod
    def parse(cls, url: str, *, vocab_size: int = 0, eos_id: int = -1) -> "KafkaURL":
        """The URL's settings; `vocab_size`/`eos_id` (the command line's) apply where the URL
        names none. Raises InvalidArgument naming the first bad part."""
        u = urlparse(url)
        topic = u.path.strip("/")
        if u.scheme != "kafka" or not u.netloc or not topic or "/" in topic:
            raise InvalidArgument(f"a Kafka source is kafka://HOST:PORT[,HOST:PORT]/TOPIC[?options], got {url!r}")
        q = {k: v[-1] for k, v in parse_qs(u.query, keep_blank_values=True).items()}
        unknown = sorted(set(q) - set(OPTIONS))
        if unknown:
            raise InvalidArgument(f"unknown Kafka URL option(s) {unknown}; known: {sorted(OPTIONS)}")
        cfg = cls(bootstrap=u.netloc, topic=topic, mode=q.get("mode", "bounded"),
                  bad_records=q.get("bad_records", "fail"), vocab_size=_integer(q, "vocab_size", vocab_size),
                  eos_id=_integer(q, "eos_id", eos_id), max_record_bytes=_integer(q, "max_record_bytes", 16 << 20),
                  spool=q.get("spool", ""), group=q.get("group", ""),
                  epoch_ttl_s=_number(q, "epoch_ttl_s", EPOCH_TTL_S),
                  window_bytes=_integer(q, "window_bytes", WINDOW_BYTES))
        cfg._validate()
        return cfg

    def _validate(self) -> None:
        if self.mode not in MODES:
            raise InvalidArgument(f"Kafka URL option mode must be bounded or follow, got {self.mode!r}")
        if self.bad_records not in POLICIES:
            raise InvalidArgument(f"Kafka URL option bad_records must be fail or skip, got {self.bad_records!r}")
        if self.max_record_bytes <= 0:
            raise InvalidArgument(f"max_record_bytes must be positive, got {self.max_record_bytes}")
        if self.window_bytes <= 0:
            raise InvalidArgument(f"Kafka URL option window_bytes must be positive, got {self.window_bytes}")
        if not 0 < self.epoch_ttl_s < float("inf"):
            raise InvalidArgument(f"Kafka URL option epoch_ttl_s must be a positive number of seconds, "
                                  f"got {self.epoch_ttl_s}")


def _integer(q: dict[str, str], name: str, default: int) -> int:
    try:
        return int(q.get(name, default))
    except ValueError:
        raise InvalidArgument(f"Kafka URL option {name} must be an integer, got {q[name]!r}") from None


def _number(q: dict[str, str], name: str, default: float) -> float:
    try:
        return float(q.get(name, default))
    except ValueError:
        raise InvalidArgument(f"Kafka URL option {name} must be a number, got {q[name]!r}") from None

"""How the source talks to the broker: consumer settings, metadata and watermark queries,
closing a client, and the one way a broker failure becomes a domain error.

confluent_kafka is imported inside functions (here and in the package's other modules) so that
importing the package, e.g. for the codec, does not need the `kafka` extra.
"""
from __future__ import annotations

import logging
import threading
import uuid

from feeder.core.errors import NotFound, Unavailable


def consumer_config(bootstrap: str, **extra) -> dict:
    """Settings of every consumer of the source: offsets are owned by the cursor (explicit
    assign(), no auto-commit), and only committed transactions are read."""
    return {
        "bootstrap.servers": bootstrap,
        "group.id": f"feeder-{uuid.uuid4().hex[:12]}",  # never joined: partitions are assign()ed
        "enable.auto.commit": False,
        "enable.auto.offset.store": False,
        "isolation.level": "read_committed",      # records of aborted transactions are never seen
        "enable.partition.eof": True,
        "auto.offset.reset": "error",              # an offset gone to retention is an error, not a jump
        "fetch.max.bytes": 64 << 20,
        "max.partition.fetch.bytes": 16 << 20,
        "queued.max.messages.kbytes": 64 << 10,
        "reconnect.backoff.ms": 100,
        "reconnect.backoff.max.ms": 2000,
        "socket.keepalive.enable": True,
        "logger": logging.getLogger("feeder.kafka.librdkafka"),
        **extra,
    }


def unavailable(bootstrap: str, e: object) -> Unavailable:
    """A broker failure as the error clients retry (they resume from their cursor)."""
    return Unavailable(f"cannot read Kafka at {bootstrap}: {e}; the feeder retries, resume from the cursor")


def watermarks(consumer, topic: str, partition: int, bootstrap: str) -> tuple[int, int]:
    """(low, high) offsets of a partition, asked of the broker now."""
    from confluent_kafka import KafkaException, TopicPartition

    try:
        return consumer.get_watermark_offsets(TopicPartition(topic, partition), timeout=10, cached=False)
    except KafkaException as e:
        raise unavailable(bootstrap, e) from None


def partitions(consumer, topic: str, bootstrap: str) -> list[int]:
    """The topic's partition ids, sorted; NotFound when the topic does not exist."""
    from confluent_kafka import KafkaException

    try:
        md = consumer.list_topics(topic, timeout=10)
    except KafkaException as e:
        raise unavailable(bootstrap, e) from None
    t = md.topics.get(topic)
    if t is None or t.error is not None and t.error.code() == 3:  # UNKNOWN_TOPIC_OR_PART
        raise NotFound(f"Kafka topic {topic!r} does not exist at {bootstrap}")
    if t.error is not None:
        raise unavailable(bootstrap, t.error)
    return sorted(t.partitions)


_ADMINS: dict[str, object] = {}
_ADMINS_LOCK = threading.Lock()


def topic_id(bootstrap: str, topic: str) -> str:
    """Kafka's id of the topic: a topic deleted and created again under its name has another,
    so what was read of the old one (a snapshot, a follow window) is not taken for the new one
    with the same offsets. "" where the broker does not say (Kafka before 2.8) or cannot now."""
    from confluent_kafka import TopicCollection
    from confluent_kafka.admin import AdminClient

    with _ADMINS_LOCK:
        admin = _ADMINS.get(bootstrap)
        if admin is None:
            admin = _ADMINS[bootstrap] = AdminClient({"bootstrap.servers": bootstrap})
    try:
        return str(admin.describe_topics(TopicCollection([topic]))[topic].result(10).topic_id or "")
    except Exception:   # noqa: BLE001 - an old broker, a moment's outage: the names alone, as before
        return ""


def close_soon(consumer) -> None:
    """close() has been seen to hang (confluent-kafka-python #1667): never wait on it."""
    threading.Thread(target=consumer.close, daemon=True, name="kafka-close").start()

"""Follow mode's group commits (?group=NAME): the job's progress shown to standard Kafka tooling
(kafka-consumer-groups --describe gives its lag). Never read back: the cursor owns offsets."""
from __future__ import annotations

import logging

from feeder.sources.kafka.consumer import close_soon, consumer_config
from feeder.sources.kafka.options import KafkaURL

log = logging.getLogger("feeder.kafka")


class GroupCommits:
    """Commits, per job, the offsets every rank of it has passed, to the URL's consumer group."""

    def __init__(self, url: KafkaURL):
        self.url = url
        self._taken: dict[str, dict[int, dict[int, int]]] = {}   # job -> rank -> {partition: next offset}
        self._committed: dict[str, dict[int, int]] = {}
        self._consumer = None

    def commit_taken(self, job: str, rank: int, world: int, offsets: dict[int, int]) -> None:
        """Rank `rank`'s loop has taken records up to `offsets` ({partition: next offset}): once
        every rank of the job has reported, commit per partition the minimum over ranks.
        Best effort, async; a no-op without ?group=NAME."""
        if not self.url.group:
            return
        from confluent_kafka import Consumer, TopicPartition

        taken = self._taken.setdefault(job, {})
        taken[rank] = offsets
        if len(taken) < world:
            return
        low = {p: min(o[p] for o in taken.values() if p in o) for p in offsets}
        if low == self._committed.get(job):
            return
        if self._consumer is None:
            self._consumer = Consumer(consumer_config(self.url.bootstrap, **{"group.id": self.url.group}))
        try:
            self._consumer.commit(offsets=[TopicPartition(self.url.topic, p, o) for p, o in sorted(low.items())],
                                  asynchronous=True)
            self._committed[job] = low
        except Exception as e:  # the data path must not suffer for a dashboard
            log.warning("kafka %s: committing offsets to group %s failed: %s", self.url.topic, self.url.group, e)

    def close(self) -> None:
        """Lets go of the group's consumer (without waiting on it)."""
        if self._consumer is not None:
            close_soon(self._consumer)

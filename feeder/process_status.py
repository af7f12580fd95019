"""What a feeder process says about itself and its ranks (the Status RPC, `feeder status`).
Plain values, no protobuf: Engine.status() assembles them, feeder.service.convert sends them."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class RankStatus:
    rank: int
    connected: bool
    epoch: int
    samples_done: int            # in the current epoch
    samples_in_epoch: int
    batches_sent: int
    bytes_sent: int
    tokens_per_s: float
    queue_depth: int
    data_wait_fraction: float
    last_error: str
    peer: str
    restarts: int                # streams opened after the first
    failovers: int
    tokens_sent: int
    bad_records: int
    region: str
    state: str                   # streaming | finished (all sent) | disconnected


@dataclass(frozen=True, slots=True)
class JobStatus:
    job: str
    dataset: str
    world_size: int
    ranks: tuple[RankStatus, ...]


@dataclass(frozen=True, slots=True)
class ProcessStatus:
    region: str
    uptime_s: float
    streams_open: int
    rss_mb: float
    tasks: int
    threads: int
    processes: int
    jobs: tuple[JobStatus, ...]
    preparing: tuple[str, ...] = ()   # what streams that cannot start yet wait for (feeder.preparing)

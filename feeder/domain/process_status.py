"""What a feeder process says about itself and its ranks (the Status RPC, `feeder status`).
Plain values, no protobuf: Engine.status() assembles them, feeder.service.convert sends them."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class MemberStatus:
    """One member of a model-parallel rank: where its stream is, and whether it reads the
    rank's shared window."""
    member: int
    cp_rank: int
    epoch: int
    step: int
    shared: bool
    behind: int      # batches behind the member furthest ahead (same epoch)


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
    # streaming | all sent (the loop has not reported its last batch) | finished (the loop took
    # its last batch) | disconnected
    state: str
    samples_sent: int = 0        # of sent_epoch: runs ahead of what the loop took
    reported: bool = False       # samples_done (what the loop took) is known from its reports
    sent_epoch: int = 0
    members: tuple[MemberStatus, ...] = ()
    window_builds: int = 0
    member_shared: int = 0
    member_solo: int = 0
    # the rank's client's view of its feed (its reports: feeder.service.convert.FEED)
    target: str = ""
    moved: str = ""
    moves: int = 0
    delivered_per_s: float = 0.0
    consumed_per_s: float = 0.0
    hedged_bytes: int = 0


@dataclass(frozen=True, slots=True)
class JobStatus:
    job: str
    dataset: str
    world_size: int
    ranks: tuple[RankStatus, ...]
    elastic: str = ""   # an elastic job's last committed step, its world, the attempts that did not commit
    streams_open: int = 0   # this job's streams open now (what a caller scoped to its jobs is told)
    mixture: str = ""   # a scheduled mixture's version, changes, and scheduled vs actual shares


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
    chunks_changed: int = 0      # found changed on disk by the background scrub (DATA_LOSS since)
    scrubbed_bytes: int = 0
    building: tuple[str, ...] = ()   # builds under way (epoch orders), each with how far
    preparing: tuple[str, ...] = ()   # what streams that cannot start yet wait for (feeder.preparing)
    packings: tuple[str, ...] = ()   # the best-fit packings served (feeder.sources.packed.describe)
    cache_damaged: int = 0       # cache entries found damaged, removed and rebuilt (feeder.sources.cache)
    cache_problems: tuple[str, ...] = ()   # what the cache directory cannot hold, and what is done instead
    stuck: tuple[str, ...] = ()  # reads that have not returned for --stuck-after-s (Engine.watch_reads)
    load: float = 0.0            # 0 idle, 1 at capacity (its CPU, or its batch threads all busy)

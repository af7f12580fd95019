"""The processes of one `feeder serve --processes N` port, seen as one feeder.

The kernel hands each new connection to one of the processes (SO_REUSEPORT), so a rank's
stream, and an operator's `feeder status`, land on any of them. Each process therefore
writes its whole status (a StatusReply) to the supervisor's directory every second and at once
when a stream opens or closes (then at most one write per COALESCE_S), and a Status call merges
the answering process's live status with the others' (those written in the last STALE_S
seconds: a process that died or hangs drops out of the view). A Status for a job reads the
others again until each has written a status taken after the call came (or, where the view
does not show the job yet, until EVERY_S and a little more have passed; where it does, a little
more than COALESCE_S): a stream that ran on another process just before is then in the answer,
not NOT_FOUND (issue 44.6: 1 answer in 3 was, while the write that would show it was still to
come).
"""
from __future__ import annotations

import os
import time
from pathlib import Path

from feeder.v1 import feeder_pb2 as pb

EVERY_S = 1.0
COALESCE_S = 0.05   # after a stream opens or closes, what else changes meanwhile goes in the same write
STALE_S = 5.0
# Counters that add up over the processes a rank was served by (a rank that reconnects may
# land on another process); everything else describes the rank now, and comes from the
# process that serves it now.
SUMMED = ("batches_sent", "bytes_sent", "tokens_sent", "failovers", "bad_records")


class Siblings:
    def __init__(self, directory: str, index: int):
        self.dir, self.index = Path(directory), index

    def _path(self, i: int) -> Path:
        return self.dir / f"{i}.status"

    def publish(self, reply: pb.StatusReply, taken: float | None = None) -> None:
        """This process's status, replaced whole (a reader never sees half of it). The file's
        modification time is when the status was `taken` (time.time()): a reader knows from it
        whether what it reads is newer than a moment of its own (`read`)."""
        tmp = self.dir / f".{self.index}.tmp"
        tmp.write_bytes(reply.SerializeToString())
        if taken is not None:
            os.utime(tmp, (taken, taken))
        os.replace(tmp, self._path(self.index))

    def withdraw(self) -> None:
        self._path(self.index).unlink(missing_ok=True)

    def others(self) -> list[pb.StatusReply]:
        return self.read()[0]

    def read(self, since: float = float("inf")) -> tuple[list[pb.StatusReply], bool]:
        """The other live processes' statuses, and whether each was taken at or after `since`
        (time.time()): then it shows every stream that opened, ran or closed there before it."""
        now, out, fresh = time.time(), [], True
        for p in self.dir.glob("*.status"):
            if p == self._path(self.index):
                continue
            try:
                taken = p.stat().st_mtime
                if now - taken > STALE_S:
                    continue
                out.append(pb.StatusReply.FromString(p.read_bytes()))
                fresh = fresh and taken >= since
            except (OSError, ValueError):   # replaced or removed while we looked: as if absent
                continue
        return out, fresh


def _recency(r: pb.RankStatus) -> tuple:
    """Which record describes the rank now: the connected one, else the furthest one."""
    return r.connected, r.epoch, r.samples_done


def merge(own: pb.StatusReply, others: list[pb.StatusReply]) -> pb.StatusReply:
    """One reply for all the processes: the answering one's, with the others' added."""
    out = pb.StatusReply(region=own.region, uptime_s=own.uptime_s, processes=1 + len(others))
    jobs: dict[str, pb.JobStatus] = {}
    ranks: dict[str, dict[int, list[pb.RankStatus]]] = {}
    job_streams: dict[str, int] = {}   # each job's streams open, over the processes
    for r in (own, *others):
        out.uptime_s = max(out.uptime_s, r.uptime_s)
        out.streams_open += r.streams_open
        out.rss_mb += r.rss_mb
        out.tasks += r.tasks
        out.threads += r.threads
        out.chunks_changed += r.chunks_changed
        out.scrubbed_bytes += r.scrubbed_bytes
        out.cache_damaged += r.cache_damaged
        out.building.extend(b for b in r.building if b not in out.building)
        out.preparing.extend(p for p in r.preparing if p not in out.preparing)
        out.packings.extend(p for p in r.packings if p not in out.packings)
        out.cache_problems.extend(p for p in r.cache_problems if p not in out.cache_problems)
        out.stuck.extend(r.stuck)
        out.load = max(out.load, r.load)   # (the busiest process: where a new rank may land)
        for j in r.jobs:
            # A process that only hears a job's reports knows neither its world size nor its
            # dataset (world_size 0): the record of a process that streamed it says them.
            if j.job not in jobs or jobs[j.job].world_size < j.world_size:
                jobs[j.job] = j
            job_streams[j.job] = job_streams.get(j.job, 0) + j.streams_open
            for rank in j.ranks:
                ranks.setdefault(j.job, {}).setdefault(rank.rank, []).append(rank)
    for name in sorted(jobs):
        j = jobs[name]
        js = out.jobs.add(job=name, dataset=j.dataset, world_size=j.world_size,
                          elastic=max((o.elastic for r in (own, *others) for o in r.jobs if o.job == name), key=len,
                                      default=""), streams_open=job_streams.get(name, 0))
        for number in sorted(ranks.get(name, {})):
            seen = ranks[name][number]
            merged = js.ranks.add()
            merged.CopyFrom(max(seen, key=_recency))
            for f in SUMMED:
                setattr(merged, f, sum(getattr(s, f) for s in seen))
            # each record counts its process's streams but the first; the others' first ones were restarts too
            merged.restarts = sum(s.restarts for s in seen) + len(seen) - 1
    return out

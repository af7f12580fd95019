"""The processes of one `feeder serve --processes N` port, seen as one feeder.

The kernel hands each new connection to one of the processes (SO_REUSEPORT), so a rank's
stream, and an operator's `feeder status`, land on any of them. Each process therefore
writes its whole status (a StatusReply) to the supervisor's directory every second and when a
stream opens or closes, and a Status call merges the answering process's live status with the
others' (those written in the last STALE_S seconds: a process that died or hangs drops out of
the view).
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

    def publish(self, reply: pb.StatusReply) -> None:
        """This process's status, replaced whole (a reader never sees half of it)."""
        tmp = self.dir / f".{self.index}.tmp"
        tmp.write_bytes(reply.SerializeToString())
        os.replace(tmp, self._path(self.index))

    def withdraw(self) -> None:
        self._path(self.index).unlink(missing_ok=True)

    def others(self) -> list[pb.StatusReply]:
        now, out = time.time(), []
        for p in self.dir.glob("*.status"):
            if p == self._path(self.index):
                continue
            try:
                if now - p.stat().st_mtime > STALE_S:
                    continue
                out.append(pb.StatusReply.FromString(p.read_bytes()))
            except (OSError, ValueError):   # replaced or removed while we looked: as if absent
                continue
        return out


def _recency(r: pb.RankStatus) -> tuple:
    """Which record describes the rank now: the connected one, else the furthest one."""
    return r.connected, r.epoch, r.samples_done


def merge(own: pb.StatusReply, others: list[pb.StatusReply]) -> pb.StatusReply:
    """One reply for all the processes: the answering one's, with the others' added."""
    out = pb.StatusReply(region=own.region, uptime_s=own.uptime_s, processes=1 + len(others))
    jobs: dict[str, pb.JobStatus] = {}
    ranks: dict[str, dict[int, list[pb.RankStatus]]] = {}
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
        for j in r.jobs:
            # A process that only hears a job's reports knows neither its world size nor its
            # dataset (world_size 0): the record of a process that streamed it says them.
            if j.job not in jobs or jobs[j.job].world_size < j.world_size:
                jobs[j.job] = j
            for rank in j.ranks:
                ranks.setdefault(j.job, {}).setdefault(rank.rank, []).append(rank)
    for name in sorted(jobs):
        j = jobs[name]
        js = out.jobs.add(job=name, dataset=j.dataset, world_size=j.world_size,
                          elastic=max((o.elastic for r in (own, *others) for o in r.jobs if o.job == name), key=len,
                                      default=""))
        for number in sorted(ranks.get(name, {})):
            seen = ranks[name][number]
            merged = js.ranks.add()
            merged.CopyFrom(max(seen, key=_recency))
            for f in SUMMED:
                setattr(merged, f, sum(getattr(s, f) for s in seen))
            # each record counts its process's streams but the first; the others' first ones were restarts too
            merged.restarts = sum(s.restarts for s in seen) + len(seen) - 1
    return out

"""Live changes of a scheduled mixture (docs/mixtures.md, "Live changes"): each job's schedule
history on this feeder, the progress its streams have planned, and the log that keeps it.

A change is agreed in two phases by `feeder mix` over every feeder serving the job:
1. prepare: each feeder stops planning past what its streams have planned (rounded up to a
   block) and says where that is. Its streams go on sending what they have built, then wait.
2. commit at P, the largest of those: each feeder splices the new schedule in from P
   (feeder.core.schedule.spliced) and its streams go on. Nothing planned before P changes:
   the old and the spliced schedule agree bit for bit there.
A prepare that sees no commit within HOLD_S lets go (the change is abandoned there; a commit
that comes later still applies only if nothing was planned past its P, else it is refused).

The history is appended to `<cache directory>/schedules/<job hash>.log` (a line per change,
with the schedule's digest, verified on reading), so a restarted feeder, or another sharing the
cache directory, serves the job's current schedule; every cursor carries the schedule in force
too, and a feeder that never heard of a change learns it from the first cursor that does.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
import time
from pathlib import Path

from feeder.core import schedule as sc
from feeder.core.errors import FailedPrecondition

log = logging.getLogger("feeder.schedules")

HOLD_S = 30.0


class Book:
    """One job's schedule on this feeder, and how far its streams have planned."""

    def __init__(self, job: str, schedule: sc.Schedule, log_: "ScheduleLog | None"):
        self.job, self.schedule, self._log = job, schedule, log_
        self.changes: list[tuple[int, int]] = []   # (version, at) of each change known here
        self.planned = 0          # progress below which some stream here has planned (exclusive)
        self.hold: int | None = None
        self.hold_until = 0.0
        self.lock = threading.Lock()

    @property
    def version(self) -> int:
        return self.schedule.version

    def take(self, upto: int) -> sc.Schedule:
        """The schedule a run planned up to progress `upto` (exclusive) is filled with; raises
        schedule.Pending while a change is being agreed and the run reaches past the hold."""
        with self.lock:
            if self.hold is not None:
                if time.monotonic() > self.hold_until:
                    log.warning("job %r: the mixture change prepared here was not committed within %.0f s; going on "
                                "under schedule version %d", self.job, HOLD_S, self.version)
                    self.hold = None
                elif upto > self.hold:
                    raise sc.Pending(f"a change of job {self.job!r}'s mixture schedule is being agreed (at progress "
                                     f"{self.hold:,})")
            self.planned = max(self.planned, upto)
            return self.schedule

    def prepare(self) -> int:
        """Stop planning past the next block boundary; where that is."""
        with self.lock:
            at = -(-self.planned // sc.BLOCK) * sc.BLOCK
            self.hold = at if self.hold is None else max(self.hold, at)
            self.hold_until = time.monotonic() + HOLD_S
            return self.hold

    def abort(self) -> None:
        with self.lock:
            self.hold = None

    def commit(self, new: sc.Schedule, at: int) -> sc.Schedule:
        """Take `new` (the whole schedule, the old one spliced with the change by `feeder mix`)
        from progress `at` on."""
        with self.lock:
            if new.version <= self.version:
                if new.version == self.version and new.digest == self.schedule.digest:   # (a retried commit)
                    return self.schedule
                raise FailedPrecondition(f"job {self.job!r}'s mixture schedule is at version {self.version} here; "
                                         f"change {new.version} is stale (another change came first): run feeder mix "
                                         "again")
            if new.base != self.schedule.base or new.names != self.schedule.names:
                raise FailedPrecondition(f"job {self.job!r}'s mixture schedule here started from {self.schedule.base}"
                                         f" over {list(self.schedule.names)}; the change is of another "
                                         f"({new.base} over {list(new.names)})")
            if at % sc.BLOCK or at < self.planned:
                raise FailedPrecondition(f"job {self.job!r}: a stream here has planned up to progress "
                                         f"{self.planned:,}, past the change's {at:,}; nothing was changed here "
                                         "(run feeder mix again)")
            self._install(new, at)
            self.hold = None
            return new

    def adopt(self, newer: sc.Schedule) -> None:
        """A later version learned from a cursor (a change this feeder missed)."""
        with self.lock:
            if newer.version <= self.version:
                return
            self._install(newer, -1)
            log.info("job %r: mixture schedule version %d learned from a rank's cursor", self.job, newer.version)

    def _install(self, schedule: sc.Schedule, at: int) -> None:
        self.schedule = schedule
        self.changes.append((schedule.version, at))
        if self._log is not None:
            self._log.record(self.job, schedule, at)

    def status(self) -> dict:
        """What `feeder status` shows: the version, each change, and scheduled vs actual shares
        of the progress planned so far."""
        with self.lock:
            s, upto = self.schedule, self.planned
        out = {"version": s.version, "changes": list(self.changes), "progress": upto, "names": s.names,
               "scheduled": [], "actual": []}
        if upto:
            b = sc.blending(s)
            try:
                counts = b.counts(upto)
            except (sc.Pending, FailedPrecondition):
                return out
            out["scheduled"] = [float(x) / upto for x in s.target(upto)]
            out["actual"] = [int(x) / upto for x in counts]
        return out


class ScheduleLog:
    """The changes of each job's schedule, a line each, under <cache>/schedules/."""

    def __init__(self, cache_dir: str):
        self.root = Path(cache_dir) / "schedules"

    def _path(self, job: str) -> Path:
        return self.root / (hashlib.sha256(job.encode()).hexdigest()[:32] + ".log")

    def record(self, job: str, schedule: sc.Schedule, at: int) -> None:
        text = schedule.canonical()
        line = json.dumps({"job": job, "at": at, "schedule": text,
                           "sha256": hashlib.sha256(text.encode()).hexdigest()}) + "\n"
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            fd = os.open(self._path(job), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, line.encode())
            finally:
                os.close(fd)
        except OSError as e:   # the change holds here and in every cursor; a restarted feeder learns it from them
            log.warning("job %r: cannot record mixture schedule version %d in %s: %s", job, schedule.version,
                        self.root, e.strerror)

    def latest(self, job: str, base: str) -> tuple[sc.Schedule, list[tuple[int, int]]] | None:
        """The job's latest recorded schedule of this base, and its changes (None: none recorded).
        A torn, altered or foreign line is skipped."""
        try:
            with open(self._path(job), "rb") as f:
                lines = f.read().splitlines()
        except OSError:
            return None
        best, changes = None, []
        for raw in lines:
            try:
                rec = json.loads(raw)
                text = rec["schedule"]
                if rec["job"] != job or hashlib.sha256(text.encode()).hexdigest() != rec["sha256"]:
                    continue
                s = sc.Schedule.from_canonical(text)
            except (ValueError, KeyError, TypeError, Exception):   # (InvalidArgument: not a schedule)
                continue
            if s.base != base:
                continue
            changes.append((s.version, int(rec.get("at", -1))))
            if best is None or s.version > best.version:
                best = s
        return None if best is None else (best, sorted(set(changes)))


class Schedules:
    """Every job's Book on this feeder."""

    def __init__(self, cache_dir: str = ""):
        self.log = ScheduleLog(cache_dir) if cache_dir else None
        self._books: dict[str, Book] = {}
        self._lock = threading.Lock()

    def book(self, job: str, base: sc.Schedule) -> Book:
        """The job's book (made from the recorded history, or from the schedule the stream asks for)."""
        with self._lock:
            got = self._books.get(job)
            if got is not None:
                if got.schedule.base != base.base:
                    if got.version == 0:   # (the job restarted with another schedule before any change)
                        got = None
                    else:
                        raise FailedPrecondition(
                            f"job {job!r}'s mixture schedule was changed live (version {got.version}) from another "
                            f"starting schedule ({got.schedule.base}) than this stream's ({base.base}); start the new "
                            "schedule under a new job name, or resume with the schedule the job started with")
            if got is None:
                got = Book(job, base, self.log)
                found = self.log.latest(job, base.base) if self.log is not None else None
                if found is not None:
                    got.schedule, got.changes = found
                self._books[job] = got
            return got

    def commit(self, job: str, new: sc.Schedule, at: int) -> sc.Schedule:
        """A change for the job; a feeder that has not served it yet keeps it for when it does."""
        with self._lock:
            got = self._books.get(job)
            if got is None:
                got = self._books[job] = Book(job, new, self.log)
                got._install(new, at)
                return new
        return got.commit(new, at)

    def get(self, job: str) -> Book | None:
        with self._lock:
            return self._books.get(job)

    def jobs(self) -> dict[str, Book]:
        with self._lock:
            return dict(self._books)

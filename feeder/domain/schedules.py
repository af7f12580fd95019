"""Live changes of a scheduled mixture (docs/mixtures.md, "Live changes"): each job's schedule
history on this feeder, the progress its streams have planned, and the log that keeps it.

A change is agreed in two phases by `feeder mix` over every feeder serving the job:
1. prepare: each feeder stops planning past what its streams have planned (rounded up to a
   block) and says where that is (its *hold*). Its streams go on sending what they have built,
   then wait. The hold is recorded before it is answered.
2. commit at P, the largest hold: each feeder takes the whole new schedule (the old one spliced
   with the change at P, feeder.core.schedule.spliced) and its streams go on. Nothing planned
   before P changes: the old and the spliced schedule agree bit for bit there.
A hold ends only with a commit or an abort (`feeder mix` again, or `feeder mix --abort`), or
with a cursor that carries a later schedule (a rank that was served the change elsewhere): a
feeder that timed it out could serve a rank past P under the old schedule while others serve the
new one. It is said in the log every HOLD_NOTE_S while it lasts.

The history is appended to `<cache directory>/schedules/<job hash>.log`, a line per prepare,
commit and abort (each with a SHA-256 of its content, verified on reading; a torn or foreign line
is skipped), so a restarted feeder, or another sharing the cache directory, serves the job's
current schedule and keeps a hold it had promised. Every cursor carries the schedule in force
too, and a feeder that never heard of a change learns it from the first cursor that does.
"""
from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
from pathlib import Path

from feeder.core import schedule as sc
from feeder.core.errors import FailedPrecondition
from feeder.domain.commits import append_line, job_log

log = logging.getLogger("feeder.schedules")

HOLD_NOTE_S = 30.0
# How far past what its streams have planned a feeder records that it may plan, before it plans it
# (a "planned" line): a restarted process replays it, so a change after a restart still lands past
# everything the process before it sent. One line per this many samples of progress per job.
PLANNED_STEP = 16 * sc.BLOCK


class Book:
    """One job's schedule on this feeder, and how far its streams have planned."""

    def __init__(self, job: str, schedule: sc.Schedule, log_: "ScheduleLog | None"):
        self.job, self.schedule, self._log = job, schedule, log_
        self.changes: list[tuple[int, int]] = []   # (version, at) of each change known here (-1: from a cursor)
        self.planned = 0          # progress below which some stream here has planned (exclusive)
        self.recorded = 0         # ... below which it said in the log it may plan (>= planned)
        self.replayed = 0         # ... and below which processes before this one said they may have
        self.hold: int | None = None
        self._noted = 0.0
        self.lock = threading.Lock()

    @property
    def version(self) -> int:
        return self.schedule.version

    @property
    def changed_at(self) -> int:
        return next((at for v, at in reversed(self.changes) if v == self.version), 0)

    def take(self, upto: int) -> sc.Schedule:
        """The schedule a run planned up to progress `upto` (exclusive) is filled with; raises
        schedule.Pending while a change is being agreed and the run reaches past the hold."""
        with self.lock:
            if self.hold is not None and upto > self.hold:
                now = time.monotonic()
                if now - self._noted >= HOLD_NOTE_S:
                    self._noted = now
                    log.warning("job %r: its streams wait at progress %d for a mixture change prepared here to be "
                                "committed or aborted (feeder mix, or feeder mix --abort)", self.job, self.hold)
                raise sc.Pending(f"a change of job {self.job!r}'s mixture schedule is being agreed (at progress "
                                 f"{self.hold:,})")
            if upto > self.recorded and self._log is not None:   # recorded before it is served
                step = max(PLANNED_STEP, upto >> 7)   # (a line per ~0.8% of progress past the first blocks)
                self.recorded = -(-upto // step) * step
                self._log.record(self.job, "planned", at=self.recorded, schedule=self.schedule)
            self.planned = max(self.planned, upto)
            return self.schedule

    def prepare(self) -> int:
        """Stop planning past the next block boundary; where that is."""
        with self.lock:
            at = -(-max(self.planned, self.replayed) // sc.BLOCK) * sc.BLOCK
            self.hold = at if self.hold is None else max(self.hold, at)
            self._noted = time.monotonic()
            if self._log is not None:
                self._log.record(self.job, "prepare", at=self.hold, schedule=self.schedule)
            return self.hold

    def abort(self) -> None:
        with self.lock:
            if self.hold is not None and self._log is not None:
                self._log.record(self.job, "abort", at=self.hold, schedule=self.schedule)
            self.hold = None

    def commit(self, new: sc.Schedule, at: int) -> sc.Schedule:
        """Take `new` (the whole schedule: the old one spliced with the change by `feeder mix`)
        from progress `at` on."""
        with self.lock:
            if new.version <= self.version:
                if new.version == self.version and new.digest == self.schedule.digest:   # (a retried commit)
                    self.hold = None
                    return self.schedule
                raise FailedPrecondition(f"job {self.job!r}'s mixture schedule is at version {self.version} here; "
                                         f"change {new.version} is stale (another change came first): run feeder mix "
                                         "again")
            if new.base != self.schedule.base or new.names != self.schedule.names:
                raise FailedPrecondition(f"job {self.job!r}'s mixture schedule here started from {self.schedule.base}"
                                         f" over {list(self.schedule.names)}; the change is of another "
                                         f"({new.base} over {list(new.names)})")
            before = [g for g in self.schedule.segments if g.at < at]
            if list(new.segments[:len(before)]) != before:
                raise FailedPrecondition(f"job {self.job!r}: the change rewrites the schedule before progress {at:,}, "
                                         "where samples were already planned; a change only splices from its point on")
            if at % sc.BLOCK or at < max(self.planned, self.replayed):
                raise FailedPrecondition(f"job {self.job!r}: a stream here has planned up to progress "
                                         f"{self.planned:,}, past the change's {at:,}; nothing was changed here "
                                         "(run feeder mix again)")
            self._install(new, at)
            return new

    def adopt(self, newer: sc.Schedule) -> None:
        """A later version learned from a cursor (a change this feeder missed, or whose commit
        did not reach it: a rank was served it elsewhere, so it was committed)."""
        with self.lock:
            if newer.version <= self.version:
                return
            # (what processes before this one on its cache directory recorded they may plan counts
            # too: a restart does not make what they sent right)
            old, planned = self.schedule, max(self.planned, self.replayed)
            self._install(newer, -1)
            d = sc.diverges(old, newer)
            if d is None or planned <= d:
                log.info("job %r: mixture schedule version %d learned from a rank's cursor", self.job, newer.version)
                return
        # Streams here planned past the change under the schedule before it: this feeder never
        # heard of the change (feeder mix did not target it, and it did not start from a cache
        # directory the change was recorded in). What they sent cannot be taken back; say so loudly.
        msg = (f"job {self.job!r}: this feeder (or a process before it on its cache directory) served progress up to "
               f"{planned:,} under mixture schedule version {old.version}, past change {newer.version} at progress "
               f"{d:,} that a rank's cursor now brings (feeder mix did not target this feeder, and it did not start "
               f"after the change was recorded in its cache directory): ranks it served past {d:,} were sent the old "
               f"mixture. Resume every rank from a checkpoint taken before progress {d:,}; this feeder now serves "
               f"version {newer.version}")
        log.error("%s", msg)
        raise FailedPrecondition(msg)

    def _install(self, schedule: sc.Schedule, at: int) -> None:
        self.schedule = schedule
        self.changes.append((schedule.version, at))
        self.hold = None
        if self._log is not None:
            self._log.record(self.job, "commit", at=at, schedule=schedule)

    def status(self) -> dict:
        """What `feeder status` shows: the version, each change, and scheduled vs actual shares
        of the progress planned so far."""
        with self.lock:
            s, upto, hold = self.schedule, self.planned, self.hold
        out = {"version": s.version, "changes": list(self.changes), "progress": upto, "names": s.names,
               "scheduled": [], "actual": [], "hold": hold}
        if upto:
            try:
                counts = sc.blending(s).counts(upto)
            except (sc.Pending, FailedPrecondition):
                return out
            out["scheduled"] = [float(x) / upto for x in s.target(upto)]
            out["actual"] = [int(x) / upto for x in counts]
        return out


class ScheduleLog:
    """Each job's prepares, commits and aborts, a line each, under <cache>/schedules/."""

    def __init__(self, cache_dir: str):
        self.root = Path(cache_dir) / "schedules"

    def _path(self, job: str) -> Path:
        return job_log(self.root, job)

    def record(self, job: str, kind: str, *, at: int, schedule: sc.Schedule) -> None:
        body = json.dumps({"job": job, "kind": kind, "at": at, "schedule": schedule.canonical()}, sort_keys=True)
        line = json.dumps({"record": body, "sha256": hashlib.sha256(body.encode()).hexdigest()}) + "\n"
        try:
            append_line(self._path(job), line)
        except OSError as e:   # the change holds here and in every cursor; a restarted feeder learns it from them
            log.warning("job %r: cannot record the mixture schedule's %s in %s: %s", job, kind, self.root, e.strerror)

    def first(self, job: str) -> sc.Schedule | None:
        """The schedule of the job's first valid line (None: none): the base its history starts from."""
        for rec, s in self._records(job):
            return sc.Schedule(names=s.names, segments=s.segments, version=0, base=s.base) if s.version == 0 else s
        return None

    def _records(self, job: str):
        try:
            with open(self._path(job), "rb") as f:
                lines = f.read().splitlines()
        except OSError:
            return
        for raw in lines:
            try:
                outer = json.loads(raw)
                body = outer["record"]
                if hashlib.sha256(body.encode()).hexdigest() != outer["sha256"]:
                    continue
                rec = json.loads(body)
                s = sc.Schedule.from_canonical(rec["schedule"])
                int(rec["at"])
            except Exception:   # (torn, altered, foreign, or not a schedule: InvalidArgument)
                continue
            if rec.get("job") == job:
                yield rec, s

    def replay(self, book: Book, base: str) -> None:
        """Bring a new book to what the log says: the latest schedule of this base, its changes,
        how far earlier processes may have planned, and a hold promised and not yet ended."""
        for rec, s in self._records(book.job):
            if s.base != base:
                continue
            kind, at = rec["kind"], int(rec["at"])
            if kind == "planned":   # (any version's: a process before this one may have sent that far)
                book.replayed = book.recorded = max(book.recorded, at)
            elif kind == "commit" and s.version > book.schedule.version:
                book.schedule = s
                book.changes.append((s.version, at))
                book.hold = None
            elif kind == "prepare" and s.version == book.schedule.version:
                book.hold = at if book.hold is None else max(book.hold, at)
            elif kind == "abort" and s.version == book.schedule.version:
                book.hold = None


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
            if got is not None and got.schedule.base != base.base:
                if got.version == 0 and got.hold is None:   # (the job restarted with another schedule)
                    got = None
                else:
                    raise FailedPrecondition(
                        f"job {job!r}'s mixture schedule was changed live (version {got.version}) from another "
                        f"starting schedule ({got.schedule.base}) than this stream's ({base.base}); start the new "
                        "schedule under a new job name, or resume with the schedule the job started with")
            if got is None:
                got = Book(job, base, self.log)
                if self.log is not None:
                    self.log.replay(got, base.base)
                self._books[job] = got
            return got

    def commit(self, job: str, new: sc.Schedule, at: int) -> sc.Schedule:
        """A change for the job; a feeder that has not served it yet keeps it for when it does."""
        with self._lock:
            got = self._books.get(job)
            if got is None and at % sc.BLOCK:
                raise FailedPrecondition(f"a change takes effect at a multiple of {sc.BLOCK}, got {at}")
            if got is None:   # (no stream of the job yet here: its streams will start from this)
                got = self._books[job] = Book(job, new, self.log)
                if self.log is not None:
                    self.log.replay(got, new.base)
                if got.schedule is new:
                    with got.lock:
                        got._install(new, at)
                    return new
        return got.commit(new, at)

    def get(self, job: str) -> Book | None:
        with self._lock:
            return self._books.get(job)

    def recorded(self, job: str) -> Book | None:
        """The job's book, or one made from the log when no stream of it opened in this process
        yet (a restarted feeder asked to prepare: what its predecessor planned still counts)."""
        with self._lock:
            got = self._books.get(job)
            if got is not None or self.log is None:
                return got
            first = self.log.first(job)
            if first is None:
                return None
            got = self._books[job] = Book(job, first, self.log)
            self.log.replay(got, first.base)
            return got

    def jobs(self) -> dict[str, Book]:
        with self._lock:
            return dict(self._books)

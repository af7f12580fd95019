"""An elastic job's commit log: which global steps committed, in which world, and the cursor
after each (feeder.core.steps).

One file per job under `<cache directory>/elastic/`, appended a line per report, so every
feeder that shares the cache directory (a region's, on its shared filesystem) reads what any
of them was told. A `shrink` job's new replica starts from it: where step S begins depends on
the worlds of the steps committed before S, and a replica that was not there has no cursor.
A line is one write(2) of under 4 KiB in append mode; a torn or foreign line is skipped, and
the cursor in it is verified (HMAC, job, dataset, sampling fields) by the plan that uses it,
like any cursor a rank sends.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

log = logging.getLogger("feeder.commits")

TAIL_BYTES = 1 << 20   # read from the end first: the newest steps are the ones asked for


def job_log(root: Path, job: str) -> Path:
    """A job's log file under `root` (named by the job's hash: any job name is a file name)."""
    return root / (hashlib.sha256(job.encode()).hexdigest()[:32] + ".log")


def append_line(path: Path, line: str) -> None:
    """One write(2) in append mode (a line under 4 KiB lands whole, whoever else appends);
    raises OSError."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


class CommitLog:
    def __init__(self, cache_dir: str):
        self.root = Path(cache_dir) / "elastic"
        self.failed = ""   # why the last record could not be written ("" when it was)

    def _path(self, job: str) -> Path:
        return job_log(self.root, job)

    def record(self, job: str, *, step: int, committed: bool, replicas: int, replica: int, cursor: bytes) -> None:
        line = json.dumps({"job": job, "step": step, "committed": committed, "replicas": replicas,
                           "replica": replica, "cursor": cursor.hex()}) + "\n"
        try:
            append_line(self._path(job), line)
            self.failed = ""
        except OSError as e:   # the trainer goes on: a commit report never blocks or fails a step
            if not self.failed:
                log.warning("elastic commit log %s: %s; a shrink job's new replicas will need their cursor from a "
                            "peer", self.root, e.strerror)
            self.failed = f"{self.root}: {e.strerror}"

    def cursor_after(self, job: str, step: int) -> bytes | None:
        """The cursor after global step `step`, if a replica reported its commit (None: not yet)."""
        path = self._path(job)
        try:
            with open(path, "rb") as f:
                size = f.seek(0, os.SEEK_END)
                for start in ((max(0, size - TAIL_BYTES), 0) if size > TAIL_BYTES else (0,)):
                    f.seek(start)
                    got = _find(f.read(), job, step)
                    if got is not None:
                        return got
        except FileNotFoundError:
            return None
        return None


def _find(data: bytes, job: str, step: int) -> bytes | None:
    """The newest record of `step`'s commit. (Not "none while an earlier step's commit was
    recorded after it", which would tell a job gone back to a checkpoint from the run before: the
    replicas' reports arrive out of order, a replica's slow report of step S-1 after the others'
    of step S, and that rule left a new replica waiting for good: soak seed 990455. A job run
    again from a checkpoint under its name passes its replicas the checkpoint's cursor.)"""
    for line in reversed(data.split(b"\n")):
        try:
            rec = json.loads(line)
            if rec["job"] == job and rec["committed"] and rec["step"] == step:
                return bytes.fromhex(rec["cursor"])
        except (ValueError, KeyError, TypeError):
            continue   # a torn line (a feeder killed mid-write) or the first, cut by the tail's start
    return None

"""Progress for long work: a live bar on a terminal, plain periodic lines otherwise
(CI logs, systemd journals), so a person always sees that work moves and how fast."""
from __future__ import annotations

import sys
import time


class Progress:
    def __init__(self, what: str, total_bytes: int, *, enabled: bool = True, every_s: float = 5.0):
        self.what, self.total = what, max(1, total_bytes)
        self.docs = self.tokens = self.done_bytes = 0
        self.t0 = self._last = time.monotonic()
        self.every_s = every_s
        self._bar = None
        self.enabled = enabled
        if enabled and sys.stderr.isatty():
            from rich.progress import (BarColumn, Progress as RichProgress, TextColumn,
                                       TimeRemainingColumn, TransferSpeedColumn)

            self._bar = RichProgress(TextColumn("[bold]{task.description}"), BarColumn(),
                                     TextColumn("{task.fields[docs]:,} docs {task.fields[tokens]:,} tokens"),
                                     TransferSpeedColumn(), TimeRemainingColumn(), transient=False)
            self._task = self._bar.add_task(what, total=self.total, docs=0, tokens=0)
            self._bar.start()

    def advance(self, *, docs: int = 0, tokens: int = 0, nbytes: int = 0) -> None:
        self.docs += docs
        self.tokens += tokens
        self.done_bytes += nbytes
        if self._bar is not None:
            self._bar.update(self._task, completed=min(self.done_bytes, self.total), docs=self.docs,
                             tokens=self.tokens)
        elif self.enabled and time.monotonic() - self._last >= self.every_s:
            self._last = time.monotonic()
            print(self.line(), file=sys.stderr, flush=True)

    def line(self) -> str:
        dt = max(1e-9, time.monotonic() - self.t0)
        rate = self.done_bytes / dt
        eta = (self.total - self.done_bytes) / rate if rate > 0 else float("inf")
        return (f"{self.what}: {100 * self.done_bytes / self.total:5.1f}% {self.docs:,} docs "
                f"{self.tokens:,} tokens {rate / 1e6:.1f} MB/s ETA {eta:.0f}s")

    def close(self) -> None:
        if self._bar is not None:
            self._bar.update(self._task, completed=self.total)
            self._bar.stop()
        elif self.enabled:
            print(self.line().replace("ETA", "elapsed").rsplit(" ", 1)[0]
                  + f" {time.monotonic() - self.t0:.1f}s", file=sys.stderr, flush=True)

"""One epoch order being built (or waited for, when another process builds it): its progress,
its early part, its failure; what feeder.domain.order_store's builds and `feeder status` share."""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import numpy as np


@dataclass
class Build:
    """One order being built (or waited for, when another process builds it)."""
    name: str
    n: int
    started: float = field(default_factory=time.monotonic)
    progress: np.ndarray = field(default_factory=lambda: np.zeros(2, dtype=np.int64))   # [done, stop]
    here: bool = True           # built by this process (else waited for)
    error: str = ""
    failed_at: float = 0.0      # when it failed: tried again RETRY_S after that, not after its start
    early: np.ndarray | None = None   # its first positions, once drawn (get(early=True))
    early_started: float = 0.0        # when their drawing began (0: not yet)
    early_done: threading.Event = field(default_factory=threading.Event)
    early_progress: np.ndarray = field(default_factory=lambda: np.zeros(2, dtype=np.int64))   # [done, stop]

    def stop(self) -> None:
        """Its loops, the whole's and the early part's, see the flag within milliseconds."""
        self.progress[1] = self.early_progress[1] = 1

    @property
    def fraction(self) -> float:
        return min(1.0, int(self.progress[0]) / max(self.n, 1))

    def describe(self) -> str:
        elapsed = time.monotonic() - self.started
        f = self.fraction
        eta = f" (about {elapsed * (1 - f) / f:.0f} s left)" if f > 0.02 and self.here else ""
        who = "building" if self.here else "waiting for another process to build"
        early = "" if self.early is None else f"; its first {len(self.early):,} positions served meanwhile"
        return f"{who} the epoch's order of {self.n:,} samples ({self.name}): {f:.0%} after {elapsed:.0f} s{eta}{early}"

"""Delivery against demand: whether the feeder serving a rank keeps up with the rank's loop, and
what to do when it does not (slow, not dead: docs/guarantees.md). Pure code, no gRPC, no threads
of its own; the caller passes the time. tests/test_delivery.py drives it without a server.

FeederClient tells a Delivery when its loop began and stopped waiting for a batch, when its
reader began and stopped waiting on the network, when batches arrived, when a stream opened,
and when the feeder said it was preparing. From that, over the last `window_s`:

  * the loop's data-wait: the fraction of the window it spent waiting in next();
  * the reader's network wait: the fraction it spent waiting for the feeder's next reply.

The feeder is slow when the loop waited more than `slow_wait` of the window while the reader
spent at least half of it waiting on the network: the batches were not there because the feeder
(or the link to it) did not send them, not because this process was too busy to decode them
(then moving would only move the problem). "stuck" when nothing arrived at all in the window.

Holds keep a rank from flapping: a target left for slowness is not used again for `hold_s`,
then only after a probe (a side stream from the cursor) shows it delivers comfortably more than
the loop takes; a relapse soon after coming back doubles the hold, up to `max_hold_s`.
"""
from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass

# The reader must have waited on the network this share of the window for the feeder to be
# the bottleneck (below it this process's decode, the GIL or the loop's own threads were).
NETWORK_BOUND = 0.5
# A probe passes when the target delivers at least this multiple of the loop's rate: enough
# headroom that the read-ahead refills after a hiccup, so a target at the edge is not taken back.
PROBE_MARGIN = 1.5


class _Intervals:
    """Closed [start, end] intervals and at most one open one; their overlap with a window."""

    def __init__(self):
        self.closed: deque[tuple[float, float]] = deque()
        self.open_since: float | None = None

    def begin(self, now: float) -> None:
        self.open_since = now

    def end(self, now: float) -> None:
        if self.open_since is not None:
            self.closed.append((self.open_since, now))
            self.open_since = None

    def within(self, now: float, window_s: float) -> float:
        lo = now - window_s
        while self.closed and self.closed[0][1] < lo:
            self.closed.popleft()
        total = sum(min(e, now) - max(s, lo) for s, e in self.closed if e > lo)
        if self.open_since is not None:
            total += now - max(self.open_since, lo)
        return total


@dataclass
class Hold:
    until: float       # not used again before this
    hold_s: float      # the hold it was given
    back_at: float = -1.0   # when the rank came back to it (a relapse soon after doubles the hold)


class Delivery:
    """One rank's delivery against its demand (thread-safe: the loop, the reader and the
    watchdog threads call it)."""

    def __init__(self, window_s: float = 3.0, slow_wait: float = 0.05, hold_s: float = 15.0,
                 max_hold_s: float = 40.0):
        self.window_s, self.slow_wait = window_s, slow_wait
        self.hold_s, self.max_hold_s = hold_s, max_hold_s
        self._lock = threading.Lock()
        self._wait = _Intervals()      # the loop waiting in next()
        self._net = _Intervals()       # the primary reader waiting for a reply
        self._took: deque[float] = deque()      # when the loop took a batch
        self._arrived: deque[tuple[float, int]] = deque()   # (when, batches) handed to the loop
        self.opened_at = -1e18         # the primary stream's last (re)open
        self.prepared_at = -1e18       # the feeder last said it prepares (an order, a snapshot)
        self.holds: dict[str, Hold] = {}
        self.taken = self.delivered = 0

    # the loop
    def wait_began(self, now: float) -> None:
        with self._lock:
            self._wait.begin(now)

    def took(self, now: float) -> None:
        with self._lock:
            self._wait.end(now)
            self._took.append(now)
            self.taken += 1
            _trim(self._took, now - self.window_s)

    # the reader
    def net_began(self, now: float) -> None:
        with self._lock:
            self._net.begin(now)

    def net_ended(self, now: float) -> None:
        with self._lock:
            self._net.end(now)

    def arrived(self, now: float, n: int) -> None:
        with self._lock:
            self._arrived.append((now, n))
            self.delivered += n
            while self._arrived and self._arrived[0][0] < now - self.window_s:
                self._arrived.popleft()

    def opened(self, now: float) -> None:
        with self._lock:
            self.opened_at = now
            self._net = _Intervals()

    def preparing(self, now: float) -> None:
        with self._lock:
            self.prepared_at = now

    # the watchdog
    def waiting_for(self, now: float) -> float:
        """How long the loop has been waiting for its next batch (0: it is not waiting)."""
        since = self._wait.open_since
        return 0.0 if since is None else now - since

    def figures(self, now: float) -> dict:
        """The window's data-wait and network-wait fractions, batches per second taken by the
        loop and delivered to it, and the loop's own rate (batches per second of its time not
        spent waiting: its demand)."""
        with self._lock:
            w = self.window_s
            wait, net = self._wait.within(now, w) / w, self._net.within(now, w) / w
            _trim(self._took, now - w)
            took = len(self._took)
            got = sum(n for t, n in self._arrived if t >= now - w)
        busy = max(w * (1 - wait), 1e-3)
        return {"data_wait": min(wait, 1.0), "network_wait": min(net, 1.0), "consumed_per_s": took / w,
                "delivered_per_s": got / w, "demand_per_s": took / busy}

    def verdict(self, now: float) -> str:
        """"slow" or "stuck" when the feeder serving the rank is the reason its loop waits (see
        the module's doc); "" otherwise, and always within a window of a (re)open or of the
        feeder saying it prepares (an epoch's order being built is no slowness)."""
        if not self.slow_wait or now - self.opened_at < self.window_s or now - self.prepared_at < 2 * self.window_s:
            return ""
        f = self.figures(now)
        if f["data_wait"] <= self.slow_wait or f["network_wait"] < NETWORK_BOUND:
            return ""
        return "stuck" if f["delivered_per_s"] == 0 else "slow"

    # holds: hysteresis
    def leave(self, target: str, now: float) -> float:
        """The rank leaves `target` for slowness: it is held off for hold_s, doubled (up to
        max_hold_s) when the rank had come back to it less than two holds ago. Returns the hold."""
        old = self.holds.get(target)
        hold = self.hold_s
        if old is not None and old.back_at >= 0 and now - old.back_at < 2 * old.hold_s:
            hold = min(self.max_hold_s, 2 * old.hold_s)
        self.holds[target] = Hold(until=now + hold, hold_s=hold)
        return hold

    def held(self, target: str, now: float) -> bool:
        h = self.holds.get(target)
        return h is not None and now < h.until

    def due_probe(self, target: str, now: float) -> bool:
        """A target left for slowness whose hold is over: probe it before moving back."""
        h = self.holds.get(target)
        return h is not None and h.back_at < 0 and now >= h.until

    def probe_failed(self, target: str, now: float) -> float:
        """Its probe delivered too little: held again, twice as long (up to max_hold_s)."""
        h = self.holds[target]
        h.hold_s = min(self.max_hold_s, 2 * h.hold_s)
        h.until = now + h.hold_s
        return h.hold_s

    def left_for_slowness(self, target: str) -> bool:
        """Held off, or waiting for its probe: only a probe brings the rank back to it."""
        h = self.holds.get(target)
        return h is not None and h.back_at < 0

    def came_back(self, target: str, now: float) -> None:
        h = self.holds.get(target)
        if h is not None:
            h.back_at = now

    @staticmethod
    def probe_passes(rate_per_s: float, demand_per_s: float) -> bool:
        return rate_per_s >= PROBE_MARGIN * demand_per_s


def _trim(times: deque, lo: float) -> None:
    while times and times[0] < lo:
        times.popleft()

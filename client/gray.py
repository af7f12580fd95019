"""Slow, not dead (docs/guarantees.md): a FeederClient's moves off a feeder that delivers less than
its loop consumes, its probes before moving back, and its hedged reads.

The watchdog calls Gray.tick() four times a second. The decisions are client.delivery's (pure);
this module carries them out:

  * move: the feeder serving the rank is slow or stuck (Delivery.verdict): the rank moves to
    the best other target (nearest first, then least loaded, never one that is held, refused or
    says its reads of this dataset are stuck) from the cursor of the last batch queued, exactly
    as after a break, and the slow target is held off (Delivery.leave);
  * probe: a held target whose hold is over is read on a side stream from the cursor for up to
    PROBE_S; if it delivers PROBE_MARGIN times what the loop takes, the rank moves back to it,
    else it is held again, twice as long (no flapping: a target comes back only on evidence);
  * hedge (ClientConfig.hedge): while the read-ahead is below its floor, a side stream on the
    best other target reads the same batches from the cursor; whichever copy of a batch arrives
    first is handed to the loop and the other is dropped by its index in the stream (and its
    cursor checked equal: same cursor, same batch, from any feeder). When the side stream
    delivers most batches, the rank moves there.

A side stream is a StreamRequest with `hedge` set: it takes no slot on the feeder (it neither
replaces the rank's stream nor is fenced against it) and the feeder's ledger marks its batches
as copies, so `feeder audit` counts each batch once.
"""
from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import grpc

from feeder.core.errors import FeederError
from feeder.v1 import feeder_pb2 as pb

from .delivery import Delivery
from .policy import OVERLOADED, rtt_step

log = logging.getLogger("feeder_client")

PROBE_S = 3.0            # a probe of a held target reads for at most this long ...
PROBE_BATCHES = 24       # ... or until this many batches arrived after its first reply
HEDGE_MIN_BATCHES = 8    # a hedge is judged (move there or not) after this many batches handed over
LOAD_AVOIDED = OVERLOADED   # a target whose load is above this is taken only when no other will do


@dataclass
class Side:
    """A side stream (a hedge or a probe) and what it delivered."""
    target: str
    purpose: str                   # "hedge" | "probe"
    started: float
    primary_before: int            # batches the primary had handed over when it started
    stop: threading.Event = field(default_factory=threading.Event)
    call: object = None
    thread: threading.Thread | None = None
    arrivals: list = field(default_factory=list)   # (when, batches) per reply with batches
    handed: int = 0                # batches of its copy handed to the loop (it was first)
    dropped_bytes: int = 0
    error: str = ""
    done: bool = False
    promoted: int | None = None    # the primary's batches handed over when the rank moved to this target

    def rate(self) -> tuple[float, int]:
        """Batches per second after its first reply (the feeder's start and the first burst
        are not the link's rate), and the batches that rate is measured over."""
        if len(self.arrivals) < 2:
            return 0.0, 0
        n = sum(b for _, b in self.arrivals[1:])
        span = self.arrivals[-1][0] - self.arrivals[0][0]
        return (n / span if span > 0 else 0.0), n

    def end(self) -> None:
        self.stop.set()
        call = self.call
        if call is not None:
            call.cancel()


class Gray:
    """The gray-failure side of one FeederClient (its `gray`)."""

    def __init__(self, client):
        self.c = client
        cfg = client.cfg
        self.delivery = Delivery(cfg.slow_window_s, cfg.slow_wait, cfg.slow_hold_s, max(cfg.slow_hold_s, 40.0))
        self.side: Side | None = None
        self.hedged_bytes = 0           # bytes of copies received and dropped (hedges and probes)
        self.hedges = 0                 # hedged side streams opened
        self._low_ticks = 0             # consecutive ticks with the read-ahead below its floor
        self._full_since: float | None = None
        self._noted = ""                # the last "nowhere to move" line logged

    # the primary stream's accounting (FeederClient.__next__, _read)
    def tick(self) -> None:
        try:
            self._tick()
        except Exception as e:   # the watchdog also ends silent streams: it must go on
            log.error("rank %d: judging the feed failed: %r", self.c.cfg.spec.rank, e)

    def _tick(self) -> None:
        c, now = self.c, time.monotonic()
        if c._closed or c.policy.failback is not None:
            return
        side = self.side
        if side is not None and side.purpose == "probe":
            self._judge_probe(side, now)
            return
        if side is not None and side.done:
            self.side = side = None
        verdict = self.delivery.verdict(now)
        if verdict:
            self._move_off(verdict, now)
            return
        if c.cfg.hedge:
            self._hedge(now)
        if self.side is None:
            self._maybe_probe(now)

    # moving
    def _move_off(self, why: str, now: float) -> None:
        c = self.c
        current = c.policy.target
        f = self.delivery.figures(now)
        side = self.side
        prefer = side.target if side is not None and side.purpose == "hedge" and side.handed else ""
        to = self._best(exclude={current}, now=now, prefer=prefer)
        if to is None:
            if current != self._noted:   # (once per target, whether it is slow or stuck by turns)
                self._noted = current
                log.warning("rank %d: feeder %s is %s but no other target can take the rank (the loop waited "
                            "%.0f%% of the last %.0f s); staying", c.cfg.spec.rank, current, why,
                            100 * f["data_wait"], self.delivery.window_s)
            return
        self._noted = ""
        hold = self.delivery.leave(current, now)
        log.warning("rank %d: feeder %s is %s: the loop waited %.0f%% of the last %.0f s, %.1f batches/s delivered "
                    "for %.1f taken; moving to %s from the cursor (%s held off for %.0f s, then probed)",
                    c.cfg.spec.rank, current, why, 100 * f["data_wait"], self.delivery.window_s,
                    f["delivered_per_s"], f["consumed_per_s"], to, current, hold)
        self._stop_side()
        self._move(to, why)

    def _move(self, target: str, why: str) -> None:
        c = self.c
        i = c.targets.index(target)
        with c._lock:
            if c.policy.move(i, why) and c._call is not None:
                c._call.cancel()

    def _best(self, exclude: set, now: float, prefer: str = "") -> str | None:
        """The target to move or hedge to: not excluded, refused or held; nearest first (by
        rtt_step, as at the start), then least loaded, from each one's Info (those saying their
        reads of this dataset are stuck, or not answering, are left out); `prefer` first if it
        qualifies (a hedge that already delivers)."""
        c = self.c
        cand = [t for t in dict.fromkeys(c.targets)
                if t not in exclude and t not in c.policy.refused and not self.delivery.held(t, now)]
        if not cand:
            return None
        info = self._info(cand)
        ok = [t for t in cand if info.get(t) is not None and not self._stuck(info[t])]
        if not ok:
            return None
        if prefer in ok:
            return prefer
        order = {t: k for k, t in enumerate(c.targets)}
        return min(ok, key=lambda t: (info[t].load > LOAD_AVOIDED, rtt_step(c.rtt_s.get(t, float("inf"))),
                                      round(info[t].load, 1), order[t]))

    def _info(self, targets: list[str]) -> dict:
        c = self.c
        md = c.cfg.security.metadata()
        dataset = c.cfg.spec.dataset

        def ask(t):
            try:
                return c.transport.stub(t).Info(pb.InfoRequest(dataset=dataset), timeout=1.0, metadata=md)
            except (grpc.RpcError, ValueError):
                return None
        with ThreadPoolExecutor(len(targets)) as ex:
            return dict(zip(targets, ex.map(ask, targets)))

    def avoid(self, targets: list[str]) -> frozenset[str]:
        """Of `targets`, those overloaded or stuck on this rank's data (by each one's Info)."""
        if not targets:
            return frozenset()
        info = self._info(targets)
        return frozenset(t for t, i in info.items() if i is not None and (i.load > LOAD_AVOIDED or self._stuck(i)))

    def _stuck(self, info) -> bool:
        names = {n for n, _ in self.c.cfg.spec.mixture} or {self.c.cfg.spec.dataset}
        return any(s.partition(":")[0] in names or "" in names for s in info.stuck)

    # probing a held target before moving back
    def _maybe_probe(self, now: float) -> None:
        c = self.c
        current = c.policy.index % len(c.targets)
        for i, t in enumerate(c.targets[:current]):
            if t not in c.policy.refused and self.delivery.due_probe(t, now):
                self._start_side(t, "probe", now)
                return

    def _judge_probe(self, side: Side, now: float) -> None:
        rate, n = side.rate()
        if not side.done and n < PROBE_BATCHES and now - side.started < PROBE_S:
            return
        self._stop_side()
        demand = self.delivery.figures(now)["demand_per_s"]
        if not side.error and n and self.delivery.probe_passes(rate, demand):
            log.info("rank %d: feeder %s delivers again (%.1f batches/s on a probe, the loop takes %.1f); "
                     "moving back to it", self.c.cfg.spec.rank, side.target, rate, demand)
            self.delivery.came_back(side.target, now)
            self._move(side.target, "failback")
        else:
            hold = self.delivery.probe_failed(side.target, now)
            log.info("rank %d: feeder %s is still slow (a probe: %s); probed again in %.0f s", self.c.cfg.spec.rank,
                     side.target, side.error or f"{rate:.1f} batches/s for {demand:.1f} taken", hold)

    # hedging
    def _hedge(self, now: float) -> None:
        c = self.c
        floor = max(1, c._q.capacity // 2)
        low = len(c._q) < floor
        self._low_ticks = self._low_ticks + 1 if low else 0
        side = self.side
        if side is None:
            # below the floor for two ticks, or the loop waiting already (a stream that starts slow)
            if self._low_ticks >= 2 or (low and self.delivery.waiting_for(now) > 0.1):
                to = self._best(exclude={c.policy.target}, now=now)
                if to is not None:
                    self.hedges += 1
                    self._start_side(to, "hedge", now)
            return
        if side.promoted is None and side.target == c.policy.target:
            # the rank failed over to the hedge's target meanwhile: one stream there is enough
            self._stop_side()
            return
        if side.promoted is not None:
            # the rank moved to the hedge's target: the hedge covers the new stream's start
            if c.policy.target != side.target or c._handed > side.promoted:
                self._stop_side()
            return
        primary = c._handed - side.primary_before
        if side.handed >= HEDGE_MIN_BATCHES and side.handed > 2 * primary:
            # the copy from the other target is first most of the time: the rank belongs there
            self.delivery.leave(c.policy.target, now)
            log.warning("rank %d: hedged reads from %s came first %d times to %d; moving there from %s",
                        c.cfg.spec.rank, side.target, side.handed, primary, c.policy.target)
            side.promoted = c._handed
            self._move(side.target, "slow")
            return
        # the read-ahead stayed full a whole window: the primary keeps up on its own again
        self._full_since = (self._full_since or now) if not low else None
        if self._full_since is not None and now - self._full_since >= self.delivery.window_s:
            self._stop_side()

    # side streams
    def _start_side(self, target: str, purpose: str, now: float) -> None:
        c = self.c
        side = Side(target=target, purpose=purpose, started=now, primary_before=c._handed)
        self.side, self._full_since = side, None
        side.thread = threading.Thread(target=self._run_side, args=(side,), daemon=True,
                                       name=f"feeder-client-r{c.cfg.spec.rank}-{purpose}")
        side.thread.start()

    def _stop_side(self) -> None:
        side, self.side = self.side, None
        if side is not None:
            side.end()

    def _run_side(self, side: Side) -> None:
        c = self.c
        try:
            stub = c.transport.stub(side.target)
            with c._gate:   # the cursor and the index of the batch after it, together
                request, first = c._request(side.target, hedge=True), c._seq
            call = side.call = c.transport.open(stub, request)
            if side.stop.is_set():
                call.cancel()
                return
            reader = c.reader(side.target, first, side)
            for reply in call:
                if side.stop.is_set():
                    return
                if reply.waiting and not reply.batches:
                    continue
                side.arrivals.append((time.monotonic(), len(reply.batches)))
                if not c._hand_reply(reply, reader):
                    return
        except grpc.RpcError as e:
            if not side.stop.is_set():
                side.error = f"{e.code().name}: {e.details()}"
        except FeederError as e:   # a corrupt copy (or one that differs): this side stream ends
            side.error = str(e)
            log.error("rank %d: a %s stream from %s ended: %s", c.cfg.spec.rank, side.purpose, side.target, e)
        finally:
            side.done = True
            if side.call is not None:
                side.call.cancel()

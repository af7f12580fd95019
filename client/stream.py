"""FeederClient: one rank's stream of batches, with bounded read-ahead and failover.

A background thread reads the gRPC stream, decodes each batch into torch tensors and puts
it in a queue of at most `read_ahead` batches. When a stream breaks (feeder killed,
connection reset, feeder silent past `idle_timeout_s`), the thread reopens it on the next
target from the cursor of the last batch it queued, so the consumer sees every batch once,
in order, and never an error for a failure another feeder can cover.

The parts: .transport (gRPC calls), .policy (which target next, how long to wait, when to
give up: pure code), .decode (reply -> tensors), .handoff (the queue to the training loop). This module wires them together on two threads: the reader and a watchdog.
"""
from __future__ import annotations

import atexit
import logging
import os
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor

import grpc
import torch

from .config import PLAIN, ClientConfig, process_started_ns
from .decode import DTYPES, FeederBatch, decode, pinned
from .gray import Gray
from .handoff import END as _END
from .handoff import Handoff
from .handing import Handing
from .policy import RETRYABLE, Finish, GiveUp, Policy, Retry, order_targets, other_region, rtt_step
from .transport import Transport, channel_options, feeder_info, measure_rtt
from feeder.core.errors import COMPLETE, ELSEWHERE, END, Code, FeederError
from feeder.core.malloc import keep_freed_memory
from feeder.core.order import torch_kind
from feeder.service.security import explain
from feeder.service.convert import CODES, COMPRESSION_ENUM as COMPRESSION, stream_request
from feeder.v1 import feeder_pb2 as pb

__all__ = ["ClientConfig", "FeederBatch", "FeederClient", "Handoff", "decode", "feeder_info", "pinned",
           "channel_options", "measure_rtt", "rtt_step", "CODES", "COMPRESSION", "DTYPES", "PLAIN", "RETRYABLE"]

log = logging.getLogger("feeder_client")

# Clients not yet closed, closed at interpreter exit while gRPC is still whole: a client (or a
# FeederDataset's iterator) held in a module-level global is otherwise closed during module
# teardown, when grpc's own globals are already gone, and Python prints "Exception ignored in
# <generator FeederDataset.__iter__>" with a traceback from grpc.
_open_clients: "weakref.WeakSet[FeederClient]" = weakref.WeakSet()


@atexit.register
def _close_open_clients() -> None:
    for client in list(_open_clients):
        if client._pid != os.getpid():   # a forked child's copy: its threads and calls are the parent's
            continue
        try:
            client.close()
        except Exception as e:   # exiting anyway: one line, never a traceback
            log.debug("closing a feeder client at exit: %r", e)


class _NotThisTarget(Exception):
    """The target answered as a feeder of another of the rank's regions (policy.other_region)."""


class Incomplete(Exception):
    """A stream closed with status OK but without the feeder's end marker."""


# A feeder building an epoch's order tells the rank every ~2 s; the rank's log says so this often.
WAITING_LOG_S = 30.0

class FeederClient(Handing):
    """One rank's stream of batches (FeederBatch), in order, each once, across failovers.

    The lower-level half of FeederDataset, without torch's Dataset protocol: iterate it.

    Args:
        cfg: the stream (cfg.spec), the feeders that may serve it (cfg.targets), where to
            resume (cfg.cursor) and the transport knobs; see ClientConfig.

    Attributes (read them; the client sets them):
        cursor: of the last batch queued (where a reopened stream resumes), not of the
            last one taken: save `batch.cursor` of the batch the loop took instead.
        region, target: the region and feeder serving this rank now.
        targets: the feeders in preference order (nearest first once measured).
        rtt_s: measured round trip per target.
        failovers, failbacks: streams reopened after a break; moves back to a more
            preferred target that answered again.
        wait_s: seconds spent waiting in next().
        read_ahead: the queue's capacity now (grows with the round trip).

    Threads and processes: the stream starts at once, on a background reader thread (plus
    a watchdog); create the client in the process that uses it (after any fork) and close()
    it when done. Iterate from one thread.
    """

    def __init__(self, cfg: ClientConfig):
        self.cfg = cfg
        # "torch" (or none named) is this process's torch release's randperm: the feeder draws the
        # order exactly as torch here would, whatever torch (if any) the feeder host has.
        p = cfg.spec.permutation
        self._permutation = torch_kind(torch.__version__) if p in ("", "torch") else p
        if cfg.keep_freed_memory:
            keep_freed_memory()
        self.cursor = cfg.cursor          # of the last batch queued (where a reopened stream starts)
        self._phase = cfg.spec.worker_phase   # round-robin index of the batch after self.cursor
        self._started_ns = cfg.spec.client_started_ns or process_started_ns()   # fences a replaced trainer
        # Once a stream of ours has delivered a reply, every later one continues it (StreamSpec.continued).
        # Not at the first request: one that never reached a feeder (a dead link) opened nothing,
        # and its retry must be a first stream, or a replacement would be fenced as a reconnect.
        self._opened = False
        self._waiting_logged = -WAITING_LOG_S
        self.region = ""                  # the region feeding this rank now (from the feeder's replies)
        self.waiting = ""                 # what the feeder said it prepares before the stream starts, if it does
        self.waited = 0                   # such notes received
        self.targets = list(cfg.targets)  # nearest first once measured
        self.rtt_s: dict[str, float] = {}
        self.policy = Policy(self.targets, cfg.retry_for_s, cfg.failback_s, time.monotonic(), cfg.spec.rank,
                             connect_timeout_s=cfg.connect_timeout_s)
        self._answered: set[str] = set()   # targets that answered us once: their breaks are no TLS mismatch
        self._named = dict(zip(cfg.targets, cfg.regions))   # target -> the region it was named for (if any)
        self.transport = Transport(cfg)
        self._step_ema: float | None = None
        self._taken = 0
        self.wait_s = 0.0                 # time the consumer spent waiting in __next__
        self._q = Handoff(cfg.read_ahead)
        # Batches are numbered in the order the loop takes them (self._seq: the next one's). Each
        # stream knows the number of its next batch, so of two streams read from the same cursor
        # (a hedge, a probe) the first copy of a batch is handed over and the other dropped.
        self._gate = threading.Lock()     # self._seq, self.cursor and the queue's order, together
        self._seq = 0
        self._handed = 0                  # batches the primary stream handed over (the rest came from side streams)
        self._recent: dict[int, bytes] = {}   # number -> cursor of the last RECENT batches handed over
        # Without CUDA, numpy's allocator: a pool of reused arrays was measured here and was no
        # faster (its freed blocks are reused already).
        self._alloc = pinned if (torch.cuda.is_available() if cfg.pin_memory is None else cfg.pin_memory) else None
        # The device of the thread that made this client (a rank's own GPU): the stream thread
        # pins on it too, rather than open a context on GPU 0 (as DataLoader's pin thread does).
        self._device = torch.cuda.current_device() if self._alloc is not None else None
        self._stop = threading.Event()
        self._call = None
        self._lock = threading.Lock()
        self._waiting_since: float | None = None
        self._idle_cancelled = False
        self._report = [0.0, 0.0, 0, time.monotonic()]  # wait, step, batches, since
        # Set by the loop when it has taken a read-ahead's worth since the last report: the
        # feeder's view of what was taken then lags by at most that (status, metrics).
        self._wake = threading.Event()
        self._report_due = False
        self._reported_position: tuple[int, int] | None = None
        self._last_next = None
        self._position: tuple[int, int] | None = None   # (epoch, step) of the last batch taken
        self._stub = None
        self._report_lock = threading.Lock()
        self.gray = Gray(self)             # moves off a slow feeder, probes, hedged reads
        self._thread = threading.Thread(target=self._run, name=f"feeder-client-r{cfg.spec.rank}", daemon=True)
        self._watchdog = threading.Thread(target=self._watch, name="feeder-client-watchdog", daemon=True)
        self._closed = False
        self._pid = os.getpid()
        _open_clients.add(self)
        self._thread.start()
        self._watchdog.start()

    # consumer side
    def __iter__(self):
        return self

    def __next__(self) -> FeederBatch:
        """The next batch, waiting for it if the read-ahead is empty.

        Raises:
            StopIteration: at the stream's complete end (its last epoch delivered).
            FeederError: when no target can serve the rank: a refusal every target gave
                (its code kept), a request error, a corrupt batch that is not DATA_LOSS, or
                `retry_for_s` without a batch.
        """
        t0 = time.monotonic()
        self.gray.delivery.wait_began(t0)
        item = self._q.get()
        t1 = time.monotonic()
        self.gray.delivery.took(t1)
        self.wait_s += t1 - t0
        if self._last_next is not None:
            step = t1 - self._last_next
            with self._report_lock:
                r = self._report
                r[0] += t1 - t0
                r[1] += step
                r[2] += 1
            self._step_ema = step if self._step_ema is None else 0.8 * self._step_ema + 0.2 * step
        self._last_next = t1
        self._taken += 1
        if self._taken % 8 == 0:
            self._size_read_ahead()
        if item is _END and self._closed:   # closed (from another thread): not the stream's end
            raise StopIteration
        if item is _END:
            # The feeder shows a rank "finished" only once it knows the loop took the last batch.
            self._report_due = True
            if self._stub is not None:
                self._maybe_report(self._stub)
            raise StopIteration
        if isinstance(item, BaseException):
            raise item
        self._position = (item.epoch, item.step)
        if self._report[2] >= self._q.capacity and time.monotonic() - self._report[3] >= 0.25:
            self._report_due = True   # the watchdog reports this position now
            self._wake.set()
        return item

    def _size_read_ahead(self) -> None:
        """Enough batches in hand to ride out 2.5 round trips (a reopened stream, jitter, a slow
        message) at the rate the loop takes them: a far region then feeds as if it were near.
        On a near link this stays at read_ahead: a deeper queue only costs cache and memory."""
        step, rtt = self._step_ema, self.rtt_s.get(self.target, 0.0)
        if not step or rtt == float("inf"):
            return
        want = min(self.cfg.max_read_ahead, max(self.cfg.read_ahead, int(2.5 * rtt / max(step, 1e-5)) + 2))
        if want != self._q.capacity:
            self._q.resize(want)

    @property
    def target(self) -> str:
        """The feeder this rank streams from now (or will try next)."""
        return self.policy.target

    @property
    def target_index(self) -> int:
        """Position in `targets` (counts up through failovers; modulo len(targets))."""
        return self.policy.index

    @property
    def failovers(self) -> int:
        """Streams reopened after a break."""
        return self.policy.failovers

    @property
    def failbacks(self) -> int:
        """Moves back to a more preferred target that answered again."""
        return self.policy.failbacks

    @property
    def read_ahead(self) -> int:
        """Batches the queue holds now (grows with the round trip, up to max_read_ahead)."""
        return self._q.capacity

    def close(self) -> None:
        """Stop the stream and its threads and close the channels; idempotent.

        The batches still queued are dropped. Waits up to 5 s for each thread.
        """
        if self._closed:
            return
        self._closed = True
        _open_clients.discard(self)
        self._stop.set()
        self._wake.set()
        self.gray._stop_side()
        with self._lock:
            if self._call is not None:
                self._call.cancel()
        self._q.close()  # unblock a reader waiting for room, and a loop waiting for a batch (it ends)
        self._thread.join(5)
        if self._watchdog.ident is not None:   # it may be mid-report: let it finish before its channel goes
            self._watchdog.join(5)
        self.transport.close()

    def __del__(self):
        try:
            self._stop.set()
        except Exception:
            pass

    # reader side
    def _request(self, target: str, hedge: bool = False) -> pb.StreamRequest:
        """The request that continues the stream after the last batch queued (hold self._gate)."""
        return stream_request(self.cfg.spec, self.cursor, worker_phase=self._phase,
                              reshard=self.cfg.spec.reshard and self.cursor == self.cfg.cursor,
                              failover=self.policy.after_break and not hedge, rtt_s=self.rtt_s.get(target, 0.0),
                              client_started_ns=self._started_ns, continued=self._opened or hedge,
                              permutation=self._permutation, hedge=hedge)

    def _put(self, item) -> bool:
        return self._q.put_many([item], self._stop)

    def _order_targets(self) -> None:
        """Nearest first: every target's RTT measured at once (unreachable ones go last). The
        RTT also sizes read-ahead and tells the feeder whether this rank is remote."""
        with ThreadPoolExecutor(len(self.targets)) as ex:
            rtts = list(ex.map(self.transport.rtt, self.targets))
        self.rtt_s = dict(zip(self.targets, rtts))
        # and how each is doing: a new rank prefers, among feeders as near, one that is neither
        # overloaded nor stuck on its data (each one's Info; a feeder that predates them says 0)
        avoid = self.gray.avoid([t for t, rtt in self.rtt_s.items() if rtt != float("inf")])
        self._answered.update(t for t, rtt in self.rtt_s.items() if rtt != float("inf"))
        if self._answered:
            self.policy.reached()
        self.targets[:] = order_targets(self.targets, self.rtt_s, self.cfg.prefer, avoid)   # the policy's list too
        names = dict(zip(self.cfg.targets, self.cfg.regions or self.cfg.targets))
        log.info("rank %d targets, in order: %s", self.cfg.spec.rank, ", ".join(
            f"{names[t]} {self.rtt_s[t] * 1e3:.1f} ms" if self.rtt_s[t] != float("inf") else f"{names[t]} (down)"
            for t in self.targets))

    def _run(self) -> None:
        # Whatever goes wrong in here must reach the training loop: an exception that ended
        # this thread unseen would leave the loop waiting in __next__ forever.
        try:
            self._stream()
        except BaseException as e:
            if not self._stop.is_set():
                log.error("rank %d: the stream thread failed: %r", self.cfg.spec.rank, e)
            self._put(e)

    def _stream(self) -> None:
        """Open streams until one ends complete, the policy gives up, or close()."""
        if self._device is not None:
            torch.cuda.set_device(self._device)
        self._order_targets()
        while not self._stop.is_set():
            target = self.policy.target
            action = self._attempt(target)
            if action is None:          # close() while handing batches over
                return
            if isinstance(action, Finish):
                self._put(_END)
                return
            if isinstance(action, GiveUp):
                self._put(action.error)
                return
            if action.wait_s:
                self._stop.wait(action.wait_s)

    def _attempt(self, target: str) -> Finish | GiveUp | Retry | None:
        """One stream on `target`, read to its end; what the policy says to do next."""
        rank = self.cfg.spec.rank
        try:
            return self._read(target)
        except grpc.RpcError as e:
            if self._stop.is_set():
                return None
            code, elsewhere = e.code(), any(k == ELSEWHERE for k, _ in e.trailing_metadata() or ())
            why = ("silent past the idle timeout" if self._idle_cancelled
                   else explain(e, target, self.cfg.security, answered=target in self._answered).partition(": ")[2])
            failback, moving = self.policy.failback, self.policy.moving
            action = self.policy.error(code.name, f"feeder {target}: {e.details()}", f"{target}: {why}",
                                       time.monotonic(), elsewhere=elsewhere, answered=target in self._answered)
            if moving:   # ended by us to move off a slow feeder (client.gray logged why)
                pass
            elif failback is not None:
                log.info("rank %d: %s answers again; moving back to it from %s", rank, action.target, target)
            elif elsewhere and isinstance(action, Retry):
                log.error("feeder %s refused rank %d: %s; trying the next region", target, rank, e.details())
            elif isinstance(action, Retry) and self.policy.worth_logging(target, why):
                log.warning("stream broke (%s: %s); failing over to %s", target, why, action.target)
            return action
        except _NotThisTarget as e:
            why = f"{target}: {e}"
            action = self.policy.refuse(why, Code.UNAVAILABLE)
            if isinstance(action, Retry):
                log.error("target %s %s; trying the next", target, e)
            return action
        except Incomplete:
            why = f"{target}: the stream ended without its end marker"
            action = self.policy.broke(why, time.monotonic())
        except FeederError as e:  # corrupt batch: never served; another feeder may have good data
            why = f"{target}: {e}"
            action = self.policy.corrupt(e, why, time.monotonic())
        if isinstance(action, Retry) and self.policy.worth_logging(target, why):
            log.warning("stream broke (%s); failing over to %s", why, action.target)
        return action

    def _read(self, target: str) -> Finish | None:
        """Read one stream into the queue: Finish at its complete end, None on close(); raises
        grpc.RpcError, Incomplete or FeederError (a corrupt batch) when it breaks."""
        stub = self._stub = self.transport.stub(target)
        with self._gate:
            request, reader = self._request(target), self.reader(target, self._seq)
        call = self.transport.open(stub, request)
        with self._lock:
            self._call, self._idle_cancelled = call, False
        if self.policy.failback is not None:   # a move decided while this stream opened
            call.cancel()
        delivery = self.gray.delivery
        delivery.opened(time.monotonic())
        got_any = False
        while True:
            self._waiting_since = time.monotonic()
            delivery.net_began(self._waiting_since)
            try:
                reply = next(call)
            except StopIteration:
                if (END, COMPLETE) in tuple(call.trailing_metadata() or ()):
                    return self.policy.stream_complete()
                # OK but not complete: whatever closed the call, the rest of the
                # stream is still owed; resume it from the cursor like any break.
                raise Incomplete() from None
            finally:
                self._waiting_since = None
                delivery.net_ended(time.monotonic())
            self._opened = True
            self._answered.add(target)
            wrong = other_region(self._named.get(target, ""), reply.region, self.cfg.regions)
            if wrong:   # (before any of its batches is handed over)
                call.cancel()
                raise _NotThisTarget(wrong)
            if reply.region != self.region:
                log.info("rank %d fed by region %s (%s)", self.cfg.spec.rank, reply.region, target)
                self.region = reply.region
            if reply.waiting and not reply.batches:   # the feeder prepares or builds what the stream needs
                self._told_waiting(target, reply.waiting)
                delivery.preparing(time.monotonic())
                continue
            self.waiting = ""
            if not self._hand_reply(reply, reader):
                return None
            if not got_any:
                got_any = True
                self.policy.batch_received()

    def _told_waiting(self, target: str, why: str) -> None:
        """The feeder is alive and says why nothing comes yet: the rank waits for it, and its log
        says so when the reason changes (not its progress) or every WAITING_LOG_S."""
        now = time.monotonic()
        if why.partition(":")[0] != self.waiting.partition(":")[0] or now - self._waiting_logged >= WAITING_LOG_S:
            self._waiting_logged = now
            log.info("rank %d: feeder %s: %s", self.cfg.spec.rank, target, why)
        self.waiting = why
        self.waited += 1

    def _watch(self) -> None:
        """Abandons a silent feeder, and reports data-wait to the feeder feeding us."""
        while not self._stop.is_set():
            self._wake.wait(min(0.25, self.cfg.idle_timeout_s / 4, self.cfg.report_every_s))
            self._wake.clear()
            if self._stop.is_set():
                return
            if self._stub is not None:
                self._maybe_report(self._stub)
            self.gray.tick()
            self._maybe_fail_back()
            since = self._waiting_since
            if since is not None and time.monotonic() - since > self.cfg.idle_timeout_s:
                with self._lock:
                    if self._call is not None and self._waiting_since == since:
                        self._idle_cancelled = True
                        self._call.cancel()

    def _maybe_fail_back(self) -> None:
        """On a less preferred target, every failback_s: if a more preferred one answers its
        health check, end the current stream so the reader reopens there from the cursor."""
        current = self.policy.index % len(self.targets)
        for i in self.policy.failback_due(time.monotonic()):
            if self.gray.delivery.left_for_slowness(self.targets[i]):   # back only after a probe (gray)
                continue
            if self.transport.rtt(self.targets[i], probes=2, timeout=2.0) != float("inf"):
                with self._lock:
                    if self._call is not None and self.policy.failback_probe_answered(i, current):
                        self._call.cancel()
                return

    def _maybe_report(self, stub) -> None:
        with self._report_lock:
            r, due = self._report, self._report_due
            if time.monotonic() - r[3] < self.cfg.report_every_s and not due:
                return
            if r[2] == 0 and self._position == self._reported_position:
                return
            wait, step, n = r[0], r[1], r[2]
            self._report = [0.0, 0.0, 0, time.monotonic()]
            self._report_due = False
            pos = self._reported_position = self._position
        f = self.gray.delivery.figures(time.monotonic())
        self.transport.report(stub, pb.ReportRequest(
            job=self.cfg.spec.job, rank=self.cfg.spec.rank, wait_s=wait, step_s=step, batches=n,
            has_position=pos is not None, epoch=pos[0] if pos else 0, step=pos[1] if pos else 0,
            target=self.target, moved=self.policy.last_move, moves=self.policy.moves + self.policy.failovers + self.policy.failbacks,
            delivered_per_s=f["delivered_per_s"], consumed_per_s=f["consumed_per_s"],
            hedged_bytes=self.gray.hedged_bytes))

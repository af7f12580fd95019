"""Target choice, failover, failback and backoff: pure code, no gRPC, no threads, no clock of its own.

The stream thread tells the Policy what happened (a batch arrived, the stream ended complete,
a break, a refusal with `feeder-elsewhere`, an error status, a failback probe's answer) with
the time, and the Policy says what to do next: open `Retry.target` after `Retry.wait_s`,
`Finish`, or `GiveUp(error)`. tests/test_failover_policy.py drives it without a server.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

from feeder.core.errors import Code, FeederError, Unavailable

# Failures another feeder (or the same one, later) can cover, by gRPC status name; anything
# else is the caller's mistake or corrupt data, and is raised.
RETRYABLE = frozenset({"UNAVAILABLE", "DEADLINE_EXCEEDED", "CANCELLED", "ABORTED", "INTERNAL", "UNKNOWN",
                       "RESOURCE_EXHAUSTED"})


# HTTP statuses a proxy or ingress answers while the feeder behind it is away (restarting,
# overloaded): a break, tried again later. Any other HTTP answer means the target is not a feeder.
HTTP_TRANSIENT = frozenset({408, 429, 500, 502, 503, 504})


def not_a_feeder(status_name: str, details: str) -> str:
    """Why a target that answered a Stream call so is not a feeder at all ("" when it may be):
    a gRPC server without the feeder service (UNIMPLEMENTED), a web server or an ingress
    answering with an HTTP error (gRPC maps HTTP 404 to UNIMPLEMENTED, 403 to PERMISSION_DENIED,
    which would otherwise end the rank at once), an HTTP/1 server. Such a target is skipped from
    then on, as one that refused the rank (issue 34: the rank raised `Method not found!` and
    never tried the feeder listed after it)."""
    low = details.lower()
    http = re.search(r"received http2 header with status: (\d+)", low)
    if http:
        status = int(http.group(1))
        return "" if status in HTTP_TRANSIENT else f"answers HTTP {status}: a web server or ingress, not a feeder"
    if "http1.x" in low or "failed parsing http/2" in low:   # (gRPC's words for an HTTP/1 answer)
        return f"speaks HTTP/1 (or another protocol), not gRPC: not a feeder (gRPC said: {details[:300]})"
    if status_name == "UNIMPLEMENTED":
        return f"not a feeder (UNIMPLEMENTED: {details.partition(': ')[2] or details})"
    return ""


def other_region(named: str, says: str, regions) -> str:
    """Why a target named for region `named` is not that region's feeder ("" when it may be): it
    says it is `says`, another of the rank's regions (a DNS name or a port pointing at the wrong
    feeder). A name that is none of the feeders' regions is only a label, and not held to."""
    if named and says and says != named and says in regions:
        return f"answers for region {says!r}, not {named!r}"
    return ""


def code_of(status_name: str) -> Code:
    """The domain Code of a gRPC status name (INTERNAL for those with none, e.g. UNKNOWN)."""
    return Code.__members__.get(status_name, Code.INTERNAL)


def rtt_step(rtt_s: float) -> float:
    """RTT in steps of 1.5x above 2 ms (inf stays inf): the key that orders targets."""
    if rtt_s == float("inf"):
        return rtt_s
    return math.floor(math.log(max(rtt_s, 2e-3) / 2e-3, 1.5))


# A feeder whose load is above this is overloaded (its CPU, or its batch threads, behind): a rank
# takes it only when no feeder as near is less loaded.
OVERLOADED = 1.0


def order_targets(targets: list[str], rtt_s: dict[str, float], prefer: str,
                  avoid: frozenset[str] = frozenset()) -> list[str]:
    """Targets in the order to try them. "rtt": a stable sort on rtt_step, so feeders of one
    datacenter (or about equally far) keep the order given, a clearly nearer region goes first,
    and unreachable ones go last; among those as near, the ones to `avoid` (overloaded, or
    saying their reads of the rank's data are stuck) after the others. "order": as given."""
    if prefer != "rtt":
        return list(targets)
    return sorted(targets, key=lambda t: (rtt_step(rtt_s[t]), t in avoid))


@dataclass(frozen=True)
class Retry:
    """Open a stream on `target` (from the last cursor), after waiting `wait_s` seconds."""
    target: str
    wait_s: float = 0.0


@dataclass(frozen=True)
class Finish:
    """The stream ran to its end: the consumer gets StopIteration."""


@dataclass(frozen=True)
class GiveUp:
    """No target can serve the rank: the consumer gets `error`."""
    error: FeederError


class Policy:
    """Which target a rank streams from, and what to do when its stream ends.

    `targets` is the preference order (nearest first). `index` counts up through it, wrapping
    around; a target that refused the rank with `feeder-elsewhere`, or is not a feeder at all
    (not_a_feeder, other_region), is skipped from then on, and once every target has refused one
    error names each target and why. Breaks (a lost connection,
    an idle timeout, an OK end without the end marker, a corrupt batch) move to the next
    target; after a whole round of breaks without a batch it backs off (50 ms doubling, at
    most 2 s), and after `retry_for_s` of failing without a batch it gives up (after
    `connect_timeout_s` while no target has ever answered)."""

    def __init__(self, targets: list[str], retry_for_s: float, failback_s: float = 0.0, now: float = 0.0,
                 rank: int = 0, connect_timeout_s: float = 0.0):
        self.targets = targets
        self.rank = rank
        self.retry_for_s = retry_for_s
        # Until some target has ever answered, failing is most likely a start-up mistake (a
        # wrong port or host, a feeder not started): give up after connect_timeout_s, naming
        # every target and why it failed (0: only retry_for_s applies).
        self.connect_timeout_s = connect_timeout_s
        self.started = now
        self.answered = False
        self.last_failure: dict[str, str] = {}     # target -> why it last failed
        self._logged: dict[str, str] = {}          # target -> the failure last logged, since the last batch
        self.failback_s = failback_s
        self.index = 0
        self.refused: dict[str, FeederError] = {}
        self.failing_since: float | None = None   # first break since the last batch
        self.attempt = 0                           # breaks since the last batch
        self.after_break = False                   # the next stream is opened after a break (a failover)
        self.failovers = 0
        self.failbacks = 0
        self.failback: int | None = None           # index of the nearer target to move back to
        self.failback_checked = now
        # Moves the client made on its own (docs/guarantees.md, "slow, not dead"): why the next
        # (self.moving) and the last (self.last_move: slow, stuck, failback, error) were made.
        self.moving = ""
        self.last_move = ""
        self.moves = 0

    @property
    def target(self) -> str:
        return self.targets[self.index % len(self.targets)]

    def batch_received(self) -> None:
        """A stream delivered a batch: the failures before it are forgotten."""
        self.failing_since, self.attempt, self.after_break = None, 0, False
        self.answered = True
        self._logged.clear()

    def reached(self) -> None:
        """A target answered (a health check at start): the job is past start-up mistakes."""
        self.answered = True

    def worth_logging(self, target: str, why: str) -> bool:
        """A failure is logged once per target until it changes or a batch arrives: a feeder
        that stays down for minutes must not write a line per retry."""
        if self._logged.get(target) == why:
            return False
        self._logged[target] = why
        return True

    def stream_complete(self) -> Finish:
        return Finish()

    def failback_ended(self) -> Retry:
        """The stream was ended by us (failback_probe_answered, or move) to move to another target."""
        self.index, self.failback = self.failback, None
        if self.moving:
            self.moves += 1
            self.last_move, self.moving = self.moving, ""
        else:
            self.failbacks += 1
            self.last_move = "failback"
        return Retry(self.target)

    def move(self, i: int, why: str) -> bool:
        """Move to target i (the caller then ends the current stream, which resumes there from
        the cursor, as after a break but without counting as one): the feeder serving the rank
        is slow or stuck, or a slow target passed its probe ("failback"). False when a move or
        a failback is already under way."""
        if self.failback is not None:
            return False
        self.failback, self.moving = i, why
        return True

    def refuse(self, message: str, code: Code) -> Retry | GiveUp:
        """The current target cannot serve this rank, now or later (another replica, dataset
        not here, not a feeder at all, a feeder of another region): skipped from now on; the
        next one that has not refused, at once. Once every target has refused, GiveUp with one
        line naming each target and why, with the first refusal's code."""
        self.refused.setdefault(self.target, FeederError(message, code=code))
        if len(self.refused) == len(set(self.targets)):
            first = next(iter(self.refused.values()))
            return GiveUp(FeederError(f"no target can serve rank {self.rank}: {self.each()}", code=first.code))
        self._skip_refused()
        return Retry(self.target)

    def each(self) -> str:
        """Every target and why it failed last (its refusal, its last break, or not tried), one line."""
        def why(t: str) -> str:
            if t in self.refused:
                return _without_target(str(self.refused[t]), t)
            return self.last_failure.get(t, "not tried")
        return "; ".join(f"{t}: {why(t)}" for t in dict.fromkeys(self.targets))

    def error(self, status_name: str, message: str, why: str, now: float, elsewhere: bool = False,
              answered: bool = False) -> Retry | GiveUp:
        """The stream ended with a gRPC error status (its name, e.g. "UNAVAILABLE").

        In this order: ended by us to fail back -> move back; not a feeder (not_a_feeder) or
        `elsewhere` (the status carried `feeder-elsewhere`, any code) -> a refusal, skip this
        target; a status not in RETRYABLE
        -> GiveUp(FeederError(message)); else a break (`why` says what broke, for the log).
        A target that has `answered` this client as a feeder is not taken for something else on
        a retryable status: what garbled its answer (a proxy between, a connection cut in its
        handshake) is a break (soak seed 4500031: a feeder stuck, then slowed, behind a proxy
        was once judged "speaks HTTP/1" and its only rank gave up)."""
        if self.failback is not None:
            return self.failback_ended()
        wrong = "" if answered and status_name in RETRYABLE else not_a_feeder(status_name, message)
        if wrong:
            return self.refuse(f"{self.target}: {wrong}", Code.UNAVAILABLE)
        if elsewhere:
            return self.refuse(message, code_of(status_name))
        if status_name not in RETRYABLE:
            return GiveUp(FeederError(message, code=code_of(status_name)))
        return self.broke(why, now)

    def corrupt(self, err: FeederError, why: str, now: float) -> Retry | GiveUp:
        """A batch failed to decode: DATA_LOSS is never served, another feeder may have good data."""
        if err.code != Code.DATA_LOSS:
            return GiveUp(err)
        return self.broke(why, now)

    def broke(self, why: str, now: float) -> Retry | GiveUp:
        """The stream broke (`why` names the target and the cause): resume on the next target."""
        self.failing_since = self.failing_since or now
        self.last_failure[self.target] = why.partition(": ")[2] or why
        if not self.answered and self.connect_timeout_s and now - self.started >= self.connect_timeout_s:
            return GiveUp(Unavailable(f"no feeder answered rank {self.rank} within connect_timeout_s="
                                      f"{self.connect_timeout_s:g}: {self.each()}"))
        if now - self.failing_since > self.retry_for_s:
            return GiveUp(Unavailable(f"no feeder could serve rank {self.rank} for {self.retry_for_s:.0f}s: "
                                      f"{self.each()}"))
        self.index += 1
        self._skip_refused()
        self.failovers += 1
        self.last_move = "error"
        self.after_break = True
        self.attempt += 1
        wait = 0.0
        if self.attempt >= len(self.targets):  # a whole round failed: back off before the next
            wait = min(2.0, 0.05 * 2 ** min(self.attempt - len(self.targets), 6))
        if not self.answered and self.connect_timeout_s:   # the last try at the deadline, not after it
            wait = min(wait, max(0.0, self.started + self.connect_timeout_s - now))
        return Retry(self.target, wait)

    def _skip_refused(self) -> None:
        """Move to the next target that has not refused this rank (there is one)."""
        for _ in range(len(self.targets)):
            if self.target not in self.refused:
                return
            self.index += 1

    def failback_due(self, now: float) -> list[int]:
        """Indices of the more preferred targets to probe now (none unless failback_s has
        passed since the last probe and the rank is on a less preferred target), nearest first."""
        current = self.index % len(self.targets)
        if not self.failback_s or self.failback is not None or current == 0 \
                or now - self.failback_checked < self.failback_s:
            return []
        self.failback_checked = now
        return [i for i in range(current) if self.targets[i] not in self.refused]

    def failback_probe_answered(self, i: int, current: int) -> bool:
        """Target i answered its probe, begun while on `current`. True: end the current stream
        (the caller cancels it) and move back to i; False: the rank moved meanwhile."""
        if self.index % len(self.targets) != current:
            return False
        self.failback = i
        return True


def _without_target(message: str, target: str) -> str:
    """A refusal's message without the target it begins with ("feeder T: why" -> "why")."""
    for prefix in (f"feeder {target}: ", f"{target}: "):
        if message.startswith(prefix):
            return message[len(prefix):]
    return message

"""ClientConfig: what one rank's FeederClient streams, from where, and how it rides out failures."""
from __future__ import annotations

import os
import time
from dataclasses import dataclass

import torch

from feeder.core.config import StreamSpec
from feeder.core.errors import Code, FeederError
from feeder.service.security import ClientSecurity

PLAIN = ClientSecurity()
_started_ns = 0


def _forked() -> None:
    global _started_ns
    _started_ns = 0   # a forked child is a process of its own (a DataLoader worker gets its dataset's)


os.register_at_fork(after_in_child=_forked)


def process_started_ns() -> int:
    """When this process started using the feeder (ns since the Unix epoch), taken at the first call.

    Feeders refuse a continued stream of a rank from a process that started before the one
    that last opened the rank (StreamSpec.client_started_ns), so a replaced trainer cannot
    take its rank back. FeederDataset takes it when it is made and hands it to its DataLoader
    workers with the spec, so a rank's workers send their trainer's time."""
    global _started_ns
    if not _started_ns:
        _started_ns = time.time_ns()
    return _started_ns


@dataclass(frozen=True, kw_only=True)
class ClientConfig:
    """One rank's stream: its StreamSpec, the feeders that may serve it, and the transport knobs.

    Frozen; each field's comment says what it does.

    Args:
        targets: HOST:PORT of every feeder (regions) that may serve the rank, tried nearest
            first (prefer="rtt") or in the order given (prefer="order").
        spec: what the rank streams (feeder.config.StreamSpec): these values decide its
            samples.
        cursor: resume right after the batch that carried it (None: from the spec's start).

    Raises:
        FeederError: INVALID_ARGUMENT for invalid values, here, not later in the stream
            thread.
    """

    targets: tuple[str, ...]
    spec: StreamSpec
    cursor: bytes | None = None
    read_ahead: int = 8               # batches decoded ahead of the consumer
    idle_timeout_s: float = 30.0      # a feeder silent this long while we wait is abandoned
    keepalive_s: float = 10.0         # HTTP/2 pings detect a dead link within keepalive + timeout
    keepalive_timeout_s: float = 5.0
    retry_for_s: float = 300.0        # give up after failing this long without a batch
    # ... or this long when no target has answered at all since the client started: a wrong
    # port or a feeder that is not up is said within seconds, not after retry_for_s.
    connect_timeout_s: float = 30.0
    report_every_s: float = 5.0
    # After a failover, look this often for a more preferred feeder that answers again, and
    # move back to it (resuming from the cursor): a rank does not stay on a far region for
    # weeks because its own region once restarted. 0: never.
    failback_s: float = 60.0
    security: ClientSecurity = PLAIN  # TLS, client certificate, bearer token
    regions: tuple[str, ...] = ()     # names of targets, in the same order (for logs; the feeder says too)
    prefer: str = "rtt"               # "rtt": nearest first (measured); "order": as given
    # Read-ahead grows past read_ahead to cover the round trip at the rate the loop takes batches,
    # so a far region keeps the loop fed; at most this many batches.
    max_read_ahead: int = 64
    # Decode tokens straight into page-locked memory, so `.to("cuda", non_blocking=True)` is a
    # true asynchronous copy. None: when CUDA is available (never in a DataLoader worker).
    pin_memory: bool | None = None
    # Let this process's malloc reuse freed multi-MiB buffers (feeder.malloc): gRPC's receive
    # buffers and messages otherwise come from fresh pages, faulted in one by one (~30 % of
    # the client's CPU per byte). Process-wide; False leaves malloc as it is.
    keep_freed_memory: bool = True
    # Slow, not dead (docs/guarantees.md): move off a feeder that delivers less than the loop
    # takes when the loop waited for data more than `slow_wait` of the last `slow_window_s`
    # while this client was waiting on that feeder (0: move only on errors and silence). A
    # target left so is held off `slow_hold_s` (doubling on a relapse, up to 40 s or this if
    # more), then taken back only after a probe shows it delivers 1.5x what the loop takes.
    slow_wait: float = 0.05
    slow_window_s: float = 3.0
    slow_hold_s: float = 15.0
    # Hedged reads: while the read-ahead is below half its size, read the next batches from the
    # best other target too, and take whichever copy arrives first (the other is dropped by its
    # place in the stream; the bytes are counted in hedged_bytes). Costs bandwidth, saves waits.
    hedge: bool = False

    def __post_init__(self):
        if not self.targets or not all(isinstance(t, str) and t for t in self.targets):
            raise FeederError(f"targets must be a non-empty list of HOST:PORT strings, got {self.targets!r}",
                              code=Code.INVALID_ARGUMENT)
        if self.read_ahead < 1:
            raise FeederError(f"read_ahead must be >= 1, got {self.read_ahead}", code=Code.INVALID_ARGUMENT)
        for name in ("retry_for_s", "connect_timeout_s"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                raise FeederError(f"{name} must be a positive number of seconds, got {v!r}",
                                  code=Code.INVALID_ARGUMENT)
        if isinstance(self.slow_wait, bool) or not isinstance(self.slow_wait, (int, float)) \
                or not 0 <= self.slow_wait < 1:
            raise FeederError(f"slow_wait must be a fraction of step time in [0, 1) (0: never move for slowness), "
                              f"got {self.slow_wait!r}", code=Code.INVALID_ARGUMENT)
        for name in ("slow_window_s", "slow_hold_s"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                raise FeederError(f"{name} must be a positive number of seconds, got {v!r}", code=Code.INVALID_ARGUMENT)
        if not isinstance(self.hedge, bool):
            raise FeederError(f"hedge must be True or False, got {self.hedge!r}", code=Code.INVALID_ARGUMENT)
        if self.prefer not in ("rtt", "order"):
            raise FeederError(f"prefer must be 'rtt' or 'order', got {self.prefer!r}", code=Code.INVALID_ARGUMENT)
        if self.regions and len(self.regions) != len(self.targets):
            raise FeederError(f"regions names {len(self.regions)} targets but there are {len(self.targets)}",
                              code=Code.INVALID_ARGUMENT)
        if self.pin_memory and not torch.cuda.is_available():
            raise FeederError("pin_memory=True needs CUDA, and torch finds no GPU here; leave it unset "
                              "(None) to pin only where there is one", code=Code.INVALID_ARGUMENT)

"""`feeder serve --processes N`: N feeder processes on one port, started, watched and
stopped together.

One feeder process is bound by its GIL (grpc.aio sends under it; README, Performance): a
host with more cores serves more with more processes. They share the port through
SO_REUSEPORT, the kernel hands each new connection to one of them, and a rank's cursor
resumes it on whichever it lands on next. The processes leave their status for each other
(feeder/domain/siblings.py), so `feeder status` on the port shows every rank. Each serves metrics
on a port of its own (the configured one plus its index), and writes its own ledger
(LEDGER.0, LEDGER.1, ...: `feeder audit` takes them all).

This process serves nothing itself. A process that exits is started again (after 1 s,
doubling up to 30 s while it keeps failing); one that fails before it ever listened is a
configuration error, and ends them all. SIGTERM or SIGINT drains them all, as for one.
"""
from __future__ import annotations

import logging
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field

from feeder.core.config import ServeConfig
from feeder.core.errors import FeederError

log = logging.getLogger("feeder.supervise")
READY = "listening on "


def _pdeathsig():
    """prctl, looked up here: the child calls it between fork and exec, where importing (the
    import lock may be held by another thread at the fork) could deadlock."""
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):   # not Linux: a supervisor killed hard leaves its processes
        return None


_PRCTL = _pdeathsig()


def _die_with_parent() -> None:
    """In the child: SIGTERM when the supervisor dies, even by SIGKILL."""
    if _PRCTL is not None:
        _PRCTL(1, signal.SIGTERM)   # PR_SET_PDEATHSIG


@dataclass
class Child:
    index: int
    argv: list[str]
    proc: subprocess.Popen | None = None
    ready: threading.Event = field(default_factory=threading.Event)
    started: float = 0.0
    backoff: float = 1.0
    restart_at: float = 0.0


def _concrete_port(host: str, port: int) -> tuple[int, socket.socket | None]:
    """Port 0 means any free port, but all processes need the same one: take one now, and hold
    it (bound, never listening, so it gets no connections) until they are all up."""
    if port:
        return port, None
    s = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    s.bind((host.strip("[]"), 0))
    return s.getsockname()[1], s


def child_argv(argv: list[str], cfg: ServeConfig, index: int, listen: str, sibling_dir: str) -> list[str]:
    """The supervisor's own `serve` arguments, and what makes this child one of N (flags given
    later win)."""
    out = [sys.executable, "-m", "feeder.cli", *argv, "--processes", "1", "--listen", listen,
           "--sibling-dir", sibling_dir, "--process-index", str(index)]
    if cfg.metrics_listen:
        host, _, port = cfg.metrics_listen.rpartition(":")
        out += ["--metrics-host", host, "--metrics-port", str(int(port) + index if int(port) else 0)]
    if cfg.ledger:
        out += ["--ledger", f"{cfg.ledger}.{index}"]
    if not cfg.memory_budget_mb:   # the host's default budget, shared by the processes
        from feeder.pipeline.stream import default_budget_bytes

        out += ["--memory-budget-mb", f"{default_budget_bytes(cfg.processes) / 2**20:.1f}"]
    return out


def supervise(cfg: ServeConfig, argv: list[str]) -> int:
    host, _, port = cfg.listen.rpartition(":")
    real_port, holder = _concrete_port(host, int(port))
    listen = f"{host}:{real_port}"
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    with tempfile.TemporaryDirectory(prefix="feeder-processes-") as sibling_dir:
        children = [Child(i, child_argv(argv, cfg, i, listen, sibling_dir)) for i in range(cfg.processes)]
        try:
            return _run(cfg, children, listen, holder, stop)
        finally:
            _stop_all(children, cfg.grace_s)


class Relay:
    """The children's output lines, marked with which process said them, held back until the
    supervisor has said that it listens: its line comes first, as a single feeder's does."""

    def __init__(self):
        self.lock = threading.Lock()
        self.held: list[str] | None = []

    def say(self, line: str) -> None:
        with self.lock:
            if self.held is None:
                print(line, flush=True)
            else:
                self.held.append(line)

    def release(self, first: str) -> None:
        with self.lock:
            for line in [first, *self.held]:
                print(line, flush=True)
            self.held = None


def _start(child: Child, n: int, relay: Relay) -> None:
    child.ready.clear()
    child.started = time.monotonic()
    child.proc = subprocess.Popen(child.argv, stdout=subprocess.PIPE, text=True, bufsize=1,
                                  preexec_fn=_die_with_parent)

    def forward(proc=child.proc):
        for line in proc.stdout:
            if READY in line:
                child.ready.set()
            relay.say(f"process {child.index}/{n} (pid {proc.pid}): {line.rstrip()}")

    threading.Thread(target=forward, name=f"relay-{child.index}", daemon=True).start()


def _run(cfg: ServeConfig, children: list[Child], listen: str, holder, stop: threading.Event) -> int:
    n, relay = len(children), Relay()
    for c in children:
        _start(c, n, relay)
    # Up: every process listening. A process that ends first failed on its configuration
    # (its message is on stderr already), and so would the others.
    while not all(c.ready.is_set() for c in children):
        for c in children:
            if c.proc.poll() is not None and not c.ready.is_set():
                raise FeederError(f"feeder process {c.index} exited with code {c.proc.returncode} before it "
                                  "listened (its error is above)")
        if stop.wait(0.05):
            return 0
    if holder is not None:
        holder.close()
    relay.release(f"feeder region={cfg.region} {READY}{listen} ({n} processes)")
    while not stop.wait(0.2):
        now = time.monotonic()
        for c in children:
            code = c.proc.poll()
            if code is None:
                if c.ready.is_set() and now - c.started > 60:
                    c.backoff = 1.0   # it ran a while: a later failure starts the backoff anew
                continue
            if c.restart_at == 0.0:
                c.restart_at = now + c.backoff
                log.error("feeder process %d (pid %d) exited with code %s; starting it again in %.0f s",
                          c.index, c.proc.pid, code, c.backoff)
                c.backoff = min(30.0, 2 * c.backoff)
            elif now >= c.restart_at:
                c.restart_at = 0.0
                _start(c, n, relay)
    return 0


def _stop_all(children: list[Child], grace_s: float) -> None:
    """SIGTERM to all (each drains its streams for up to grace_s), then SIGKILL to stragglers."""
    live = [c.proc for c in children if c.proc is not None and c.proc.poll() is None]
    for p in live:
        p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s + 10
    for p in live:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()

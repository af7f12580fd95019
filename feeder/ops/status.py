"""`feeder status`: a live table of a feeder's jobs and ranks, from its Status call."""
from __future__ import annotations

import signal
import threading
import time

import grpc

from feeder.core.errors import Code, FeederError, NotFound, Unavailable
from feeder.service.security import ClientSecurity, explain

PLAIN = ClientSecurity()


def fetch(target: str, job: str = "", timeout: float = 5.0, security: ClientSecurity = PLAIN):
    from feeder.v1 import feeder_pb2 as pb
    from feeder.v1 import feeder_pb2_grpc as pb_grpc

    with security.channel(target) as ch:
        try:
            return pb_grpc.FeederStub(ch).Status(pb.StatusRequest(job=job), timeout=timeout,
                                                 metadata=security.metadata())
        except grpc.RpcError as e:
            code = e.code()
            if code == grpc.StatusCode.NOT_FOUND:
                raise NotFound(e.details()) from None
            if code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
                raise FeederError(f"{target} refused: {e.details()}", code=Code[code.name]) from None
            raise Unavailable(f"cannot reach feeder at {explain(e, target, security)}") from None


def render(reply, target: str):
    from rich.table import Table

    procs = f"  processes={reply.processes}" if reply.processes > 1 else ""
    # A chunk changed on disk under a running feeder is news an operator must not miss.
    changed = f"  CHUNKS CHANGED ON DISK={reply.chunks_changed} (DATA_LOSS)" if reply.chunks_changed else ""
    # Cache entries found damaged were rebuilt, not served; still a sign of a failing disk or host.
    changed += f"  cache damaged={reply.cache_damaged} (rebuilt)" if reply.cache_damaged else ""
    t = Table(title=f"feeder {target}  region={reply.region}{procs}  up {reply.uptime_s:.0f}s  "
                    f"streams={reply.streams_open}  load={reply.load:.2f}  rss={reply.rss_mb:.0f} MB  "
                    f"scrubbed={reply.scrubbed_bytes / 2**20:.0f} MiB{changed}", title_justify="left")
    left = ("job", "dataset", "region", "state", "last error")
    for col in ("job", "dataset", "rank", "region", "state", "epoch", "taken", "sent ahead", "tokens/s", "queue",
                "data-wait", "sent", "restarts", "failovers", "bad records", "last error"):
        t.add_column(col, justify="left" if col in left else "right")
    if reply.building:
        t.caption = "\n".join(reply.building)
    for j in reply.jobs:
        for r in j.ranks:
            t.add_row(j.job, j.dataset, f"{r.rank}/{j.world_size}", r.region or reply.region,
                      r.state or ("streaming" if r.connected else "idle"), str(r.epoch), _taken(r), _sent(r),
                      f"{r.tokens_per_s:,.0f}", str(r.queue_depth), f"{100 * r.data_wait_fraction:.1f}%",
                      f"{r.bytes_sent / 2**20:.1f} MiB", str(r.restarts), str(r.failovers), str(r.bad_records),
                      r.last_error[:60])
            if r.members:   # a model-parallel rank: its members, and which lag
                t.add_row("", "", "", "", _members(r), *[""] * 11)
            if r.target:   # how the rank's client says it is fed (slow, not dead)
                t.add_row("", "", "", "", _feed(r), *[""] * 11)
    elastic = [f"elastic {j.job}: {j.elastic}" for j in reply.jobs if j.elastic]
    elastic += [f"mixture {j.job}: {j.mixture}" for j in reply.jobs if j.mixture]
    if elastic:
        t.caption = "\n".join(elastic + ([t.caption] if t.caption else []))
    if not reply.jobs:
        t.caption = "no jobs yet"
    if reply.packings:    # best-fit packings served: documents cut, padding, how long they took
        t.caption = "\n".join(["packing: " + p for p in reply.packings] + ([t.caption] if t.caption else []))
    if reply.cache_problems:   # served, but not from the cache: the operator has something to fix
        t.caption = "\n".join(["CACHE: " + p for p in reply.cache_problems] + ([t.caption] if t.caption else []))
    if reply.stuck:   # reads that never returned: those streams were ended, new ones go elsewhere
        t.caption = "\n".join(["STUCK READ: " + s for s in reply.stuck] + ([t.caption] if t.caption else []))
    if reply.preparing:   # streams wait for these before their first batch
        t.caption = "\n".join(["preparing: " + p for p in reply.preparing] + ([t.caption] if t.caption else []))
    return t


def _feed(r) -> str:
    """One line of a rank's feed as its client reports it: where from, its moves, delivery
    against what its loop takes, and the hedged copies it dropped."""
    moved = f"moved {r.moves} (last: {r.moved})" if r.moves else "never moved"
    hedged = f", hedged {r.hedged_bytes / 2**20:.1f} MiB" if r.hedged_bytes else ""
    return (f"└ via {r.target}, {moved}, delivered {r.delivered_per_s:.1f}/s vs consumed "
            f"{r.consumed_per_s:.1f}/s{hedged}")


def _members(r) -> str:
    """A model-parallel rank's members: how many, how its messages were built, who lags."""
    lag = [f"{'cp' + str(m.cp_rank) + '.' if m.cp_rank else ''}m{m.member} {m.behind} behind"
           + ("" if m.shared else " (own reads)") for m in r.members if m.behind or not m.shared]
    return (f"└ {len(r.members)} members, {r.window_builds} messages built once, {r.member_solo} alone"
            + (": " + ", ".join(lag) if lag else ""))


def _taken(r) -> str:
    """What the rank's loop has taken (its reports), never what was only sent."""
    if not r.reported:
        return "not reported yet"
    pct = 100.0 * r.samples_done / r.samples_in_epoch if r.samples_in_epoch else 0.0
    return f"{r.samples_done}/{r.samples_in_epoch} ({pct:.0f}%)"


def _sent(r) -> str:
    """Sent: ahead of what was taken by the prefetch, the network and the client's read-ahead."""
    ahead = r.samples_sent - r.samples_done if r.reported and r.sent_epoch == r.epoch else None
    return f"{r.samples_sent}" + (f" (+{ahead})" if ahead else "") + ("" if r.sent_epoch == r.epoch
                                                                       else f" of epoch {r.sent_epoch}")


def _view(target: str, job: str, security: ClientSecurity):
    """The table, or while watching, a line saying why there is none right now."""
    from rich.text import Text

    try:
        return render(fetch(target, job, security=security), target)
    except (Unavailable, NotFound) as e:
        return Text(f"{time.strftime('%H:%M:%S')} {e.message} (retrying every few seconds)")


def show(target: str, *, job: str = "", watch: bool = False, interval: float = 2.0,
         security: ClientSecurity = PLAIN) -> int:
    import sys

    from rich.console import Console

    tty = sys.stdout.isatty()
    console = Console() if tty else Console(width=200)  # logs and pipes: no squeezing
    if not watch:
        console.print(render(fetch(target, job, security=security), target))
        return 0
    fetch(target, job, security=security)  # a wrong target or job is an error now, not an endless retry loop
    # Ctrl-C ends the watch between calls, never inside one: a KeyboardInterrupt raised in
    # gRPC's code can be swallowed or leave a call half torn down (a watch once failed to exit).
    stop = threading.Event()
    previous = signal.signal(signal.SIGINT, lambda *_: stop.set())
    try:
        if not tty:  # a pipe or a log: one snapshot per interval, appended
            while not stop.is_set():
                console.print(_view(target, job, security))
                sys.stdout.flush()
                stop.wait(interval)
            return 0
        from rich.live import Live

        with Live(_view(target, job, security), console=console, refresh_per_second=4, screen=False) as live:
            while not stop.wait(interval):
                live.update(_view(target, job, security))
        return 0
    finally:
        signal.signal(signal.SIGINT, previous)

"""`feeder status`: a live table of a feeder's jobs and ranks, from its Status call."""
from __future__ import annotations

import time

import grpc

from feeder.errors import NotFound, Unavailable


def fetch(target: str, job: str = "", timeout: float = 5.0):
    from feeder.v1 import feeder_pb2 as pb
    from feeder.v1 import feeder_pb2_grpc as pb_grpc

    with grpc.insecure_channel(target) as ch:
        try:
            return pb_grpc.FeederStub(ch).Status(pb.StatusRequest(job=job), timeout=timeout)
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.NOT_FOUND:
                raise NotFound(e.details()) from None
            raise Unavailable(f"cannot reach feeder at {target}: {e.code().name}: {e.details()}") from None


def render(reply, target: str):
    from rich.table import Table

    t = Table(title=f"feeder {target}  region={reply.region}  up {reply.uptime_s:.0f}s  "
                    f"streams={reply.streams_open}  rss={reply.rss_mb:.0f} MB", title_justify="left")
    for col in ("job", "rank", "state", "epoch", "progress", "tokens/s", "queue", "data-wait", "sent", "restarts",
                "last error"):
        t.add_column(col, justify="right" if col not in ("job", "state", "last error") else "left")
    for j in reply.jobs:
        for r in j.ranks:
            pct = 100.0 * r.samples_done / r.samples_in_epoch if r.samples_in_epoch else 0.0
            t.add_row(j.job, f"{r.rank}/{j.world_size}", "streaming" if r.connected else "idle", str(r.epoch),
                      f"{r.samples_done}/{r.samples_in_epoch} ({pct:.0f}%)", f"{r.tokens_per_s:,.0f}",
                      str(r.queue_depth), f"{100 * r.data_wait_fraction:.1f}%", f"{r.bytes_sent / 2**20:.1f} MiB",
                      str(r.restarts), r.last_error[:60])
    if not reply.jobs:
        t.caption = "no jobs yet"
    return t


def show(target: str, *, job: str = "", watch: bool = False, interval: float = 2.0) -> int:
    from rich.console import Console

    import sys

    console = Console() if sys.stdout.isatty() else Console(width=160)  # logs and pipes: no squeezing
    if not watch:
        console.print(render(fetch(target, job), target))
        return 0
    from rich.live import Live

    try:
        with Live(render(fetch(target, job), target), console=console, refresh_per_second=4) as live:
            while True:
                time.sleep(interval)
                live.update(render(fetch(target, job), target))
    except KeyboardInterrupt:
        return 0

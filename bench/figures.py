"""Single figures taken from one running feeder: time to first batch, bytes on the wire per
token, and many streams at once."""
from __future__ import annotations

import threading
import time

import numpy as np

from .clients import Clients, Feeder


def ttfb(address: str, seq_len: int, mb: int, tries: int = 5) -> tuple[float, float]:
    """(new stream -> first batch, resume mid-epoch from a cursor -> first batch), medians."""
    from feeder_client import ClientConfig, FeederClient
    from feeder.core.config import StreamSpec

    def first(job, cursor=None):
        spec = StreamSpec(job=job, rank=0, world_size=8, seq_len=seq_len, micro_batch=mb, seed=3, num_epochs=0)
        t0 = time.monotonic()
        cli = FeederClient(ClientConfig(targets=(address,), spec=spec, cursor=cursor))
        b = next(iter(cli))
        dt = time.monotonic() - t0
        cli.close()
        return dt, b

    new, resume = [], []
    for k in range(tries):
        dt, _ = first(f"ttfb-{k}")
        new.append(dt)
    spec = StreamSpec(job="resume", rank=0, world_size=8, seq_len=seq_len, micro_batch=mb, seed=3, num_epochs=0)
    cli = FeederClient(ClientConfig(targets=(address,), spec=spec))
    it = iter(cli)
    cursor = None
    for k in range(20):
        cursor = next(it).cursor
    after = next(it)
    cli.close()
    for _ in range(tries):
        dt, b = first("resume", cursor)
        resume.append(dt)
        assert (b.epoch, b.step) == (after.epoch, after.step), "resume did not continue after its cursor"
    return float(np.median(new)), float(np.median(resume))


def wire_bytes_per_token(address: str, seq_len: int, mb: int) -> float:
    """Bytes on the wire per token with the default compression, from the feeder's counters."""
    from feeder_client import ClientConfig, FeederClient
    from feeder.core.config import StreamSpec

    spec = StreamSpec(job="wire", rank=0, world_size=1, seq_len=seq_len, micro_batch=mb, seed=3, shuffle=True)
    cli = FeederClient(ClientConfig(targets=(address,), spec=spec))
    tokens = sum(b.tokens.numel() for b in cli)
    cli.close()
    from feeder.ops.status import fetch

    r = fetch(address, "wire").jobs[0].ranks[0]
    return r.bytes_sent / tokens


def streams(clients: Clients, feeder: Feeder, n: int, *, seq_len: int, mb: int, seconds: float) -> dict:
    """n ranks streaming at once (small read-ahead): errors, and the feeder's RSS meanwhile."""
    rss = []
    stop = threading.Event()

    def sample_rss():
        while not stop.wait(0.5):
            try:
                rss.append(feeder.status().rss_mb)
            except Exception:
                pass

    t = threading.Thread(target=sample_rss, daemon=True)
    t.start()
    res = clients.run([feeder.address], f"many-{n}", n, seq_len=seq_len, mb=mb, compression="zstd",
                      seconds=seconds, read_ahead=1, warm_s=0.5)
    stop.set()
    t.join(2)
    return {"ok": n - len(res["errors"]), "errors": res["errors"][:5], "rss_max_mb": max(rss) if rss else None,
            "tokens_s": res["tokens_s"]}


"""Operating the feeder: Prometheus metrics during live streams, `feeder status` with two
jobs (once and --watch), and the Grafana dashboard's queries against what is exported."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from feeder_client import FeederDataset
from feeder.service.metrics import FAMILIES
from tests.helpers import FeederProc

ROOT = Path(__file__).resolve().parents[1]


def scrape(address: str) -> dict[tuple[str, tuple], float]:
    """{(name, ((label, value), ...)): value} from a /metrics page."""
    text = urllib.request.urlopen(f"http://{address}/metrics", timeout=10).read().decode()
    out = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = re.match(r'^([a-zA-Z_:][\w:]*)(?:\{(.*)\})?\s+(\S+)$', line)
        assert m, f"unparsable metrics line: {line!r}"
        labels = tuple(sorted(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', m.group(2) or "")))
        out[(m.group(1), labels)] = float(m.group(3))
    return out


def value(metrics, name, **labels) -> float:
    want = tuple(sorted((k, str(v)) for k, v in labels.items()))
    return metrics[(name, want)]


@pytest.fixture
def metered(dataset):
    feeders = [FeederProc(dataset, extra=["--metrics-port", "0", "--region", r]) for r in ("eu", "us")]
    yield feeders
    for f in feeders:
        f.stop()


def test_metrics_move_during_a_live_stream_and_count_a_failover(metered):
    a, b = metered
    assert re.fullmatch(r"127\.0\.0\.1:\d+", a.metrics) and not a.metrics.endswith(":0")
    ds = FeederDataset([a.address, b.address], prefer="order", job="ops", rank=0, world_size=2, seq_len=32,
                       micro_batch=8, seed=1, num_epochs=0, read_ahead=2, report_every_s=0.2, retry_for_s=60)
    it = iter(ds)
    for _ in range(20):
        next(it)
        time.sleep(0.02)   # a slow loop, so the feeder's queue fills up to its bound
    time.sleep(1.0)        # a report goes out
    m1 = scrape(a.metrics)
    r = dict(job="ops", rank=0)
    sent1 = value(m1, "feeder_batches_sent_total", **r)
    assert sent1 >= 20
    assert value(m1, "feeder_sent_bytes_total", **r) > 0
    assert value(m1, "feeder_tokens_sent_total", **r) >= sent1 * 8 * 33 * 0.5
    assert 0 <= value(m1, "feeder_prefetch_queue_messages", **r) <= 2     # --prefetch-messages 2
    assert value(m1, "feeder_compression_ratio", **r) > 1.0                 # zstd by default
    assert value(m1, "feeder_step_seconds_total", **r) > 0                  # the client reported
    assert value(m1, "feeder_data_wait_seconds_total", **r) >= 0
    assert value(m1, "feeder_source_read_seconds_count", **r) >= sent1
    assert value(m1, "feeder_source_read_seconds_bucket", **r, le="+Inf") >= sent1
    assert value(m1, "feeder_rank_connected", **r) == 1
    assert value(m1, "feeder_streams_open") == 1
    assert value(m1, "feeder_resident_memory_bytes") > 10 << 20
    assert value(m1, "feeder_failovers_total", **r) == 0
    assert value(m1, "feeder_info", version=__import__("feeder").__version__, region="eu") == 1
    for _ in range(20):
        next(it)
    time.sleep(0.5)
    m2 = scrape(a.metrics)
    assert value(m2, "feeder_epoch_progress_ratio", **r) > value(m1, "feeder_epoch_progress_ratio", **r)
    assert value(m2, "feeder_prefetch_queue_messages", **r) <= 2
    # The sent count grows while streaming, once the rank has read past what the feeder had
    # already put in the socket and the HTTP/2 window (thousands of these 0.5 KB batches).
    deadline = time.monotonic() + 30
    while value(scrape(a.metrics), "feeder_batches_sent_total", **r) <= sent1:
        assert time.monotonic() < deadline, "the feeder sent nothing more while the rank read on"
        for _ in range(1000):
            next(it)

    a.signal(signal.SIGKILL)          # the rank fails over to region us
    for _ in range(50_000):           # what region eu had already put on the wire comes first
        if next(it).region == "us":
            break
    for _ in range(5):
        assert next(it).region == "us"
    mb = scrape(b.metrics)
    assert value(mb, "feeder_failovers_total", **r) == 1
    assert value(mb, "feeder_batches_sent_total", **r) > 0
    ds.client.close()


def status_lines(address, *extra, timeout=30):
    r = subprocess.run([sys.executable, "-m", "feeder.cli", "status", "--target", address, *extra],
                       capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_status_names_every_rank_of_two_jobs_with_progress_and_watch_exits_on_ctrl_c(dataset):
    f = FeederProc(dataset, extra=["--region", "eu-west"])
    try:
        jobs = {"alpha": 2, "beta": 3}
        its = []
        for job, world in jobs.items():
            for rank in range(world):
                ds = FeederDataset([f.address], job=job, rank=rank, world_size=world, seq_len=16, micro_batch=2,
                                   seed=5, num_epochs=0, read_ahead=2, report_every_s=0.2)
                it = iter(ds)
                for _ in range(3 + rank):
                    next(it)
                its.append((ds, it))
        time.sleep(1.0)
        out = status_lines(f.address)
        assert "region=eu-west" in out
        for job, world in jobs.items():
            for rank in range(world):
                row = next((ln for ln in out.splitlines() if re.search(rf"\b{job}\b.*\b{rank}/{world}\b", ln)), None)
                assert row is not None, f"no row for {job} rank {rank}:\n{out}"
                # progress: samples consumed (reported) / samples in the epoch, with a percentage
                m = re.search(r"(\d+)/(\d+) \((\d+)%\)", row)
                assert m, row
                done, total = int(m.group(1)), int(m.group(2))
                assert total > 0 and (3 + rank) * 2 <= done < total, row
                assert "streaming" in row
        only = status_lines(f.address, "--job", "beta")
        assert "beta" in only and "alpha" not in only

        # --watch: refreshes (a new snapshot per interval when piped) and exits 0 on Ctrl-C.
        p = subprocess.Popen([sys.executable, "-m", "feeder.cli", "status", "--target", f.address, "--watch",
                              "--interval", "0.3"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        time.sleep(0.8)
        next(its[0][1])                  # progress moves between snapshots
        time.sleep(2.5)
        p.send_signal(signal.SIGINT)
        stdout, stderr = p.communicate(timeout=20)
        assert p.returncode == 0, stderr
        assert "Traceback" not in stderr
        assert stdout.count("region=eu-west") >= 3, stdout

        # The same under a terminal (rich's live display), Ctrl-C from the terminal.
        import pty

        master, slave = pty.openpty()
        p = subprocess.Popen([sys.executable, "-m", "feeder.cli", "status", "--target", f.address, "--watch",
                              "--interval", "0.3"], stdin=slave, stdout=slave, stderr=slave,
                             start_new_session=True)
        os.close(slave)
        seen = bytearray()

        def drain():  # a terminal reads what is written to it
            try:
                while chunk := os.read(master, 65536):
                    seen.extend(chunk)
            except OSError:
                pass

        reader = threading.Thread(target=drain, daemon=True)
        reader.start()
        time.sleep(2.5)
        os.killpg(p.pid, signal.SIGINT)
        assert p.wait(20) == 0
        reader.join(5)
        os.close(master)
        assert b"region=eu-west" in seen and b"Traceback" not in seen

        from feeder.ops.status import fetch

        assert max(r.queue_depth for j in fetch(f.address).jobs for r in j.ranks) > 0   # slow readers: queued replies
        for ds, _ in its:
            ds.client.close()
        # Once the ranks are gone, status shows no queue for them (not the last depth it saw).
        deadline = time.monotonic() + 15
        while True:
            ranks = [r for j in fetch(f.address).jobs for r in j.ranks]
            if not any(r.connected for r in ranks) or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert len(ranks) == 5 and all(not r.connected and r.queue_depth == 0 for r in ranks), ranks
    finally:
        f.stop()


def test_status_of_an_unreachable_feeder_is_one_clear_line():
    r = subprocess.run([sys.executable, "-m", "feeder.cli", "status", "--target", "127.0.0.1:1"],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 2 and "cannot reach feeder at 127.0.0.1:1" in r.stderr
    assert "Traceback" not in r.stderr


def exported_names() -> set[str]:
    names = set()
    for name, (kind, _, _) in FAMILIES.items():
        names.add(name)
        if kind == "histogram":
            names |= {f"{name}_bucket", f"{name}_sum", f"{name}_count"}
    return names


def test_grafana_dashboard_queries_only_exported_metrics():
    dash = json.loads((ROOT / "deploy" / "grafana" / "feeder-dashboard.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    assert len(exprs) >= 8
    known = exported_names()
    used = set()
    for e in exprs:
        for tok in re.findall(r"\b(feeder_[a-z_]+)\b", e):
            assert tok in known, f"dashboard query {e!r} uses {tok}, which the feeder does not export"
            used.add(tok)
    # the panels an on-call engineer needs first
    for must in ("feeder_tokens_sent_total", "feeder_data_wait_seconds_total", "feeder_prefetch_queue_messages",
                 "feeder_failovers_total", "feeder_kafka_lag_records", "feeder_bad_records_total"):
        assert must in used, f"the dashboard has no panel over {must}"

"""Bounded mode's snapshots built once per cache directory (feeder/sources/kafka/once.py,
snapshot.py, partread.py): two feeders on one cache directory build an epoch once and serve it
from that one copy; a feeder on another cache directory builds its own and serves the same ids
and tokens. Without a broker: the build lock's rules (wait while the builder beats, take over
from one that stopped, release on failure)."""
from __future__ import annotations

import json
import logging
import os
import threading
import time

import pytest

from feeder_client import FeederDataset
from feeder.core.config import ServeConfig
from feeder.core.sampler import n_samples
from feeder.service.server import ServerThread
from feeder.sources.kafka.consumer import topic_id
from feeder.sources.kafka.once import build_once, lock_path
from tests.helpers import check_batches, reference_ids
from tests.test_kafka_regressions import EPOCH_MB, EPOCH_SEED, EPOCH_SEQ, Trickle, epoch_of, epoch_stream

SNAPSHOT_BUILT = "read in"   # the build's last log line: "kafka epoch ...: N documents, ... read in X s"


def builds(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "feeder.kafka" and SNAPSHOT_BUILT in r.getMessage()]


def rank_batches(address: str, job: str, rank: int, ranges: str = "") -> list:
    return list(FeederDataset([address], job=job, rank=rank, world_size=2, seq_len=EPOCH_SEQ, micro_batch=EPOCH_MB,
                              seed=EPOCH_SEED, read_ahead=1, retry_for_s=30, expected_fingerprint=ranges))


@pytest.mark.kafka
def test_bounded_epoch_is_built_once_per_cache_dir_and_identically_on_another(kafka_broker, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="feeder.kafka")
    topic = f"snap-{os.getpid()}-{time.time_ns() % 10**6}"
    trickle = Trickle(kafka_broker, topic, partitions=3, n0=3000)
    trickle.stop()
    url = f"kafka://{kafka_broker}/{topic}?vocab_size=257&eos_id=256"
    region, other = tmp_path / "region-cache", tmp_path / "other-cache"
    cfg = dict(source=url, listen="127.0.0.1:0")
    with ServerThread(ServeConfig(cache_dir=str(region), **cfg)) as a, \
            ServerThread(ServeConfig(cache_dir=str(region), **cfg)) as b:
        got: dict[int, list] = {}
        # rank 0 on feeder A and rank 1 on feeder B open at once: both need the epoch's snapshot
        threads = [threading.Thread(target=lambda r, f: got.__setitem__(r, rank_batches(f.address, "once", r)),
                                    args=(r, f)) for r, f in ((0, a), (1, b))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    assert len(builds(caplog)) == 1, builds(caplog)
    ranges = epoch_of(got[0][0])
    assert {epoch_of(x) for bs in got.values() for x in bs} == {ranges}
    kept = sorted(p.name for p in (region / "kafka").iterdir())
    assert len(kept) == 1 and kept[0].startswith(topic) and not kept[0].endswith(".building"), kept
    with ServerThread(ServeConfig(cache_dir=str(other), **cfg)) as c:   # another region's cache
        again = {r: rank_batches(c.address, "elsewhere", r, ranges) for r in (0, 1)}
    assert len(builds(caplog)) == 2
    stream = epoch_stream(kafka_broker, ranges)
    n = n_samples(len(stream), EPOCH_SEQ)
    for r in (0, 1):
        want = reference_ids(n, 2, r, shuffle=True, seed=EPOCH_SEED, drop_last=False, epoch=0)
        check_batches(got[r], stream, EPOCH_SEQ, want)
        check_batches(again[r], stream, EPOCH_SEQ, want)   # the same ids and tokens from its own copy
        assert {epoch_of(x) for x in again[r]} == {ranges}


@pytest.mark.kafka
def test_rank_waits_for_a_snapshot_another_feeder_builds_past_its_idle_timeout(kafka_broker, tmp_path, caplog):
    """Another feeder of the region (a lock file beating in the shared cache directory) builds
    the epoch for 7 s and then gives up; the rank, whose idle timeout is 5 s, is told what its
    feeder waits for every 2 s, so it waits instead of failing over, and then gets exactly the
    epoch, which its own feeder built once the other let go."""
    caplog.set_level(logging.INFO)
    topic = f"snap-wait-{os.getpid()}-{time.time_ns() % 10**6}"
    trickle = Trickle(kafka_broker, topic, partitions=3, n0=300)
    trickle.stop()
    cache = tmp_path / "cache"
    seen: dict = {}
    with ServerThread(ServeConfig(source=f"kafka://{kafka_broker}/{topic}?vocab_size=257&eos_id=256",
                                  listen="127.0.0.1:0", cache_dir=str(cache), metrics_listen="127.0.0.1:0")) as srv:
        src = srv.server.engine.sources[topic]
        ranges = src.fingerprint
        lock = lock_path(src._snapshots.dir_for(ranges, "fail", topic_id(kafka_broker, topic)))
        lock.parent.mkdir(parents=True)
        lock.write_text(json.dumps({"host": "feeder-b", "pid": 7, "phase": "reading", "records_done": 100,
                                    "records": 300, "ranges": ranges}))
        stop = threading.Event()

        def other_feeder():
            from feeder.ops.status import fetch
            from tests.test_ops import scrape, value

            t0 = time.monotonic()
            while time.monotonic() - t0 < 7 and not stop.is_set():
                time.sleep(0.5)
                os.utime(lock)
                if "status" not in seen and time.monotonic() - t0 > 3:   # the rank waits by now
                    seen["status"] = list(fetch(srv.address).preparing)
                    seen["metric"] = value(scrape(srv.server.metrics_address), "feeder_preparing_done_ratio",
                                           key=ranges)
            lock.unlink()

        t = threading.Thread(target=other_feeder)
        t.start()
        try:
            ds = FeederDataset([srv.address], job="waits", rank=0, world_size=1, seq_len=EPOCH_SEQ,
                               micro_batch=EPOCH_MB, seed=EPOCH_SEED, idle_timeout_s=5, retry_for_s=60,
                               expected_fingerprint=ranges)
            t0 = time.monotonic()
            got = list(ds)
            waited_s = time.monotonic() - t0
        finally:
            stop.set()
            t.join()
    assert waited_s > 6 and ds.client.failovers == 0 and ds.client.waited >= 2, (waited_s, ds.client.failovers)
    told = [r.getMessage() for r in caplog.records if r.name == "feeder_client" and "waiting for the snapshot" in
            r.getMessage()]
    assert told and f"Kafka epoch {ranges}: reading, 33% of 300 records (built by feeder-b pid 7)" in told[0], told
    # `feeder status` and the metrics said the same while the rank waited
    assert len(seen["status"]) == 1 and "33% of 300 records (built by feeder-b" in seen["status"][0], seen
    assert abs(seen["metric"] - 1 / 3) < 1e-6, seen
    stream = epoch_stream(kafka_broker, ranges)
    check_batches(got, stream, EPOCH_SEQ, reference_ids(n_samples(len(stream), EPOCH_SEQ), 1, 0, shuffle=True,
                                                        seed=EPOCH_SEED, drop_last=False, epoch=0))
    assert len(builds(caplog)) == 1


@pytest.mark.kafka
def test_stream_of_a_rank_that_left_while_it_waited_is_closed_once_it_opens(kafka_broker, tmp_path):
    topic = f"snap-left-{os.getpid()}-{time.time_ns() % 10**6}"
    trickle = Trickle(kafka_broker, topic, partitions=3, n0=60)
    trickle.stop()
    with ServerThread(ServeConfig(source=f"kafka://{kafka_broker}/{topic}?vocab_size=257&eos_id=256",
                                  listen="127.0.0.1:0", cache_dir=str(tmp_path / "cache"))) as srv:
        src = srv.server.engine.sources[topic]
        ranges = src.fingerprint
        lock = lock_path(src._snapshots.dir_for(ranges, "fail", topic_id(kafka_broker, topic)))
        lock.parent.mkdir(parents=True)
        lock.write_text("{}")   # another feeder builds it (and beats, below)
        from feeder_client import ClientConfig, FeederClient
        from feeder.core.config import StreamSpec

        spec = StreamSpec(job="left", rank=0, world_size=1, seq_len=EPOCH_SEQ, micro_batch=EPOCH_MB,
                          expected_fingerprint=ranges)
        client = FeederClient(ClientConfig(targets=(srv.address,), spec=spec, retry_for_s=5))   # streams at once
        deadline = time.monotonic() + 20
        while client.waited < 1:               # told what its stream waits for at least once
            assert time.monotonic() < deadline, "the rank was never told what its stream waits for"
            os.utime(lock)
            time.sleep(0.3)
        engine = srv.server.engine
        assert engine.jobs.streams_open == 0   # still opening
        client.close()                         # the rank goes away while it waits
        lock.unlink()                          # the other builder gives up: this feeder builds, the stream opens
        deadline = time.monotonic() + 20
        while not (src._snapshots.dir_for(ranges, "fail", topic_id(kafka_broker, topic)) / "manifest.json").exists():
            assert time.monotonic() < deadline
            time.sleep(0.2)
        time.sleep(1.0)
        assert engine.jobs.streams_open == 0, "the stream of a rank that left was kept open"


# --------------------------------------------------------------------------- the build lock, no broker

def test_build_once_waits_for_a_beating_builder_and_reads_its_progress(tmp_path):
    out = tmp_path / "snap"
    lock_path(out).write_text(json.dumps({"host": "h", "pid": 1, "phase": "reading", "records_done": 5,
                                          "records": 10}))
    seen = []

    def other_builder():   # beats twice, then finishes
        for _ in range(2):
            time.sleep(0.6)
            os.utime(lock_path(out))
        out.mkdir()
        (out / "done").touch()
        lock_path(out).unlink()

    t = threading.Thread(target=other_builder)
    t.start()
    built = build_once(out, (out / "done").exists, lambda: pytest.fail("built twice"), waiting=seen.append)
    t.join()
    assert built is False
    assert seen and seen[0]["records_done"] == 5 and seen[0]["phase"] == "reading"


def test_build_once_takes_over_from_a_builder_that_stopped_beating(tmp_path):
    out = tmp_path / "snap"
    lock_path(out).write_text("{}")
    old = time.time() - 60
    os.utime(lock_path(out), (old, old))

    def build():
        out.mkdir()
        (out / "done").touch()

    assert build_once(out, (out / "done").exists, build, waiting=lambda p: None, stale_s=30) is True
    assert (out / "done").exists() and not lock_path(out).exists()
    assert [p.name for p in tmp_path.iterdir()] == ["snap"]   # nothing left aside


def test_build_once_releases_the_lock_when_the_build_fails(tmp_path):
    out = tmp_path / "snap"

    def failing():
        assert lock_path(out).exists()   # held while building
        raise RuntimeError("broker gone")

    with pytest.raises(RuntimeError, match="broker gone"):
        build_once(out, (out / "done").exists, failing, waiting=lambda p: None)
    assert not lock_path(out).exists()
    # the next one to try builds it
    assert build_once(out, (out / "done").exists, lambda: (out.mkdir(), (out / "done").touch()),
                      waiting=lambda p: None) is True


def test_cache_dir_comes_from_the_flag_or_a_region_file_relative_to_it(tmp_path):
    """`feeder serve --cache-dir DIR`, or `cache_dir = "..."` in a region file (relative to the
    file, as its other paths are); the flag wins."""
    from feeder.cli import build_parser
    from feeder.ops.cli_serve import serve_config

    region = tmp_path / "r.toml"
    region.write_text('region = "r"\nsource = "d"\ncache_dir = "shared/cache"\n')
    args = build_parser().parse_args(["serve", "--config", str(region)])
    assert serve_config(args).cache_dir == str(tmp_path / "shared" / "cache")
    args = build_parser().parse_args(["serve", "--config", str(region), "--cache-dir", "/lustre/us-east/cache"])
    assert serve_config(args).cache_dir == "/lustre/us-east/cache"

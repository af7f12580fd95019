"""Three regions launched from deploy/local/ on one host; ranks spread over them, each given
every region; one region SIGKILLed mid-epoch. Every rank's ids and content must be exact."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from feeder_client import FeederDataset
from feeder_client.stream import feeder_info
from tests.helpers import byte_stream, check_batches, expected_ids, free_port, make_docs, prep_docs

pytestmark = pytest.mark.fault
LAUNCH = Path(__file__).resolve().parents[1] / "deploy" / "local" / "launch.py"
REGIONS = ("us-east", "eu-west", "ap-south")


@pytest.fixture(scope="module")
def big(tmp_path_factory):
    """~12 M tokens: each rank's epoch (~8 MB) is more than a stream holds in flight (server
    queue, HTTP/2 window, socket buffers), so a kill lands while data is still to come."""
    docs = make_docs(26000, seed=9, max_words=150)
    return prep_docs(tmp_path_factory.mktemp("regions"), docs), byte_stream(docs)


@pytest.fixture
def regions(big, tmp_path):
    base = free_port()
    proc = subprocess.Popen([sys.executable, str(LAUNCH), "--dataset", str(big[0]), "--root", str(tmp_path),
                             "--port-base", str(base)], stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    assert line.startswith("{"), f"launcher did not start: {line!r}"
    info = json.loads(line)
    yield info
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 0


def test_three_local_regions_one_killed_mid_epoch_every_rank_exact(regions, big):
    dataset, stream = big
    addresses = regions["regions"]
    assert list(addresses) == list(REGIONS)
    # Each region serves its own replica, with the one fingerprint.
    fps = {feeder_info([a]).fingerprint for a in addresses.values()}
    assert len(fps) == 1
    # Each region tells clients where the others are.
    assert dict(feeder_info(addresses["us-east"]).peers) == {r: addresses[r] for r in ("eu-west", "ap-south")}
    for name in REGIONS:
        replica = Path(regions["root"]) / name / "dataset"
        assert (replica / "manifest.json").exists()

    world, seq_len, mb, seed = 3, 2048, 4, 11
    got: dict[int, list] = {r: [] for r in range(world)}
    clients, errors = {}, []
    killed = threading.Event()

    def rank(r: int):
        # Rank r prefers region r (spread over regions), then the others in order.
        order = REGIONS[r:] + REGIONS[:r]
        ds = FeederDataset({n: addresses[n] for n in order}, job="regions", rank=r, world_size=world,
                           seq_len=seq_len, micro_batch=mb, seed=seed, prefer="order", compression="none",
                           expected_fingerprint=next(iter(fps)), retry_for_s=60, num_epochs=3)
        try:
            for k, b in enumerate(ds):
                clients[r] = ds.client
                got[r].append(b)
                if k < 60 or not killed.is_set():
                    time.sleep(0.01)
        except Exception as e:  # surfaced below
            errors.append((r, e))

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    while len(got[1]) < 40:
        time.sleep(0.05)
    os.kill(regions["pids"]["eu-west"], signal.SIGKILL)  # rank 1's region, mid-epoch
    killed.set()
    for t in threads:
        t.join(300)
    assert not errors, errors
    # Three epochs: a rank's stream is far more than HTTP/2 flow control and the socket buffers
    # let into the client ahead of the loop, so the kill meets a stream with most of it still
    # to come (with one epoch a loaded machine sometimes had it all buffered before the kill).
    for r in range(world):
        for e in range(3):
            check_batches([b for b in got[r] if b.epoch == e], stream, seq_len,
                          expected_ids(stream, r, world, seq_len, seed, epoch=e))
    regions_seen = {r: [b.region for b in got[r]] for r in range(world)}
    assert regions_seen[0][0] == "us-east" and regions_seen[2][0] == "ap-south"
    assert regions_seen[1][0] == "eu-west" and regions_seen[1][-1] == "ap-south"  # failed over to its next
    assert clients[1].failovers >= 1 and clients[0].failovers == clients[2].failovers == 0
    assert set(regions_seen[0]) == {"us-east"} and set(regions_seen[2]) == {"ap-south"}

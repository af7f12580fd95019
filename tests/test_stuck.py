"""A feeder whose reads hang while its gRPC answers (issue 45, docs/guarantees.md "Slow, not
dead"): the reads are made real-stuck by stopping the feeder's batch threads (the threads that
read the source and build each message: `feeder-batch` in /proc) with ptrace, the way a read
blocked on a hung filesystem holds them, while its event loop answers Status, Info and pings.
The feeder finds the read stuck after --stuck-after-s, says so (log, status, Info, metric),
ends the stream waiting on it UNAVAILABLE so its rank moves (exactly, from its cursor), refuses
new streams of that dataset, and serves again once the reads return."""
from __future__ import annotations

import os
import time

import pytest

from tests.chaos.freeze import freeze, thaw
from tests.helpers import FeederProc, byte_stream
from tests.test_slow import Loop, wait_until
from tests.test_wan import check_prefix, wan_dataset, wan_docs  # noqa: F401  (fixtures)

pytestmark = pytest.mark.fault

SEQ, MB = 2048, 8


def batch_threads(pid: int) -> list[int]:
    out = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/comm") as f:
                if f.read().strip() == "feeder-batch":
                    out.append(int(tid))
        except OSError:
            pass
    return out


def test_a_feeder_with_a_stuck_read_ends_the_stream_refuses_new_ranks_and_serves_again(wan_dataset, wan_docs):
    from feeder.ops.status import fetch
    from feeder_client import FeederDataset, feeder_info

    stream = byte_stream(wan_docs)
    a = FeederProc(wan_dataset, extra=["--region", "a", "--stuck-after-s", "2", "--metrics-port", "0"])
    b = FeederProc(wan_dataset, extra=["--region", "b"])
    frozen: list[int] = []
    try:
        # slow_wait=0: the client moves on errors only, so what moves it here is the feeder's own word
        ds = FeederDataset({"a": a.address, "b": b.address}, job="stuck", rank=0, world_size=2, seq_len=SEQ,
                           micro_batch=MB, seed=5, num_epochs=0, prefer="order", slow_wait=0)
        loop = Loop(ds, step_s=0.002)   # (a quick loop: what is in flight when the reads stop is used up soon)
        wait_until(lambda: len(loop.log) > 40, 30, "the rank did not start")
        loop.paused = True   # the feeder fills its queue and the rank's window, and its batch threads go idle
        time.sleep(1.5)
        frozen = batch_threads(a.proc.pid)
        assert frozen, "no feeder-batch thread (the pool names its threads)"
        assert all(freeze(t) for t in frozen)
        stuck_at = time.monotonic() - loop.t0
        loop.paused = False
        wait_until(lambda: loop.region_now() == "b", 40, "the rank stayed on the feeder whose reads are stuck")
        moved_at = loop.log[-1][0]
        st = fetch(a.address)
        assert st.stuck and st.stuck[0].startswith(f"{os.path.basename(wan_dataset)}: a read for job stuck rank 0")
        info = feeder_info(a.address)
        assert info.stuck == list(st.stuck)
        assert info.load > 0 and st.load > 0   # (its builds queued behind stopped threads)
        import urllib.request
        with urllib.request.urlopen(f"http://{a.metrics}/metrics", timeout=10) as r:
            assert "feeder_stuck_reads 1.0" in r.read().decode()
        # a new rank is not handed to the stuck feeder: it is refused there and served by the other
        other = FeederDataset({"a": a.address, "b": b.address}, job="stuck", rank=1, world_size=2, seq_len=SEQ,
                              micro_batch=MB, seed=5, num_epochs=0, prefer="order", slow_wait=0)
        it = iter(other)
        assert next(it).region == "b"
        it.close()
        for t in frozen:
            thaw(t)
        frozen = []
        wait_until(lambda: not fetch(a.address).stuck, 10, "the feeder still says stuck after its reads returned")
        again = FeederDataset([a.address], job="stuck", rank=1, world_size=2, seq_len=SEQ, micro_batch=MB, seed=5,
                              num_epochs=0)
        it = iter(again)
        assert next(it).region == "a"
        it.close()
        loop.stop()
        print(f"batch threads stopped at {stuck_at:.1f} s, the rank on the other feeder at {moved_at:.1f} s")
        check_prefix(loop.got, stream, SEQ, 0, 2, 5)
    finally:
        for t in frozen:
            thaw(t)
        a.stop()
        b.stop()

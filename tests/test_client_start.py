"""What a trainer author sees when things go wrong at the edges (issue 28): a feeder that is not
there fails fast and in one line, a feeder that dies is not taken for a TLS mismatch, and a
script that keeps its iterator in a global exits without a traceback. Real processes."""
from __future__ import annotations

import logging
import signal
import subprocess
import sys
import textwrap
import time

from feeder.core.errors import Code
from feeder.core.net import free_port
from feeder_client import FeederDataset
from tests.helpers import FeederProc, served_until_error

SEQ, MB = 16, 4


def run_script(code: str, timeout: float = 60) -> tuple[subprocess.CompletedProcess, float]:
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                       timeout=timeout)
    return r, time.monotonic() - t0


def test_closed_ports_raise_within_connect_timeout_in_a_few_lines_naming_every_target():
    a, b = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    r, took = run_script(f"""
        from feeder_client import FeederDataset
        from feeder.core.errors import FeederError
        ds = FeederDataset([{a!r}, {b!r}], job="j", rank=0, world_size=1, seq_len=16, micro_batch=4,
                           connect_timeout_s=3)
        try:
            next(iter(ds))
        except FeederError as e:
            print(e.code.name, e)
        """)
    out = (r.stdout + r.stderr).strip().splitlines()
    assert r.returncode == 0 and took < 15, (took, r.stderr)
    assert len(out) <= 10, out
    assert "Traceback" not in r.stderr
    last = r.stdout.strip().splitlines()[-1]
    assert last.startswith("UNAVAILABLE") and "connect_timeout_s=3" in last and a in last and b in last
    assert "does this feeder use TLS" not in r.stdout + r.stderr
    # The default is about 30 s, not retry_for_s's 300.
    assert FeederDataset([a], job="j", rank=0, world_size=1, seq_len=16,
                         micro_batch=4).transport["connect_timeout_s"] == 30.0


def test_a_plain_text_feeder_killed_under_a_rank_is_no_tls_hint_and_is_logged_once(dataset, caplog):
    f = FeederProc(dataset)
    try:
        ds = FeederDataset([f.address], job="killed", rank=0, world_size=1, seq_len=SEQ, micro_batch=MB,
                           num_epochs=0, read_ahead=1, retry_for_s=3, failback_s=0)

        def batches():
            for i, batch in enumerate(ds):
                if i == 2:
                    f.signal(signal.SIGKILL)
                yield batch

        with caplog.at_level(logging.WARNING, logger="feeder_client"):
            served, err = served_until_error(batches())
    finally:
        f.stop()
    assert len(served) >= 3 and err.code == Code.UNAVAILABLE
    assert "for 3s" in str(err)    # retry_for_s, not connect_timeout_s: the feeder had answered
    broke = [r.getMessage() for r in caplog.records if "stream broke" in r.getMessage()]
    assert broke and not any("TLS" in m for m in broke), broke
    assert len(broke) <= 3, broke   # one per distinct failure, not one per retry


def test_an_iterator_held_in_a_global_exits_without_a_traceback(dataset):
    f = FeederProc(dataset)
    try:
        r, _ = run_script(f"""
            from feeder_client import FeederDataset
            from feeder_client.stream import ClientConfig, FeederClient
            from feeder.core.config import StreamSpec
            ds = FeederDataset([{f.address!r}], job="g", rank=0, world_size=2, seq_len=16, micro_batch=4,
                               num_epochs=0)
            it = iter(ds)                 # a generator, kept in a module-level global
            first = next(it)
            client = FeederClient(ClientConfig(targets=({f.address!r},), spec=StreamSpec(
                job="g", rank=1, world_size=2, seq_len=16, micro_batch=4, num_epochs=0)))
            second = next(client)         # a client too, never closed
            print("ok", len(first.sample_ids), len(second.sample_ids))
            """)
    finally:
        f.stop()
    assert r.returncode == 0 and r.stdout.strip() == "ok 4 4", r.stderr
    assert "Exception ignored" not in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_regression_chaos_910255_a_client_closed_from_another_thread_ends_its_loop_without_a_gap(feeder):
    """Found by the soak (seeds 910255, 910141, 910332: a model-parallel rank's member read in a
    thread, closed by the main thread at the end): close() dropped the queued batches, and the
    reader, waiting for room, then queued the next ones, so the loop took a batch after a gap.
    Now a closed client queues nothing more and the loop ends (StopIteration), its batches still
    one after another; a loop that waits on an empty queue ends too."""
    import threading

    from feeder.core.config import StreamSpec
    from feeder_client.stream import ClientConfig, FeederClient

    for rounds in range(3):
        client = FeederClient(ClientConfig(targets=(feeder.address,), read_ahead=8, spec=StreamSpec(
            job=f"close-{rounds}", rank=0, world_size=1, seq_len=SEQ, micro_batch=MB, num_epochs=0)))
        got, ended = [], threading.Event()

        def loop():
            for b in client:
                got.append((b.epoch, b.step))
                time.sleep(0.002)
            ended.set()

        t = threading.Thread(target=loop, daemon=True)
        t.start()
        while len(got) < 40 + 20 * rounds:
            time.sleep(0.005)
        client.close()           # (the reader is waiting for room: the queue is full)
        assert ended.wait(5), "the loop did not end after close()"
        per_epoch = max(s for _, s in got) + 1
        flat = [e * per_epoch + s for e, s in got]
        assert flat == list(range(flat[0], flat[0] + len(flat))), "a batch after a gap"


def test_a_closed_handoff_takes_nothing_more_and_ends_a_waiting_take():
    import threading

    from feeder_client.handoff import END, Handoff

    q, stop = Handoff(2), threading.Event()
    assert q.put_many([1, 2], stop)
    left = []
    t = threading.Thread(target=lambda: left.append(q.put_many([3, 4], stop)))
    t.start()                    # waits for room
    time.sleep(0.05)
    q.close()
    t.join(2)
    assert left == [False] and not q.items and q.get() is END

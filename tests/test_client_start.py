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

"""The WAN proxies the chaos harness and WAN tests put between ranks and feeders
(bench/wanproxy.py) must never lose bytes of a connection they keep open: a lost stretch of
whole HTTP/2 frames takes whole gRPC messages out of a stream without breaking it, and the rank
then skips batches with no reconnect (chaos seed 4510274 --kinds slow,stuck).

Toxiproxy (v2.12.0) drops a chunk when a toxic is removed while the toxic after it in the chain
does not take the chunk within 5 s (link.go RemoveToxic: "Could not write last packets after
interrupt to Output"). A `slow` fault stacks a 2 KB/s bandwidth toxic after the link's own one;
healing it removed the link's own first, whose chunks then waited on the 2 KB/s one."""
from __future__ import annotations

import socket
import threading
import time

import pytest

from feeder_bench.wanproxy import Toxiproxy, ensure_toxiproxy

CHUNK = 16000   # 8 s at 2 KB/s, half a second at 32 KB/s
CHUNKS = 3


def _pattern(n: int) -> bytes:
    return bytes(i * 7 % 251 for i in range(n))


@pytest.fixture(scope="module")
def toxiproxy():
    binary = ensure_toxiproxy()
    # `make test` builds it (`make toxiproxy`, Go from the module proxy): without it this test
    # cannot say anything about Toxiproxy, so it fails rather than pass unseen
    assert binary is not None, "no toxiproxy server: run `make toxiproxy` (needs Go)"
    t = Toxiproxy(binary)
    yield t
    t.close()


def _upstream() -> tuple[socket.socket, list]:
    """A server that sends CHUNKS chunks a little apart (each its own read in the proxy), then
    holds the connection open."""
    srv = socket.create_server(("127.0.0.1", 0))
    conns = []

    def serve():
        c, _ = srv.accept()
        conns.append(c)
        data = _pattern(CHUNK * CHUNKS)
        for i in range(CHUNKS):
            c.sendall(data[i * CHUNK:(i + 1) * CHUNK])
            time.sleep(0.1)

    threading.Thread(target=serve, daemon=True).start()
    return srv, conns


def test_healing_a_slow_link_loses_no_bytes(toxiproxy):
    """A 2 KB/s toxic on top of the link's 32 KB/s, removed while both hold chunks: every byte
    arrives, in order, at the link's own rate (before the fix a chunk was dropped after 5 s)."""
    srv, conns = _upstream()
    link = toxiproxy.proxy("127.0.0.1:%d" % srv.getsockname()[1])
    try:
        link.bandwidth(32)
        link.bandwidth(2)   # the `slow` fault (tests/chaos/runner.py)
        host, port = link.listen.rsplit(":", 1)
        rank = socket.create_connection((host, int(port)), timeout=10)
        got = bytearray(rank.recv(65536))   # the 2 KB/s toxic is sending the first chunk
        time.sleep(0.8)                      # ... and the 32 KB/s one holds the second
        t0 = time.monotonic()
        try:
            link.clear()                     # the heal (tests/chaos/runner.py unclog)
        except OSError as e:                 # (the API call timed out: 10 s)
            pytest.fail(f"removing the toxics hung on the 2 KB/s one ({e!r}): Toxiproxy drops what it held")
        link.bandwidth(32)
        assert time.monotonic() - t0 < 3, "removing the toxics waited on the 2 KB/s one"
        rank.settimeout(5)
        while len(got) < CHUNK * CHUNKS:
            b = rank.recv(65536)
            assert b, "the proxy closed the connection"
            got += b
        assert bytes(got) == _pattern(CHUNK * CHUNKS)
        rank.close()
    finally:
        toxiproxy.drop(link.name)
        for c in conns:
            c.close()
        srv.close()

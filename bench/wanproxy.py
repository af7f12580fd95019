"""A latency / bandwidth / fault proxy between ranks and feeders, for the WAN tests.

Toxiproxy (Shopify, built with `go install` by `make toxiproxy`) when its binary is there; a
user-space asyncio proxy with the same four toxics where Go is absent. Both give a Proxy with
`.listen` (HOST:PORT for the rank) and latency / bandwidth / reset / blackhole / clear.
"""
from __future__ import annotations

import asyncio
import json
import os
import random
import shutil
import socket
import struct
import subprocess
import threading
import time
import urllib.request
from pathlib import Path

from feeder.core.net import free_port

TOXIPROXY_VERSION = "v2.12.0"
TOXIPROXY_BIN = Path(os.environ.get("TOXIPROXY_SERVER", Path.home() / ".cache" / "feeder" / "toxiproxy" / "server"))


def ensure_toxiproxy() -> Path | None:
    """The toxiproxy server binary, built from the Go module proxy when Go is here."""
    if TOXIPROXY_BIN.exists():
        return TOXIPROXY_BIN
    go = shutil.which("go")
    if not go:
        return None
    env = {**os.environ, "GOBIN": str(TOXIPROXY_BIN.parent)}
    r = subprocess.run([go, "install", f"github.com/Shopify/toxiproxy/v2/cmd/server@{TOXIPROXY_VERSION}"],
                       env=env, capture_output=True, text=True, timeout=600)
    return TOXIPROXY_BIN if r.returncode == 0 and TOXIPROXY_BIN.exists() else None


# ---- Toxiproxy ----------------------------------------------------------------------------

class Toxiproxy:
    kind = "toxiproxy"

    def __init__(self, binary: Path):
        self.binary, self.port = binary, free_port()
        self.proxies: dict[str, tuple[str, str]] = {}   # name -> (listen, upstream), to restart with
        self.n = 0
        self._start()

    def _start(self) -> None:
        self.proc = subprocess.Popen([str(self.binary), "-host", "127.0.0.1", "-port", str(self.port)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 20
        while True:
            try:
                self._call("GET", "/version")
                break
            except OSError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise RuntimeError("toxiproxy did not start")
                time.sleep(0.1)

    def restart(self) -> None:
        """A new server on the same API port with the same proxies on the same ports, without
        toxics. Toxiproxy's API can hang for good (a DELETE of a toxic waiting on a pipe whose
        far end was SIGSTOPped); the proxied connections drop, as in a reset."""
        self.proc.kill()
        self.proc.wait(10)
        self._start()
        for name, (listen, upstream) in self.proxies.items():
            self._call("POST", "/proxies", {"name": name, "listen": listen, "upstream": upstream, "enabled": True})

    def _call(self, method: str, path: str, body: dict | None = None):
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}{path}", method=method,
                                     data=json.dumps(body).encode() if body is not None else None)
        with urllib.request.urlopen(req, timeout=10) as r:
            data = r.read()
        return json.loads(data) if data.strip() else None

    def proxy(self, upstream: str) -> "ToxiProxy":
        self.n += 1
        name = f"p{self.n}"
        r = self._call("POST", "/proxies", {"name": name, "listen": "127.0.0.1:0", "upstream": upstream,
                                            "enabled": True})
        self.proxies[name] = (r["listen"], upstream)
        return ToxiProxy(self, name, r["listen"])

    def drop(self, name: str) -> None:
        self.proxies.pop(name, None)
        self._call("DELETE", f"/proxies/{name}")

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait(10)


class ToxiProxy:
    def __init__(self, api: Toxiproxy, name: str, listen: str):
        self.api, self.name, self.listen = api, name, listen
        self.toxics: list[str] = []

    def _toxic(self, kind: str, stream: str, **attributes) -> None:
        # A name of its own: the list may have been resynced from the API (tests/chaos), and a
        # name made from its length could then collide with a toxic still there (HTTP 409).
        name = f"{kind}-{stream}-{os.urandom(4).hex()}"
        self.api._call("POST", f"/proxies/{self.name}/toxics", {"name": name, "type": kind, "stream": stream,
                                                                "toxicity": 1.0, "attributes": attributes})
        self.toxics.append(name)

    def latency(self, rtt_ms: float, jitter_ms: float = 0) -> None:
        for stream in ("upstream", "downstream"):  # half the round trip each way
            self._toxic("latency", stream, latency=int(rtt_ms / 2), jitter=int(jitter_ms / 2))

    def bandwidth(self, kb_per_s: int) -> None:
        self._toxic("bandwidth", "downstream", rate=int(kb_per_s))

    def reset(self) -> None:
        self._toxic("reset_peer", "downstream", timeout=0)

    def blackhole(self) -> None:
        for stream in ("upstream", "downstream"):
            self._toxic("timeout", stream, timeout=0)  # 0: drop everything, never close

    def clear(self) -> None:
        """Every toxic removed, the newest first. Toxiproxy hands a removed toxic's chunks on to
        the toxic after it in the chain, and drops a chunk that one does not take within 5 s
        (v2.12.0 link.go RemoveToxic: "Could not write last packets after interrupt to
        Output"). Removed oldest first, a `slow` link (a 2 KB/s toxic after its own 32 KB/s
        one) lost the 32 KB/s toxic's chunks: whole HTTP/2 frames, so whole gRPC messages went
        missing from a stream that stayed open and ranks skipped batches without a reconnect
        (chaos seed 4510274 --kinds slow,stuck). The newest removed first, a removed toxic is
        the last of its chain: its chunks go straight to the rank's socket."""
        while self.toxics:   # (the list stays what the proxy has if a DELETE fails)
            self.api._call("DELETE", f"/proxies/{self.name}/toxics/{self.toxics[-1]}")
            self.toxics.pop()


# ---- the user-space fallback -------------------------------------------------------------

class PyProxies:
    kind = "python"

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def proxy(self, upstream: str) -> "PyProxy":
        return asyncio.run_coroutine_threadsafe(PyProxy.start(upstream), self.loop).result(10)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)


class PyProxy:
    """Toxics as Toxiproxy applies them: latency (+ jitter, order kept) per direction,
    bandwidth on the way to the rank, reset (RST now and for new connections), blackhole."""

    def __init__(self, upstream: str):
        self.upstream = upstream
        self.delay = 0.0
        self.jitter = 0.0
        self.rate = 0.0          # bytes/s toward the rank, 0 = unlimited
        self.mode = "pass"       # pass | reset | blackhole
        self.conns: set[asyncio.StreamWriter] = set()
        self.listen = ""

    @classmethod
    async def start(cls, upstream: str) -> "PyProxy":
        p = cls(upstream)
        p.loop = asyncio.get_running_loop()
        p.server = await asyncio.start_server(p._client, "127.0.0.1", 0)
        p.listen = "127.0.0.1:%d" % p.server.sockets[0].getsockname()[1]
        return p

    async def _client(self, r1, w1):
        if self.mode == "reset":
            return self._rst(w1)
        host, _, port = self.upstream.rpartition(":")
        try:
            r2, w2 = await asyncio.open_connection(host, int(port))
        except OSError:
            return self._rst(w1)
        self.conns |= {w1, w2}
        await asyncio.gather(self._pump(r1, w2, False), self._pump(r2, w1, True), return_exceptions=True)
        for w in (w1, w2):
            self.conns.discard(w)
            w.close()

    async def _pump(self, reader, writer, to_rank: bool):
        due = 0.0
        while True:
            data = await reader.read(65536)
            if not data:
                writer.close()
                return
            if self.mode == "blackhole":
                continue
            loop = asyncio.get_running_loop()
            due = max(due, loop.time() + self.delay + random.uniform(-self.jitter, self.jitter))
            if due > loop.time():
                await asyncio.sleep(due - loop.time())
            if to_rank and self.rate:
                for i in range(0, len(data), 16384):
                    writer.write(data[i:i + 16384])
                    await asyncio.sleep(len(data[i:i + 16384]) / self.rate)
            else:
                writer.write(data)
            await writer.drain()

    @staticmethod
    def _rst(writer) -> None:
        sock = writer.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        writer.transport.abort()

    def latency(self, rtt_ms: float, jitter_ms: float = 0) -> None:
        self.delay, self.jitter = rtt_ms / 2000, jitter_ms / 2000

    def bandwidth(self, kb_per_s: int) -> None:
        self.rate = kb_per_s * 1024

    def reset(self) -> None:
        self.mode = "reset"

        def rst_all():
            for w in list(self.conns):
                self._rst(w)

        self.loop.call_soon_threadsafe(rst_all)

    def blackhole(self) -> None:
        self.mode = "blackhole"

    def clear(self) -> None:
        self.delay = self.jitter = self.rate = 0.0
        self.mode = "pass"


def start_proxies():
    binary = ensure_toxiproxy()
    return Toxiproxy(binary) if binary else PyProxies()

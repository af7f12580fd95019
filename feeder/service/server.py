"""Server lifecycle: build the grpc.aio server, health and reflection, graceful stop."""
from __future__ import annotations

import asyncio
import functools
import logging
import signal
import threading
import time

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from feeder.core.config import ServeConfig
from feeder.domain.engine import Engine
from feeder.core.errors import Unavailable
from feeder.service.wire import encode_reply
from feeder.service.servicer import FeederServicer, add_to_server, status_reply
from feeder.sources import Source
from feeder.sources.open import load_sources
from feeder.v1 import feeder_pb2 as pb

log = logging.getLogger("feeder.server")
SERVICE = pb.DESCRIPTOR.services_by_name["Feeder"].full_name
MAX_MESSAGE = 256 << 20

# Keepalive for long-lived streams over WAN: clients ping every 30 s; the server must
# accept pings that often (else it answers GOAWAY "too_many_pings") and pings back so a
# vanished client is noticed and its stream's resources freed.
SERVER_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE),
    ("grpc.max_receive_message_length", MAX_MESSAGE),
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 20_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.http2.lookahead_bytes", 4 << 20),
]


class Server:
    def __init__(self, cfg: ServeConfig, sources: dict[str, Source] | None = None):
        self.cfg = cfg
        self.engine = Engine(cfg, sources if sources is not None else load_sources(cfg),
                             serialize=functools.partial(encode_reply, region=cfg.region))
        self.server: grpc.aio.Server | None = None
        self.health = health.aio.HealthServicer() if hasattr(health, "aio") else health.HealthServicer()
        self.port = 0
        self.stopped = asyncio.Event()
        self.metrics_server = None
        self.metrics_address = ""
        self.tokens = None
        self.certificates = None
        self._publisher: asyncio.Task | None = None
        self._watcher: asyncio.Task | None = None

    async def start(self) -> int:
        cfg = self.cfg
        interceptors = []
        if cfg.tokens_file:
            from feeder.service.security import AuthInterceptor, TokenStore
            from feeder.service.servicer import STATUS

            self.tokens = TokenStore(cfg.tokens_file)
            interceptors.append(AuthInterceptor(self.tokens, STATUS, default_dataset=self.engine.default))
        # SO_REUSEPORT only among the processes of one `serve --processes N` (siblings): grpcio
        # sets it by default, so a second feeder started on a taken port, with other data, would
        # silently get half the connections (found by the soak: two scenarios' feeders on one
        # port, a rank served another dataset's batches). Alone, the bind fails loudly.
        reuse = [("grpc.so_reuseport", 1 if cfg.sibling_dir or cfg.reuse_port else 0)]
        self.server = grpc.aio.server(options=SERVER_OPTIONS + reuse, interceptors=interceptors)
        add_to_server(FeederServicer(self.engine), self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection(
            (SERVICE, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME),
            self.server)
        if cfg.tls:
            from feeder.service.security import ReloadingCertificates

            self.certificates = ReloadingCertificates(cfg.tls_cert, cfg.tls_key, cfg.tls_client_ca)
        else:
            from feeder.core.net import is_loopback

            if not is_loopback(cfg.listen.rpartition(":")[0]):
                log.warning("serving PLAIN TEXT on %s (--insecure): tokens, cursors and data cross the network "
                            "unencrypted; use --tls-cert/--tls-key beyond a trusted network", cfg.listen)
        # Metrics first: a process that cannot serve them never listens, so it takes no stream.
        if cfg.metrics_listen:
            from feeder.service.metrics import start_metrics

            self.metrics_server, self.metrics_address = start_metrics(
                self.engine, asyncio.get_running_loop(), cfg.metrics_listen,
                tls=(cfg.tls_cert, cfg.tls_key, cfg.tls_client_ca) if cfg.tls else None, tokens=self.tokens)
        try:
            self.port = (self.server.add_secure_port(cfg.listen, self.certificates.credentials()) if cfg.tls
                         else self.server.add_insecure_port(cfg.listen))
        except RuntimeError:   # grpcio's "Failed to bind" (its own log line says why)
            self.port = 0
        if self.port == 0:
            if self.metrics_server is not None:
                self.metrics_server.shutdown()
            raise Unavailable(f"cannot listen on {cfg.listen}: the port is taken by another program (a feeder too: feeders "
                              "share a port only under `serve --processes N` or with --reuse-port) or the host "
                              "is not an address of this machine")
        await self.server.start()
        if cfg.scrub_mb_s:
            from feeder.domain.scrub import Scrubber
            from feeder.sources.posix import PosixSource

            # The sources served from files (formats included); Kafka's are its own.
            self.engine.scrubber = Scrubber({n: s for n, s in self.engine.sources.items()
                                             if isinstance(s, PosixSource)}, cfg.scrub_mb_s)
        if self.engine.siblings is not None:
            self._publisher = asyncio.create_task(self._publish_status())
        self._watcher = asyncio.create_task(self._watch_reads())
        for name in ("", SERVICE):
            await _set(self.health, name, health_pb2.HealthCheckResponse.SERVING)
        return self.port

    async def _watch_reads(self) -> None:
        """Stuck reads and the process's load, every second (Engine.watch_reads)."""
        while True:
            await asyncio.sleep(1.0)
            try:
                self.engine.watch_reads()
            except Exception:   # a bug here must not end the watch (nor the server)
                log.exception("watching the reads failed")

    async def _publish_status(self) -> None:
        """Leave this process's status for the other processes of this port: every second, and
        at once when a stream opens or closes (the change written through, not COALESCE_S
        later: a Status answered by another process right after a stream ran must see it), then
        at most once per COALESCE_S, so 64 ranks connecting at once cost a few writes, not 64."""
        import feeder.domain.siblings as sib

        siblings, changed = self.engine.siblings, asyncio.Event()
        self.engine.on_change = changed.set
        while True:
            changed.clear()
            try:
                taken = time.time()
                await asyncio.to_thread(siblings.publish, status_reply(self.engine), taken)
            except OSError as e:   # a full or vanished directory: the view misses us, serving goes on
                log.warning("cannot leave status for the other processes: %s", e)
            await asyncio.sleep(sib.COALESCE_S)   # what changes meanwhile goes in the next write
            if not changed.is_set():
                try:
                    await asyncio.wait_for(changed.wait(), max(0.0, sib.EVERY_S - sib.COALESCE_S))
                except TimeoutError:
                    pass

    @property
    def address(self) -> str:
        host = self.cfg.listen.rpartition(":")[0]
        return f"{host}:{self.port}"

    async def stop(self, grace: float | None = None) -> None:
        """NOT_SERVING first, so load balancers and clients move away, then drain."""
        for name in ("", SERVICE):
            await _set(self.health, name, health_pb2.HealthCheckResponse.NOT_SERVING)
        self.engine.shutdown()
        if self.engine.scrubber is not None:
            self.engine.scrubber.stop()
        if self.server is not None:
            await self.server.stop(self.cfg.grace_s if grace is None else grace)
        if self._watcher is not None:
            self._watcher.cancel()
        if self._publisher is not None:
            self._publisher.cancel()
            self.engine.siblings.withdraw()
        self.engine.close()
        if self.metrics_server is not None:
            self.metrics_server.shutdown()
        self.stopped.set()


async def _set(h, name: str, status) -> None:
    r = h.set(name, status)
    if asyncio.iscoroutine(r):
        await r


def new_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop

        return uvloop.new_event_loop()
    except ImportError:  # uvloop is Linux/macOS only
        return asyncio.new_event_loop()


async def serve_forever(cfg: ServeConfig, on_ready=None) -> None:
    server = Server(cfg)
    await server.start()
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    if on_ready:
        on_ready(server)
    await stop.wait()
    log.info("stopping: draining streams for up to %.0fs", cfg.grace_s)
    await server.stop()
    log.info("stopped")


class ServerThread:
    """A feeder on its own event loop in a background thread (tests, benchmarks, embedding)."""

    def __init__(self, cfg: ServeConfig, sources: dict[str, Source] | None = None):
        self.cfg, self._sources = cfg, sources
        self.loop = new_loop()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="feeder-server", daemon=True)
        self.thread.start()
        self._ready.wait(60)
        if self._error:
            raise self._error

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.server = Server(self.cfg, self._sources)
            self.port = self.loop.run_until_complete(self.server.start())
        except BaseException as e:
            self._error = e
            self._ready.set()
            return
        self._ready.set()
        self.loop.run_forever()

    @property
    def address(self) -> str:
        return self.server.address

    @property
    def engine(self) -> Engine:
        return self.server.engine

    def call(self, coro_fn, timeout: float = 30):
        return asyncio.run_coroutine_threadsafe(coro_fn(), self.loop).result(timeout)

    def stop(self, grace: float = 0.5) -> None:
        if not self.thread.is_alive():
            return
        asyncio.run_coroutine_threadsafe(self.server.stop(grace), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()

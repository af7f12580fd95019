"""The ceilings: a bare TCP socket and a bare grpc.aio stream, each served from its own
process so it does not share the reader's GIL."""
from __future__ import annotations

import multiprocessing as mp
import socket
import time
from typing import TYPE_CHECKING

from feeder.core.malloc import keep_freed_memory

if TYPE_CHECKING:
    from .clients import Clients


def _socket_server(port_q, seconds, chunk):
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(1)
    port_q.put(s.getsockname()[1])
    c, _ = s.accept()
    buf = b"\0" * chunk
    end = time.monotonic() + seconds + 1
    try:
        while time.monotonic() < end:
            c.sendall(buf)
    except OSError:
        pass
    c.close()


def _serve_in_process(target, seconds: float, size: int):
    """Start a ceiling server (`target(port_queue, seconds, size)`) in its own process, so it
    does not share this one's GIL; (process, port)."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=target, args=(q, seconds, size))
    p.start()
    return p, q.get(timeout=60)


def raw_socket_mb_s(seconds: float, chunk: int) -> float:
    """MB/s a bare TCP socket on loopback carries, read with recv_into: the first ceiling."""
    p, port = _serve_in_process(_socket_server, seconds, chunk)
    c = socket.create_connection(("127.0.0.1", port))
    buf = bytearray(chunk)
    view = memoryview(buf)
    got, t0 = 0, time.monotonic()
    while time.monotonic() - t0 < seconds:
        n = c.recv_into(view)
        if n == 0:
            break
        got += n
    dt = time.monotonic() - t0
    c.close()
    p.join(10)
    return got / dt / 1e6


def _grpc_server(port_q, seconds, size):
    import asyncio

    import grpc

    from feeder.service.server import SERVER_OPTIONS, new_loop

    keep_freed_memory()   # as `feeder serve` does: the ceiling runs with the feeder's settings
    payload = b"\1" * size

    async def stream(request, context):
        end = time.monotonic() + seconds + 2
        while time.monotonic() < end:
            yield payload

    async def main():
        server = grpc.aio.server(options=SERVER_OPTIONS)
        handler = grpc.method_handlers_generic_handler(
            "bench.Raw", {"Stream": grpc.unary_stream_rpc_method_handler(stream)})
        server.add_generic_rpc_handlers((handler,))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        port_q.put(port)
        await asyncio.sleep(seconds + 4)
        await server.stop(0)

    loop = new_loop()
    asyncio.set_event_loop(loop)
    loop.run_until_complete(main())


def raw_grpc_shared_mb_s(clients: "Clients", seconds: float, size: int, streams: int, reader: str = "grpcio") -> float:
    """The bare grpc.aio server taken by `streams` counting streams in the client processes,
    as the feeder is: what stock gRPC does when the clients share the cores with it."""
    p, port = _serve_in_process(_grpc_server, seconds + 4, size)
    try:
        got = clients.count([f"127.0.0.1:{port}"], None, streams, seq_len=0, mb=0, seconds=seconds, reader=reader)
        return got["tokens_s"] * 2 / 1e6
    finally:
        p.terminate()   # counted: no need to wait out its streams' margin
        p.join(20)


def raw_grpc_mb_s(seconds: float, size: int) -> float:
    """MB/s of a bare grpc.aio stream of `size`-byte messages read by one grpcio client,
    from its first message on: the second ceiling."""
    import grpc

    p, port = _serve_in_process(_grpc_server, seconds, size)
    ch = grpc.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.max_receive_message_length", 256 << 20)])
    call = ch.unary_stream("/bench.Raw/Stream")(b"")
    got, t0 = 0, None
    for msg in call:
        if t0 is None:
            t0 = time.monotonic()   # from the first message: connection set-up is not streaming
            continue
        got += len(msg)
        if time.monotonic() - t0 >= seconds:
            break
    dt = time.monotonic() - t0
    call.cancel()
    ch.close()
    p.join(15)
    return got / dt / 1e6


def raw_grpc_h2_mb_s(seconds: float, size: int) -> float:
    """raw_grpc_mb_s's server read by the bench's minimal HTTP/2 reader instead of grpcio: what
    the stock grpc.aio server sends when its reader takes little of the cores."""
    from .h2count import count_stream

    p, port = _serve_in_process(_grpc_server, seconds + 2, size)
    try:
        got = count_stream(f"127.0.0.1:{port}", "/bench.Raw/Stream", b"", seconds=seconds, warm_s=0.5)
        return got.bytes / got.seconds / 1e6
    finally:
        p.terminate()
        p.join(15)


"""The bench's minimal HTTP/2 reader (bench/h2count.py) against real gRPC servers over real
sockets: it must count exactly what a grpcio client receives, or the bench's figures taken
with it would be wrong."""
from __future__ import annotations

import asyncio
import threading

import grpc
import pytest

from feeder_bench.h2count import StreamError, count_stream
from feeder.v1 import feeder_pb2 as pb

# Sizes that cross the reader's 4 MiB buffer and HTTP/2's largest frame, an empty message,
# and ones whose 5-byte prefix lands at every offset of a 16 KiB frame boundary.
SIZES = [0, 1, 16379, 16380, 16383, 16384, 5 << 20, (1 << 24) + 7, 3, 70_000]


class RawServer:
    """A bare grpc.aio server in a thread: /t.T/Fixed streams SIZES then ends, or with
    grpc-status 9 when asked (request b"fail"); /t.T/Endless streams until cancelled."""

    def __init__(self):
        self.cancelled = threading.Event()
        ready = threading.Event()

        async def fixed(request, context):
            for i, n in enumerate(SIZES):
                yield bytes([i]) * n
            if request == b"fail":
                await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "asked to fail")

        async def endless(request, context):
            try:
                while True:
                    yield b"\7" * (1 << 20)
            finally:   # cancelled, or closed by gRPC once the call is gone
                self.cancelled.set()

        async def start():
            self.server = grpc.aio.server(options=[("grpc.max_send_message_length", 64 << 20)])
            self.server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("t.T", {
                "Fixed": grpc.unary_stream_rpc_method_handler(fixed),
                "Endless": grpc.unary_stream_rpc_method_handler(endless)}),))
            port = self.server.add_insecure_port("127.0.0.1:0")
            await self.server.start()
            return port

        def run():   # as feeder.service.server.ServerThread: the loop is this thread's own
            asyncio.set_event_loop(self.loop)
            self.port = self.loop.run_until_complete(start())
            ready.set()
            self.loop.run_forever()

        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()
        assert ready.wait(30)
        self.address = f"127.0.0.1:{self.port}"

    def stop(self):
        asyncio.run_coroutine_threadsafe(self.server.stop(0), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture(scope="module")
def raw():
    s = RawServer()
    yield s
    s.stop()


@pytest.mark.parametrize("discard", [False, True], ids=["read", "discard"])
@pytest.mark.parametrize("small", [False, True], ids=["16MiB-frames", "16KiB-frames-small-buffer"])
def test_counts_every_byte_and_message_of_a_finite_stream(raw, small, discard):
    # Small: HTTP/2's smallest frames and a buffer just over the reader's 64 KiB headroom, so
    # prefixes split across frames and reads, and the buffer's tail moves to the front.
    # Discard: bodies dropped by the kernel (MSG_TRUNC) must count the same.
    kw = {"max_frame": 16384, "buffer_bytes": 65536 + 1000} if small else {}
    got = count_stream(raw.address, "/t.T/Fixed", b"", seconds=None, discard=discard, **kw)
    assert got.status == "0"
    # discard: the bodies after the first (empty) message, but for the bytes that came in the
    # same reads as frame headers and prefixes, never reached this process
    assert (got.dropped > (0 if small else sum(SIZES) // 2)) if discard else got.dropped == 0
    assert got.messages == len(SIZES)
    assert got.bytes == sum(SIZES)
    assert got.first == b""      # the first message, whole: here the empty one


def test_a_non_zero_status_is_an_error_that_names_it(raw):
    with pytest.raises(StreamError, match="grpc-status 9: asked to fail"):
        count_stream(raw.address, "/t.T/Fixed", b"fail", seconds=None)


def test_an_unknown_method_is_an_error(raw):
    with pytest.raises(StreamError, match="grpc-status 12"):
        count_stream(raw.address, "/t.T/Nope", b"", seconds=None)


@pytest.mark.parametrize("discard", [False, True], ids=["read", "discard"])
def test_a_timed_window_counts_then_cancels_the_stream(raw, discard):
    raw.cancelled.clear()
    got = count_stream(raw.address, "/t.T/Endless", b"", seconds=0.3, warm_s=0.1, discard=discard)
    assert got.status == "cancelled" and got.seconds == 0.3
    assert len(got.first) == 1 << 20
    assert got.messages > 0 and got.bytes >= (got.messages - 1) << 20
    assert raw.cancelled.wait(10), "the server never saw the cancel"


def test_a_stream_that_ends_inside_the_window_is_an_error(raw):
    with pytest.raises(StreamError, match="before the counting window closed"):
        count_stream(raw.address, "/t.T/Fixed", b"", seconds=30)


def test_reads_the_feeder_byte_for_byte_as_grpcio_does(feeder):
    req = pb.StreamRequest(job="h2count", rank=1, world_size=3, seq_len=40, micro_batch=3, num_epochs=2,
                           seed=5, compression=pb.COMPRESSION_NONE)
    with grpc.insecure_channel(feeder.address) as ch:
        call = ch.unary_stream("/feeder.v1.Feeder/Stream", request_serializer=pb.StreamRequest.SerializeToString,
                               response_deserializer=None)
        want = list(call(req))
    for discard in (False, True):
        got = count_stream(feeder.address, "/feeder.v1.Feeder/Stream", req.SerializeToString(), seconds=None,
                           discard=discard)
        assert got.messages == len(want) > 1
        assert got.bytes == sum(map(len, want))
        assert got.first == want[0]


def test_frames_and_prefixes_split_across_reads_are_parsed_whole():
    """Scripted server bytes on a socket pair: thousands of small DATA frames, pings and a
    settings frame, read through a buffer just over the reader's headroom, so frame headers,
    control frames and message prefixes fall across reads and the buffer's tail is moved."""
    import random
    import socket
    import struct

    from feeder_bench import h2count as h

    rnd = random.Random(3)
    sizes = [rnd.choice([0, 1, 4, 5, 300, 9000, 70_000]) for _ in range(300)]
    stream = b"".join(b"\0" + struct.pack(">I", n) + bytes([i % 251]) * n for i, n in enumerate(sizes))
    script = [h._frame(h.SETTINGS, 0, 0, struct.pack(">HI", 0x4, 1 << 20)), h._frame(h.HEADERS, h.END_HEADERS, 1, b"\x88")]
    i = 0
    while i < len(stream):
        n = rnd.randint(1, 700)
        script.append(h._frame(h.DATA, 0, 1, stream[i:i + n]))
        if rnd.random() < 0.05:
            script.append(h._frame(h.PING, 0, 0, b"12345678"))
        i += n
    script.append(h._frame(h.HEADERS, h.END_HEADERS | h.END_STREAM, 1, h._literal("grpc-status", "0")))
    ours, theirs = socket.socketpair()
    writer = threading.Thread(target=lambda: (theirs.sendall(b"".join(script)), theirs.shutdown(socket.SHUT_WR)))
    writer.start()
    replies = bytearray()
    drain = threading.Thread(target=_drain, args=(theirs, replies))
    drain.start()
    out = h.Counted()
    h._Reader(ours, out, None, 0.0, 65536 + 50).run()
    ours.close()
    writer.join(10)
    drain.join(10)
    theirs.close()
    assert out.status == "0" and out.messages == len(sizes) and out.bytes == sum(sizes)
    assert replies.count(h._frame(h.PING, h.ACK, 0, b"12345678")) == sum(1 for f in script if f[3] == h.PING)
    assert replies.startswith(h._frame(h.SETTINGS, h.ACK, 0))


def _drain(sock, into: bytearray) -> None:
    while chunk := sock.recv(65536):
        into += chunk

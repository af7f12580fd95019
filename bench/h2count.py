"""A minimal HTTP/2 reader of one gRPC server stream that counts what arrives: the
benchmark's load generator, not a client for users (ranks use `client.stream`).

Why it exists: `feeder bench` runs the server and its readers on the same few cores, so every
core-second a reader spends is one the server it measures does not get. A grpcio client spends
about 0.8-1.1 core-seconds per GB here (its C core, a copy of each message into Python bytes,
its polling threads); this reader spends about 0.2-0.4: it asks for DATA frames of up to
16 MiB, `recv_into`s one reused buffer, and reads only the 9-byte frame headers and gRPC's
5-byte message prefixes. The raw socket ceiling is read the same way (`recv_into`), so a
ratio of figures taken with it compares servers, not readers. With discard=True the kernel
drops the message bodies unread (MSG_TRUNC): measured, that took it from ~0.23 to ~0.16
core-seconds per GB, so what remains is the kernel's own receive path, not the copy.

What it leaves out, on purpose: TLS, HPACK decoding (the trailers are searched for the literal
`grpc-status` that gRPC's C core writes; anything else ends the count with the raw block in
the error), message compression, and more than one stream per connection.
"""
from __future__ import annotations

import socket
import struct
import time
from dataclasses import dataclass

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, RST_STREAM, SETTINGS, PING, GOAWAY, WINDOW_UPDATE, CONTINUATION = 0, 1, 3, 4, 6, 7, 8, 9
END_STREAM, ACK, END_HEADERS, PADDED = 0x1, 0x1, 0x4, 0x8
MAX_WINDOW = (1 << 31) - 1
MAX_FRAME = (1 << 24) - 1          # the largest SETTINGS_MAX_FRAME_SIZE HTTP/2 allows
STREAM = 1
CANCEL = 8


class StreamError(RuntimeError):
    """The stream or connection ended other than by our own cancel."""


@dataclass
class Counted:
    """What count_stream found on one stream."""

    bytes: int = 0          # message bytes (without the 5-byte prefixes) that arrived in the window
    messages: int = 0       # messages completed in the window
    total: int = 0          # message bytes read in all, the window or not (for CPU per byte)
    dropped: int = 0        # of those, bytes the kernel dropped unread (discard=True)
    first: bytes = b""      # the first message, whole (its content tells tokens per byte)
    seconds: float = 0.0    # the window's length (0 when the whole stream was read)
    status: str = ""        # "cancelled" after a timed window; "0" when the stream ended OK


def _frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    return struct.pack(">I", len(payload))[1:] + bytes((kind, flags)) + struct.pack(">I", stream) + payload


def _literal(name: str, value: str) -> bytes:
    """An HPACK literal header field without indexing, new name, no Huffman (RFC 7541 6.2.2)."""
    n, v = name.encode(), value.encode()
    if len(n) > 126 or len(v) > 126:
        raise ValueError(f"header {name!r} too long for this reader")
    return b"\x00" + bytes((len(n),)) + n + bytes((len(v),)) + v


def _trailer_status(block: bytes) -> tuple[str, str]:
    """(grpc-status, grpc-message) from a trailer block, as gRPC's C core writes them
    (literal, not Huffman-coded); ("?", raw block) when they are not found in that form."""
    def value(name: bytes) -> str | None:
        i = block.find(name)
        if i < 0 or i + len(name) >= len(block):
            return None
        n = block[i + len(name)]
        if n & 0x80:   # Huffman-coded: not decoded here
            return None
        return block[i + len(name) + 1:i + len(name) + 1 + (n & 0x7F)].decode("latin-1")

    status = value(b"grpc-status")
    if status is None:
        return "?", repr(block)
    return status, value(b"grpc-message") or ""


def count_stream(address: str, method: str, request: bytes, *, seconds: float | None, warm_s: float = 0.0,
                 timeout: float = 60.0, buffer_bytes: int = 4 << 20, max_frame: int = MAX_FRAME,
                 discard: bool = False) -> Counted:
    """Open `method` (e.g. "/feeder.v1.Feeder/Stream") at `address` ("host:port", plain text)
    with the serialized `request`, and count the reply messages.

    seconds=None: read until the stream ends and count every message. Otherwise the window
    opens `warm_s` after the first message is whole, counts for `seconds`, and the stream is
    then cancelled. Raises StreamError if the stream ends early or with a non-zero status.
    discard=True: message bodies after the first are dropped by the kernel unread (MSG_TRUNC),
    so the reader spends almost no CPU per byte; the counts are the same.
    `max_frame` and `buffer_bytes` exist for the tests, which split frames and reads small."""
    host, _, port = address.rpartition(":")
    body = b"\0" + struct.pack(">I", len(request)) + request
    if len(body) > 16384:   # the peer's frame limit before its SETTINGS arrive
        raise ValueError("request too large for this reader")
    headers = b"".join(_literal(k, v) for k, v in (
        (":method", "POST"), (":scheme", "http"), (":path", method), (":authority", address),
        ("content-type", "application/grpc"), ("te", "trailers")))
    settings = struct.pack(">HIHIHI", 0x2, 0, 0x4, MAX_WINDOW, 0x5, max_frame)   # no push; windows; frames
    sock = socket.create_connection((host.strip("[]"), int(port)), timeout=timeout)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    out = Counted()
    try:
        sock.sendall(PREFACE + _frame(SETTINGS, 0, 0, settings)
                     + _frame(WINDOW_UPDATE, 0, 0, struct.pack(">I", MAX_WINDOW - 65535))
                     + _frame(HEADERS, END_HEADERS, STREAM, headers) + _frame(DATA, END_STREAM, STREAM, body))
        _Reader(sock, out, seconds, warm_s, buffer_bytes, discard).run()
    finally:
        sock.close()
    return out


class _Reader:
    def __init__(self, sock: socket.socket, out: Counted, seconds: float | None, warm_s: float, buffer_bytes: int,
                 discard: bool = False):
        self.sock, self.out, self.seconds, self.warm_s, self.discard = sock, out, seconds, warm_s, discard
        self.buf = bytearray(buffer_bytes)
        self.view = memoryview(self.buf)
        self.prefix = bytearray()        # a gRPC message prefix split across DATA chunks
        self.left = 0                    # bytes of the current message still to come
        self.first: bytearray | None = bytearray()   # collects the first message until it is whole
        self.t_open: float | None = None if seconds is not None else 0.0   # window bounds (monotonic)
        self.t_close = float("inf")
        self.block = bytearray()         # a header block spread over CONTINUATION frames
        self.block_ends = False

    def _message_done(self, now: float) -> None:
        if self.first is not None:
            self.out.first, self.first = bytes(self.first), None
            if self.seconds is not None:
                self.t_open = now + self.warm_s
                self.t_close = self.t_open + self.seconds
        if self._in_window(now):
            self.out.messages += 1

    def _in_window(self, now: float) -> bool:
        return self.t_open is not None and self.t_open <= now < self.t_close

    def _data(self, chunk: memoryview, now: float) -> None:
        counting = self._in_window(now)
        i, n = 0, len(chunk)
        while i < n:
            if self.left == 0:
                take = min(5 - len(self.prefix), n - i)
                self.prefix += chunk[i:i + take]
                i += take
                if len(self.prefix) == 5:
                    if self.prefix[0] != 0:
                        raise StreamError("a compressed gRPC message: this reader asks for none")
                    self.left = int.from_bytes(self.prefix[1:5], "big")
                    self.prefix.clear()
                    if self.left == 0:
                        self._message_done(now)
                continue
            take = min(self.left, n - i)
            if self.first is not None:
                self.first += chunk[i:i + take]
            self._took(take, now, counting)
            i += take

    def _took(self, take: int, now: float, counting: bool) -> None:
        """Counts `take` bytes of the current message's body."""
        self.out.total += take
        if counting:
            self.out.bytes += take
        self.left -= take
        if self.left == 0:
            self._message_done(now)

    def _control(self, kind: int, flags: int, stream: int, payload: bytes) -> bool:
        """Handles a non-DATA frame; True when the stream has ended well."""
        if kind == SETTINGS and not flags & ACK:
            self.sock.sendall(_frame(SETTINGS, ACK, 0))
        elif kind == PING and not flags & ACK:
            self.sock.sendall(_frame(PING, ACK, 0, payload))
        elif kind in (HEADERS, CONTINUATION) and stream == STREAM:
            if kind == HEADERS:
                self.block = bytearray(payload)
                self.block_ends = bool(flags & END_STREAM)
            else:
                self.block += payload
            if flags & END_HEADERS and self.block_ends:
                status, message = _trailer_status(bytes(self.block))
                if status != "0":
                    raise StreamError(f"the stream ended with grpc-status {status}: {message}")
                if self.seconds is not None:
                    raise StreamError("the stream ended before the counting window closed")
                self.out.status = "0"
                return True
        elif kind == RST_STREAM:
            raise StreamError(f"the server reset the stream (HTTP/2 error {int.from_bytes(payload[:4], 'big')})")
        elif kind == GOAWAY:
            raise StreamError(f"the server sent GOAWAY (HTTP/2 error {int.from_bytes(payload[4:8], 'big')}): "
                              f"{payload[8:].decode('latin-1', 'replace')}")
        return False

    def run(self) -> None:
        buf, view, sock = self.buf, self.view, self.sock
        have = pos = 0
        frame_left = 0            # DATA payload bytes of the current frame still to read
        data_ends = False         # the current DATA frame carries END_STREAM
        unacked = 0               # DATA bytes taken since the last WINDOW_UPDATE
        while True:
            if pos == have:
                pos = have = 0
            elif len(buf) - have < 65536:     # keep room: move the unread tail to the front
                buf[:have - pos] = buf[pos:have]
                have, pos = have - pos, 0
            if self.discard and pos == have and frame_left and self.left and self.first is None:
                # Inside a message body, which this reader never looks at: the kernel drops the
                # bytes without copying them out (MSG_TRUNC on a TCP socket).
                n = sock.recv_into(view, min(frame_left, self.left, len(buf)), socket.MSG_TRUNC)
                if n == 0:
                    raise StreamError("the server closed the connection")
                now = time.monotonic()
                frame_left -= n
                self.out.dropped += n
                self._took(n, now, self._in_window(now))
                if frame_left == 0 and data_ends:
                    raise StreamError("the stream ended without trailers")
            else:   # discarding, read at most 64 KiB: little of a body is copied past a header
                n = sock.recv_into(view[have:], min(65536, len(buf) - have) if self.discard else 0)
                if n == 0:
                    raise StreamError("the server closed the connection")
                have += n
                now = time.monotonic()
            while pos < have:
                if frame_left:
                    take = min(frame_left, have - pos)
                    self._data(view[pos:pos + take], now)
                    pos += take
                    frame_left -= take
                    if frame_left == 0 and data_ends:
                        raise StreamError("the stream ended without trailers")
                    continue
                if have - pos < 9:
                    break
                length = int.from_bytes(buf[pos:pos + 3], "big")
                kind, flags = buf[pos + 3], buf[pos + 4]
                stream = int.from_bytes(buf[pos + 5:pos + 9], "big") & 0x7FFFFFFF
                if kind == DATA:
                    if flags & PADDED:
                        raise StreamError("a padded DATA frame: gRPC's C core sends none, nor does this reader parse them")
                    pos += 9
                    frame_left, data_ends = length, bool(flags & END_STREAM)
                    unacked += length
                    continue
                if 9 + length > len(buf):
                    raise StreamError(f"a {length}-byte control frame does not fit this reader's buffer")
                if have - pos < 9 + length:
                    break
                payload = bytes(view[pos + 9:pos + 9 + length])
                pos += 9 + length
                if self._control(kind, flags, stream, payload):
                    return
            if unacked >= 1 << 30:   # hand the window back long before 2 GiB runs out
                grant = struct.pack(">I", unacked)
                sock.sendall(_frame(WINDOW_UPDATE, 0, 0, grant) + _frame(WINDOW_UPDATE, 0, STREAM, grant))
                unacked = 0
            if now >= self.t_close:
                self.out.seconds = self.seconds   # bytes were counted only inside the window
                self.out.status = "cancelled"
                sock.sendall(_frame(RST_STREAM, 0, STREAM, struct.pack(">I", CANCEL))
                             + _frame(GOAWAY, 0, 0, struct.pack(">II", STREAM, 0)))
                return

"""Issue 34: targets that are not feeders are failed over, with real sockets. A gRPC server
without the feeder service (UNIMPLEMENTED), a web server speaking HTTP/1, an HTTP/2 ingress
answering 404 or 403, a feeder of another of the rank's regions: each is marked and the rank
moves on to the next target; only when every target has failed does it raise, in one line
naming each target and why."""
from __future__ import annotations

import http.server
import socket
import struct
import threading
import time
from concurrent import futures

import grpc
import pytest

from feeder.core.config import ServeConfig
from feeder.core.errors import FeederError
from feeder.service.server import ServerThread
from feeder_client import FeederDataset
from feeder_client.policy import not_a_feeder, other_region
from tests.helpers import check_batches, expected_ids

SEQ, MB, SEED = 16, 4, 5


@pytest.fixture(scope="module")
def strangers():
    """Three servers on loopback that are not feeders: {kind: HOST:PORT}."""
    from grpc_health.v1 import health, health_pb2_grpc

    other = grpc.server(futures.ThreadPoolExecutor(2))   # another gRPC service (health only)
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), other)
    other_port = other.add_insecure_port("127.0.0.1:0")
    other.start()

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *a):
            pass

    web = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Quiet)   # a web server (HTTP/1)
    threading.Thread(target=web.serve_forever, daemon=True).start()
    ingress404, stop404 = http2_ingress(404)
    ingress403, stop403 = http2_ingress(403)
    yield {"grpc-other": f"127.0.0.1:{other_port}", "http1": f"127.0.0.1:{web.server_address[1]}",
           "ingress-404": ingress404, "ingress-403": ingress403}
    other.stop(0)
    web.shutdown()
    stop404()
    stop403()


def http2_ingress(status: int):
    """An HTTP/2 server that answers every request with `status` and no body (what an ingress
    with no route, or a refusing WAF, answers): the frames written by hand, HPACK static table."""
    # ":status: 404" is entry 13 of HPACK's static table; any other as a literal of indexed name 8
    header = b"\x8d" if status == 404 else b"\x08\x03" + str(status).encode()
    srv = socket.create_server(("127.0.0.1", 0))
    done = threading.Event()

    def frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
        return struct.pack(">I", len(payload))[1:] + bytes([kind, flags]) + struct.pack(">I", stream) + payload

    def serve(conn: socket.socket) -> None:
        try:
            conn.recv(24)   # the client's preface
            conn.sendall(frame(4, 0, 0))   # our SETTINGS
            buf = b""
            while not done.is_set():
                data = conn.recv(65536)
                if not data:
                    return
                buf += data
                while len(buf) >= 9:
                    n = int.from_bytes(buf[:3], "big")
                    if len(buf) < 9 + n:
                        break
                    kind, flags, sid = buf[3], buf[4], int.from_bytes(buf[5:9], "big") & 0x7FFFFFFF
                    buf = buf[9 + n:]
                    if kind == 4 and not flags & 1:   # their SETTINGS: acknowledged
                        conn.sendall(frame(4, 1, 0))
                    elif kind == 1:   # a request's HEADERS: answered at once, END_HEADERS | END_STREAM
                        conn.sendall(frame(1, 0x5, sid, header))
                    elif kind == 6 and not flags & 1:   # PING
                        conn.sendall(frame(6, 1, 0, b"\0" * 8))
        except OSError:
            pass
        finally:
            conn.close()

    def accept() -> None:
        srv.settimeout(0.2)
        while not done.is_set():
            try:
                conn, _ = srv.accept()
            except OSError:
                continue
            threading.Thread(target=serve, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()

    def stop():
        done.set()
        srv.close()
    return f"127.0.0.1:{srv.getsockname()[1]}", stop


def rank(targets, **kw):
    return FeederDataset(targets, job=f"t-{time.time_ns()}", rank=1, world_size=2, seq_len=SEQ, micro_batch=MB,
                         seed=SEED, prefer="order", retry_for_s=20, connect_timeout_s=20, **kw)


def test_the_rank_moves_past_every_kind_of_stranger_to_the_feeder_and_is_served_exactly(strangers, feeder, stream):
    """[another gRPC service, a web server, an ingress answering 404, one answering 403, a
    feeder]: the rank was raised `Method not found!` at the first and never tried the feeder."""
    ds = rank([*strangers.values(), feeder.address])
    t0 = time.monotonic()
    got = list(ds)
    check_batches(got, stream, SEQ, expected_ids(stream, 1, 2, SEQ, SEED))
    assert time.monotonic() - t0 < 15
    assert set(ds.client.policy.refused) == set(strangers.values())


def test_when_every_target_fails_the_error_names_each_and_why(strangers):
    ds = rank(list(strangers.values()))
    with pytest.raises(FeederError) as e:
        next(iter(ds))
    ds.client.close()
    text = str(e.value)
    assert "\n" not in text
    for kind, where in strangers.items():
        assert where in text, (kind, text)
    assert "UNIMPLEMENTED" in text and "HTTP/1" in text and "HTTP 404" in text and "HTTP 403" in text, text


def test_a_feeder_answering_for_another_of_the_ranks_regions_is_passed_over(dataset, stream):
    """targets {"us-east": A, "eu-west": B} where A is in fact eu-west's feeder (a DNS name
    pointing at the wrong region): A is marked and the rank is served by B, exactly. A name that
    is none of the feeders' regions stays a label (tests name targets "a", "b")."""
    cfg = dict(source=str(dataset), listen="127.0.0.1:0", region="eu-west")
    with ServerThread(ServeConfig(**cfg)) as wrong, ServerThread(ServeConfig(**cfg)) as right:
        ds = rank({"us-east": wrong.address, "eu-west": right.address})
        got = list(ds)
        check_batches(got, stream, SEQ, expected_ids(stream, 1, 2, SEQ, SEED))
        assert list(ds.client.policy.refused) == [wrong.address]
        assert "answers for region 'eu-west', not 'us-east'" in str(ds.client.policy.refused[wrong.address])
        labels = rank({"a": wrong.address, "b": right.address})   # labels, not regions: both fine
        assert [i for b in labels for i in b.sample_ids.tolist()] == expected_ids(stream, 1, 2, SEQ, SEED)
        assert not labels.client.policy.refused


def test_what_marks_a_target_as_not_a_feeder():
    assert not_a_feeder("UNIMPLEMENTED", "feeder a:1: Method not found!").startswith("not a feeder")
    assert "HTTP 404" in not_a_feeder("UNIMPLEMENTED", "feeder a:1: Received http2 header with status: 404")
    assert "HTTP 403" in not_a_feeder("PERMISSION_DENIED", "feeder a:1: Received http2 header with status: 403")
    assert not_a_feeder("UNAVAILABLE", "feeder a:1: Received http2 header with status: 503") == ""   # a break
    assert "HTTP/1" in not_a_feeder("UNAVAILABLE", "failed to connect to all addresses; last error: UNAVAILABLE: "
                                    "ipv4:127.0.0.1:1: Failed parsing HTTP/2 (Expected SETTINGS frame as the first "
                                    "frame, got frame type 79)")
    for name in ("UNAVAILABLE", "PERMISSION_DENIED", "NOT_FOUND", "FAILED_PRECONDITION"):
        assert not_a_feeder(name, "feeder a:1: job 'x' ...") == ""   # a feeder's own answers
    assert other_region("us-east", "eu-west", ("us-east", "eu-west"))
    assert not other_region("a", "local", ("a", "b")) and not other_region("us-east", "us-east", ("us-east",))
    assert not other_region("", "eu-west", ())


def test_a_tls_server_of_another_deployment_is_passed_over_to_the_feeder(dataset, stream, tmp_path):
    """Targets [a TLS server whose certificate another CA signed, the feeder]: the handshake
    fails, the rank moves on at once and is served exactly; with only that server, the error names
    it and the handshake."""
    from feeder.ops import certs

    certs.make_ca(str(tmp_path / "ca"))
    certs.issue(str(tmp_path / "ca"), str(tmp_path), "feeder", ["localhost", "127.0.0.1"])
    certs.make_ca(str(tmp_path / "other-ca"))
    certs.issue(str(tmp_path / "other-ca"), str(tmp_path / "other"), "other", ["localhost", "127.0.0.1"])
    from grpc_health.v1 import health, health_pb2_grpc

    other = grpc.server(futures.ThreadPoolExecutor(2))
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), other)
    creds = grpc.ssl_server_credentials([((tmp_path / "other" / "other.key").read_bytes(),
                                          (tmp_path / "other" / "other.crt").read_bytes())])
    stranger = f"127.0.0.1:{other.add_secure_port('127.0.0.1:0', creds)}"
    other.start()
    try:
        with ServerThread(ServeConfig(source=str(dataset), listen="127.0.0.1:0", tls_cert=str(tmp_path / "feeder.crt"),
                                      tls_key=str(tmp_path / "feeder.key"))) as srv:
            tls = dict(tls_ca=str(tmp_path / "ca" / "ca.crt"))
            t0 = time.monotonic()
            ds = rank([stranger, srv.address], **tls)
            check_batches(list(ds), stream, SEQ, expected_ids(stream, 1, 2, SEQ, SEED))
            assert time.monotonic() - t0 < 15 and ds.client.failovers >= 1
        alone = FeederDataset([stranger], job="t-alone", rank=0, world_size=1, seq_len=SEQ, micro_batch=MB,
                              connect_timeout_s=2, retry_for_s=5, **tls)
        with pytest.raises(FeederError) as e:
            next(iter(alone))
        alone.client.close()
        assert stranger in str(e.value) and "\n" not in str(e.value), str(e.value)
    finally:
        other.stop(0)

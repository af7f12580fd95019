"""Security: TLS, mutual TLS and per-job bearer tokens on real `feeder serve` processes, with
certificates and tokens rotated under a running feeder; plain text only where allowed."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

import grpc
import pytest

from feeder_client import FeederDataset
from feeder_client.stream import ClientConfig, FeederClient, feeder_info
from feeder.ops import certs
from feeder.core.config import StreamSpec
from feeder.core.errors import Code, FeederError
from feeder.service.security import ClientSecurity, token_hash
from feeder.v1 import feeder_pb2 as pb
from feeder.v1 import feeder_pb2_grpc as pb_grpc
from tests.helpers import FeederProc, check_batches, expected_ids, free_port
from tests.helpers import refused as refused_at_start

pytestmark = pytest.mark.security
SEQ, MB, SEED = 16, 4, 5


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    d = tmp_path_factory.mktemp("pki")
    certs.make_ca(str(d / "ca"))
    certs.issue(str(d / "ca"), str(d), "feeder", ["localhost", "127.0.0.1"])
    certs.issue(str(d / "ca"), str(d), "rank")
    certs.make_ca(str(d / "rogue-ca"))
    certs.issue(str(d / "rogue-ca"), str(d), "rogue")
    return d


def write_tokens(path, entries):
    text = "".join(f'[[token]]\nname = "{n}"\njobs = {jobs!r}\nsha256 = "{token_hash(t)}"\n\n'.replace("'", '"')
                   for n, t, jobs in entries)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)  # how an operator (or a Secret volume) swaps it: never half a file


@pytest.fixture
def secure_feeder(dataset, pki, tmp_path):
    tokens = tmp_path / "tokens.toml"
    write_tokens(tokens, [("team-a", "tok-a", ["A"]), ("admin", "tok-admin", ["*"])])
    for ext in ("crt", "key"):  # this feeder's own copy: a test may rotate it
        shutil.copy(pki / f"feeder.{ext}", tmp_path / f"feeder.{ext}")
    f = FeederProc(dataset, extra=["--tls-cert", str(tmp_path / "feeder.crt"), "--tls-key", str(tmp_path / "feeder.key"),
                                   "--tls-client-ca", str(pki / "ca" / "ca.crt"), "--tokens-file", str(tokens),
                                   "--metrics-port", "0"])
    f.tokens, f.dir = tokens, tmp_path
    yield f
    f.stop()


def sec(pki, token="tok-a", cert="rank", ca=None):
    return ClientSecurity(ca=str(ca or pki / "ca" / "ca.crt"), cert=str(pki / f"{cert}.crt") if cert else "",
                          key=str(pki / f"{cert}.key") if cert else "", token=token)


def stream_call(address, security, job="A", timeout=10):
    """The first reply of a raw Stream call (no client retries in the way)."""
    with security.channel(address) as ch:
        call = pb_grpc.FeederStub(ch).Stream(
            pb.StreamRequest(job=job, rank=0, world_size=1, seq_len=SEQ, micro_batch=MB, num_epochs=1),
            metadata=security.metadata(), timeout=timeout)
        return next(call)


def refused(address, security, job="A"):
    with pytest.raises(grpc.RpcError) as e:
        stream_call(address, security, job)
    return e.value


def test_mtls_and_job_tokens_admit_only_what_they_name(secure_feeder, pki, stream, tmp_path):
    addr = secure_feeder.address
    # The right certificate and token: the exact DistributedSampler stream, over TLS.
    ds = FeederDataset([addr], job="A", rank=1, world_size=2, seq_len=SEQ, micro_batch=MB, seed=SEED,
                       tls_ca=str(pki / "ca" / "ca.crt"), tls_cert=str(pki / "rank.crt"),
                       tls_key=str(pki / "rank.key"), token="tok-a")
    check_batches(list(ds), stream, SEQ, expected_ids(stream, 1, 2, SEQ, SEED))

    # No client certificate, or one from another CA: refused in the TLS handshake (before
    # any RPC exists, so gRPC reports UNAVAILABLE), nothing served.
    for bad in (sec(pki, cert=""), sec(pki, cert="rogue")):
        e = refused(addr, bad)
        assert e.code() == grpc.StatusCode.UNAVAILABLE
    # A certificate but no token, or a wrong one: UNAUTHENTICATED, saying what is missing.
    e = refused(addr, sec(pki, token=""))
    assert e.code() == grpc.StatusCode.UNAUTHENTICATED and "needs a bearer token" in e.details()
    e = refused(addr, sec(pki, token="tok-guess"))
    assert e.code() == grpc.StatusCode.UNAUTHENTICATED and "not valid" in e.details()
    # Job A's token cannot read job B, report for it, or list every job.
    e = refused(addr, sec(pki), job="B")
    assert e.code() == grpc.StatusCode.PERMISSION_DENIED and "'B'" in e.details() and "team-a" in e.details()
    with sec(pki).channel(addr) as ch:
        stub = pb_grpc.FeederStub(ch)
        with pytest.raises(grpc.RpcError) as e2:
            stub.Report(pb.ReportRequest(job="B", rank=0), metadata=sec(pki).metadata(), timeout=5)
        assert e2.value.code() == grpc.StatusCode.PERMISSION_DENIED
        with pytest.raises(grpc.RpcError) as e2:
            stub.Status(pb.StatusRequest(), metadata=sec(pki).metadata(), timeout=5)
        assert e2.value.code() == grpc.StatusCode.PERMISSION_DENIED
        # nor change job B's mixture schedule (feeder mix is job-scoped: issue 46)
        with pytest.raises(grpc.RpcError) as e2:
            stub.Mix(pb.MixRequest(job="B", phase=1), metadata=sec(pki).metadata(), timeout=5)
        assert e2.value.code() == grpc.StatusCode.PERMISSION_DENIED and "'B'" in e2.value.details()
        assert not stub.Mix(pb.MixRequest(job="A", phase=1), metadata=sec(pki).metadata(), timeout=5).known
        assert [j.job for j in stub.Status(pb.StatusRequest(job="A"), metadata=sec(pki).metadata(),
                                           timeout=5).jobs] == ["A"]
        # The admin token ("*") sees every job.
        assert stub.Status(pb.StatusRequest(), metadata=sec(pki, token="tok-admin").metadata(), timeout=5).jobs
    # The trainer's client raises a refusal at once (retrying elsewhere cannot fix a token).
    t0 = time.monotonic()
    client = FeederClient(ClientConfig(targets=(addr,), spec=StreamSpec(job="B", rank=0, world_size=1, seq_len=SEQ,
                                                                         micro_batch=MB), security=sec(pki)))
    with pytest.raises(FeederError) as fe:
        next(client)
    client.close()
    assert fe.value.code == Code.PERMISSION_DENIED and time.monotonic() - t0 < 10
    # Health stays open for probes (no token); the probe the manifests run reads the region
    # file and authenticates with the feeder's own certificate.
    region = tmp_path / "region.toml"
    region.write_text(f'region = "r"\nlisten = "{addr}"\nsource = "unused"\n[tls]\ncert = "{pki}/feeder.crt"\n'
                      f'key = "{pki}/feeder.key"\nca = "{pki}/ca/ca.crt"\nclient_ca = "{pki}/ca/ca.crt"\n')
    r = subprocess.run([sys.executable, "-m", "feeder.cli", "health", "--config", str(region)], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == f"{addr}: SERVING", r
    r = subprocess.run([sys.executable, "-m", "feeder.cli", "health", "--target", addr, "--ca",
                        str(pki / "ca" / "ca.crt")], capture_output=True, text=True, timeout=60)  # no client cert
    assert r.returncode == 1 and "client certificate" in r.stderr and "Traceback" not in r.stderr


def test_plain_text_to_a_tls_port_fails_cleanly(secure_feeder, pki):
    addr = secure_feeder.address
    e = refused(addr, ClientSecurity(token="tok-a"))
    assert e.code() == grpc.StatusCode.UNAVAILABLE
    r = subprocess.run([sys.executable, "-m", "feeder.cli", "status", "--target", addr], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.count("\n") == 1 and "does this feeder use TLS" in r.stderr, r.stderr
    # ... and the feeder is unharmed: TLS clients are still served.
    assert stream_call(addr, sec(pki)).batches


def test_tokens_and_certificates_rotate_without_restart(secure_feeder, pki, tmp_path):
    addr = secure_feeder.address
    assert stream_call(addr, sec(pki)).batches
    # Revoke A's token, grant job B to a new one: effective within seconds, no restart.
    write_tokens(secure_feeder.tokens, [("team-b", "tok-b", ["B"])])
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            stream_call(addr, sec(pki, token="tok-b"), job="B")
            break
        except grpc.RpcError:
            time.sleep(0.3)
    else:
        pytest.fail("the new token was not accepted within 10 s")
    assert refused(addr, sec(pki)).code() == grpc.StatusCode.UNAUTHENTICATED
    # A broken edit keeps the last good set rather than locking everyone out.
    secure_feeder.tokens.write_text("[[token]\nbroken")
    time.sleep(1.5)
    assert stream_call(addr, sec(pki, token="tok-b"), job="B").batches

    # Rotate the server certificate to one from a new CA: new connections see the new one.
    certs.make_ca(str(tmp_path / "ca2"))
    crt, key = certs.issue(str(tmp_path / "ca2"), str(tmp_path), "feeder2", ["localhost", "127.0.0.1"])
    for src, dst in ((key, secure_feeder.dir / "feeder.key"), (crt, secure_feeder.dir / "feeder.crt")):
        os.replace(src, dst)
    new = sec(pki, token="tok-b", ca=tmp_path / "ca2" / "ca.crt")
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            assert stream_call(addr, new, job="B").batches
            break
        except grpc.RpcError:
            time.sleep(0.5)
    else:
        pytest.fail("the rotated certificate was not served within 10 s")
    assert refused(addr, sec(pki, token="tok-b"), job="B").code() == grpc.StatusCode.UNAVAILABLE  # old CA
    assert secure_feeder.proc.poll() is None


def test_fingerprint_mismatch_is_refused_and_the_client_moves_to_a_matching_region(dataset, tmp_path, docs, stream):
    from feeder.sources import manifest as mf
    from tests.helpers import prep_docs

    other = prep_docs(tmp_path, docs[:-3])  # a stale replica: three documents short
    good_fp, stale_fp = mf.read(dataset).fingerprint, mf.read(other).fingerprint
    stale, good = FeederProc(other, extra=["--region", "stale"]), FeederProc(dataset, extra=["--region", "good"])
    try:
        kw = dict(job="fp", rank=0, world_size=2, seq_len=SEQ, micro_batch=MB, seed=SEED,
                  expected_fingerprint=good_fp)
        with pytest.raises(FeederError) as e:
            list(FeederDataset([stale.address], **kw))
        assert e.value.code == Code.FAILED_PRECONDITION
        assert good_fp in str(e.value) and stale_fp in str(e.value)
        # Given both regions, stale one first: it refuses, the rank is fed by the matching one.
        ds = FeederDataset({"stale": stale.address, "good": good.address}, prefer="order", **kw)
        got = list(ds)
        check_batches(got, stream, SEQ, expected_ids(stream, 0, 2, SEQ, SEED))
        assert ds.region == "good" and {b.region for b in got} == {"good"}
        assert feeder_info([good.address]).fingerprint == good_fp
    finally:
        stale.stop()
        good.stop()


def test_plain_text_beyond_loopback_needs_insecure(dataset, tmp_path):
    port = free_port()
    secret = tmp_path / "cursor-secret"
    secret.write_text("s3cret-of-this-deployment\n")
    cmd = [sys.executable, "-m", "feeder.cli", "serve", "--source", str(dataset), "--listen", f"0.0.0.0:{port}",
           "--cursor-secret-file", str(secret)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    refused_at_start(r, "beyond loopback", "--insecure", "--tls-cert")
    f = FeederProc(dataset, port=port, extra=["--insecure", "--cursor-secret-file", str(secret)], host="0.0.0.0")
    try:
        info = feeder_info([f"127.0.0.1:{port}"])
        assert info.fingerprint
    finally:
        f.stop()
    # Loopback stays plain by default (the local-development contract).
    f = FeederProc(dataset)
    f.stop()


def test_beyond_loopback_a_feeder_refuses_to_start_without_a_cursor_secret(dataset, monkeypatch):
    # Issue 28: the development key is in the source, so a feeder reachable from elsewhere
    # with it would accept forged cursors. Refused like plain text without --insecure.
    monkeypatch.delenv("FEEDER_CURSOR_SECRET", raising=False)
    cmd = [sys.executable, "-m", "feeder.cli", "serve", "--source", str(dataset), "--listen",
           f"0.0.0.0:{free_port()}", "--insecure"]
    refused_at_start(subprocess.run(cmd, capture_output=True, text=True, timeout=60), "--cursor-secret-file",
                     "beyond loopback")
    # Given, it starts (the previous test starts one with --cursor-secret-file); loopback keeps
    # the development key for local use.
    from feeder.core.config import ServeConfig

    assert ServeConfig(source=str(dataset), listen="0.0.0.0:1", insecure=True, cursor_secret=b"k").cursor_secret
    assert not ServeConfig(source=str(dataset), listen="127.0.0.1:1").cursor_secret


def test_metrics_port_speaks_https_with_the_feeders_certificate(secure_feeder, pki):
    import ssl
    import urllib.request

    url = f"https://{secure_feeder.metrics}/metrics"
    ctx = ssl.create_default_context(cafile=str(pki / "ca" / "ca.crt"))
    ctx.load_cert_chain(str(pki / "rank.crt"), str(pki / "rank.key"))  # mutual TLS here too
    with urllib.request.urlopen(url, context=ctx, timeout=10) as r:
        assert b"feeder_info" in r.read()
    bare = ssl.create_default_context(cafile=str(pki / "ca" / "ca.crt"))  # no client certificate
    with pytest.raises(OSError):
        urllib.request.urlopen(url, context=bare, timeout=10).read()
    with pytest.raises(OSError):  # plain HTTP to the HTTPS port
        urllib.request.urlopen(f"http://{secure_feeder.metrics}/metrics", timeout=10).read()


def test_metrics_port_serves_a_rotated_certificate_without_restart(secure_feeder, pki, tmp_path):
    """cert-manager or certbot replace the files; scrapes must not start failing when the old
    certificate expires weeks later, so the metrics port re-reads them as the gRPC port does."""
    import socket
    import ssl
    import urllib.request

    url = f"https://{secure_feeder.metrics}/metrics"

    def scrape(ca):
        ctx = ssl.create_default_context(cafile=str(ca))
        ctx.load_cert_chain(str(pki / "rank.crt"), str(pki / "rank.key"))
        with urllib.request.urlopen(url, context=ctx, timeout=10) as r:
            return r.read()

    assert b"feeder_info" in scrape(pki / "ca" / "ca.crt")
    # A peer that connects and never says a word does not hold up the next scrape.
    with socket.create_connection(tuple(secure_feeder.metrics.rsplit(":", 1))):
        t0 = time.monotonic()
        assert b"feeder_info" in scrape(pki / "ca" / "ca.crt")
        assert time.monotonic() - t0 < 5
    certs.make_ca(str(tmp_path / "ca2"))
    crt, key = certs.issue(str(tmp_path / "ca2"), str(tmp_path), "feeder2", ["localhost", "127.0.0.1"])
    for src, dst in ((key, secure_feeder.dir / "feeder.key"), (crt, secure_feeder.dir / "feeder.crt")):
        os.replace(src, dst)
    deadline = time.monotonic() + 10
    while True:
        try:
            assert b"feeder_info" in scrape(tmp_path / "ca2" / "ca.crt")
            break
        except OSError:
            if time.monotonic() > deadline:
                pytest.fail("the metrics port did not serve the rotated certificate within 10 s")
            time.sleep(0.3)
    with pytest.raises(OSError):   # the old certificate is gone
        scrape(pki / "ca" / "ca.crt")
    assert secure_feeder.proc.poll() is None


def test_a_replaced_stream_ends_its_client_instead_of_moving_to_another_region(dataset):
    """A newer stream of the same (job, rank) ends the older one with FAILED_PRECONDITION: that
    refusal is about the request, not the replica, so the old client stops (it must not go on
    to the next region and fight the new one)."""
    from feeder.core.errors import NotFound
    from feeder.ops.status import fetch

    f1, f2 = FeederProc(dataset), FeederProc(dataset)
    spec = StreamSpec(job="zombie", rank=0, world_size=1, seq_len=SEQ, micro_batch=MB, num_epochs=0)
    old = FeederClient(ClientConfig(targets=(f1.address, f2.address), spec=spec, prefer="order", read_ahead=1))
    new = None
    try:
        next(old)
        new = FeederClient(ClientConfig(targets=(f1.address,), spec=spec))
        next(new)
        with pytest.raises(FeederError) as e:
            for _ in range(100_000):
                next(old)
        assert e.value.code == Code.FAILED_PRECONDITION and "replaced by a newer stream" in str(e.value)
        assert old.failovers == 0
        with pytest.raises(NotFound):
            fetch(f2.address, "zombie")  # the old client never opened a stream in the other region
        next(new)  # the new stream is unharmed
    finally:
        old.close()
        if new:
            new.close()
        f1.stop()
        f2.stop()

"""What a Status answer tells a token scoped to some jobs (issue 44.6): its jobs' streams, never
the process's figures that every team's streams make (streams_open counting team B's ranks,
memory, tasks, threads, the scrub's and the cache's counts). And under `serve --processes 2` a
Status for a job right after its stream ran shows the job (it answered NOT_FOUND "known: none"
1 time in 3: the other process's status was still to be written). A real `feeder serve
--processes 2` with a tokens file."""
from __future__ import annotations

import time

import grpc
import pytest

from feeder.service.security import token_hash
from feeder.v1 import feeder_pb2 as pb
from feeder.v1 import feeder_pb2_grpc as pb_grpc
from tests.helpers import FeederProc

pytestmark = pytest.mark.security
SEQ, MB = 16, 4


@pytest.fixture(scope="module")
def scoped_feeder(dataset, tmp_path_factory):
    d = tmp_path_factory.mktemp("scope")
    tokens = d / "tokens.toml"
    tokens.write_text("".join(f'[[token]]\nname = "{name}"\njobs = {jobs}\nsha256 = "{token_hash(tok)}"\n\n'
                              for name, jobs, tok in (("team-a", '["A"]', "tok-a"), ("team-b", '["B"]', "tok-b"),
                                                      ("admin", '["*"]', "tok-admin"))))
    feeder = FeederProc(dataset, extra=["--tokens-file", str(tokens), "--processes", "2"])
    yield feeder
    feeder.stop()


def auth(token: str):
    return (("authorization", f"Bearer {token}"),)


def status(address: str, token: str, job: str = "") -> pb.StatusReply:
    with grpc.insecure_channel(address) as ch:   # a new connection: the kernel picks a process
        return pb_grpc.FeederStub(ch).Status(pb.StatusRequest(job=job), metadata=auth(token), timeout=10)


def hold(address: str, token: str, job: str, rank: int, world: int):
    """A stream opened and read up to its first reply, then held (its own connection)."""
    ch = grpc.insecure_channel(address)
    call = pb_grpc.FeederStub(ch).Stream(pb.StreamRequest(job=job, rank=rank, world_size=world, seq_len=SEQ,
                                                          micro_batch=MB, num_epochs=0), metadata=auth(token))
    next(call)
    return ch, call


def eventually(check, timeout=10):
    deadline = time.monotonic() + timeout
    while True:
        try:
            return check()
        except AssertionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def test_a_token_of_one_job_sees_its_streams_and_no_process_wide_figure(scoped_feeder):
    addr = scoped_feeder.address
    held = [hold(addr, "tok-a", "A", r, 2) for r in range(2)]
    try:
        def a_sees_its_two():
            r = status(addr, "tok-a", "A")
            assert [j.job for j in r.jobs] == ["A"] and r.jobs[0].streams_open == 2 and r.streams_open == 2, r
            return r

        eventually(a_sees_its_two)
        held += [hold(addr, "tok-b", "B", r, 4) for r in range(4)]

        def admin_sees_six():
            r = status(addr, "tok-admin")
            assert r.streams_open == 6 and {j.job: j.streams_open for j in r.jobs} == {"A": 2, "B": 4}, r
            assert r.rss_mb > 0 and r.tasks > 0 and r.threads > 0 and r.processes == 2
            return r

        eventually(admin_sees_six)
        for token, job, n in (("tok-a", "A", 2), ("tok-b", "B", 4)):
            r = status(addr, token, job)
            # team B's 4 streams are not in A's answer, nor is anything that every team's streams make
            assert r.streams_open == n and [j.job for j in r.jobs] == [job] and r.jobs[0].streams_open == n, r
            assert (r.rss_mb, r.tasks, r.threads, r.chunks_changed, r.scrubbed_bytes, r.cache_damaged) == \
                (0, 0, 0, 0, 0, 0), r
            assert not r.building and not r.preparing and not r.cache_problems
            assert r.processes == 2 and r.region == "local"
    finally:
        for ch, call in held:
            call.cancel()
            ch.close()


def test_status_right_after_a_stream_ran_shows_its_job_whichever_process_answers(scoped_feeder):
    addr = scoped_feeder.address
    for i in range(12):   # (1 in 3 answered NOT_FOUND before)
        job = f"A{i}"
        with grpc.insecure_channel(addr) as ch:
            replies = list(pb_grpc.FeederStub(ch).Stream(
                pb.StreamRequest(job=job, rank=0, world_size=8, seq_len=SEQ, micro_batch=MB, num_epochs=1),
                metadata=auth("tok-admin"), timeout=30))
        assert replies
        r = status(addr, "tok-admin", job)   # a new connection: either process
        assert [j.job for j in r.jobs] == [job] and r.jobs[0].ranks[0].batches_sent > 0, r
    # A job nobody ran is still NOT_FOUND, once the other process's status is newer than the ask.
    t0 = time.monotonic()
    with pytest.raises(grpc.RpcError) as e:
        status(addr, "tok-admin", "never-ran")
    assert e.value.code() == grpc.StatusCode.NOT_FOUND and time.monotonic() - t0 < 3

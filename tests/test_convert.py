"""feeder.service.convert and the policy it leaves to the Engine, without a server: a request
and its StreamSpec convert both ways, the compression a rank gets, status as protobuf."""
from __future__ import annotations

import asyncio
import dataclasses
from types import SimpleNamespace

import pytest

from feeder.core.config import ServeConfig, StreamSpec
from feeder.domain.engine import Engine
from feeder.core.errors import Code, FeederError
from feeder.domain.process_status import JobStatus, MemberStatus, ProcessStatus, RankStatus
from feeder.service import convert
from feeder.v1 import feeder_pb2 as pb


@pytest.fixture
def engine():
    e = Engine(ServeConfig(source="unused", default_compression="none", default_level=5, remote_rtt_ms=5.0),
               {"data": SimpleNamespace(close=lambda: None)}, serialize=bytes)
    yield e
    e.close()


SPEC = StreamSpec(job="j", rank=2, world_size=4, seq_len=16, micro_batch=3, seed=7, shuffle=False, drop_last=True,
                  epoch=1, num_epochs=2, compression="zstd", compression_level=9, worker_index=1, num_workers=3,
                  worker_phase=2, reshard=True, expected_fingerprint="f" * 8, dataset="d", bad_records="skip",
                  client_started_ns=2**63 + 5, continued=True)


def test_a_spec_survives_the_request_both_ways(engine):
    req = convert.stream_request(SPEC, b"cur", failover=True, rtt_s=0.0123)
    assert req.cursor == b"cur" and req.failover and req.rtt_us == 12300
    assert convert.spec_from_request(req, engine) == SPEC
    # what the client overrides: the round-robin phase after its own batch, reshard only at the start
    req = convert.stream_request(SPEC, worker_phase=0, reshard=False, rtt_s=float("inf"), client_started_ns=4,
                                 continued=False)
    assert (req.worker_phase, req.reshard, req.rtt_us, req.cursor, req.client_started_ns, req.continued) == \
        (0, False, 0, b"", 4, False)


@pytest.mark.parametrize("asked,rtt_ms,want", [
    ("", 0, ("none", 5)),         # left to the feeder, rtt unknown: its default
    ("", 4.9, ("none", 5)),       # near
    ("", 5.0, ("zstd", 5)),       # remote: zstd whatever the default
    ("none", 50, ("none", 5)),    # asked for: granted, even remote
    ("zstd", 0, ("zstd", 5)),
])
def test_the_engine_picks_compression_where_the_rank_leaves_it_open(engine, asked, rtt_ms, want):
    spec = dataclasses.replace(SPEC, compression=asked, compression_level=0)
    got = convert.spec_from_request(convert.stream_request(spec, rtt_s=rtt_ms / 1e3), engine)
    assert (got.compression, got.compression_level) == want


def test_an_unknown_compression_enum_is_invalid_argument(engine):
    req = convert.stream_request(SPEC)
    req.compression = 7
    with pytest.raises(FeederError) as e:
        convert.spec_from_request(req, engine)
    assert e.value.code == Code.INVALID_ARGUMENT and "enum value 7" in str(e.value)


def test_every_domain_code_has_a_status_and_back():
    assert set(convert.STATUS) == set(Code)
    assert all(convert.CODES[s] == c for c, s in convert.STATUS.items())
    assert convert.SERVICE == "feeder.v1.Feeder"


def test_status_converts_every_field(engine):
    rank = RankStatus(rank=1, connected=True, epoch=2, samples_done=3, samples_in_epoch=4, batches_sent=5,
                      bytes_sent=6, tokens_per_s=7.5, queue_depth=8, data_wait_fraction=0.25, last_error="e",
                      peer="p", restarts=9, failovers=10, tokens_sent=11, bad_records=12, region="r",
                      state="streaming", window_builds=13, member_shared=14, member_solo=15,
                      members=(MemberStatus(member=1, cp_rank=2, epoch=3, step=4, shared=True, behind=5),
                               MemberStatus(member=0, cp_rank=0, epoch=3, step=9, shared=False, behind=0)))
    st = ProcessStatus(region="r", uptime_s=1.5, streams_open=1, rss_mb=2.5, tasks=3, threads=4, processes=1,
                       jobs=(JobStatus(job="j", dataset="d", world_size=2, ranks=(rank,)),))
    reply = convert.status_reply(st)
    assert reply.region == "r" and reply.uptime_s == 1.5 and reply.tasks == 3 and reply.jobs[0].world_size == 2
    got = reply.jobs[0].ranks[0]
    want = dataclasses.asdict(rank)
    members = want.pop("members")
    assert {f.name: getattr(got, f.name) for f in dataclasses.fields(rank) if f.name != "members"} == want
    assert [{f.name: getattr(m, f.name) for f in dataclasses.fields(MemberStatus)} for m in got.members] == \
        [dict(m) for m in members]


def test_the_engine_status_of_an_unknown_job_is_not_found(engine):
    async def on_the_loop():   # as in the servicer: it counts the loop's tasks
        assert engine.status().jobs == ()
        with pytest.raises(FeederError) as e:
            engine.status("nope")
        assert e.value.code == Code.NOT_FOUND
    asyncio.run(on_the_loop())


def test_malformed_bytes_become_invalid_argument_not_an_exception():
    got = convert.parser(pb.StreamRequest)(b"\xff\xff\xff")
    assert isinstance(got, FeederError) and got.code == Code.INVALID_ARGUMENT
    assert convert.parser(pb.StatusRequest)(pb.StatusRequest(job="x").SerializeToString()).job == "x"

"""Issue 34: every answer is scoped to its caller's token. Two teams share a feeder: team A's
token (job `a-run`, dataset `a-data`) must never read team B's job names (`b-secret-run`), its
dataset or its packing's figures, in any RPC's reply or error; the admin token (`*`) sees all."""
from __future__ import annotations

import grpc
import pytest

from feeder.core.config import ServeConfig
from feeder.service.security import ClientSecurity, token_hash
from feeder.service.server import ServerThread
from feeder.v1 import feeder_pb2 as pb
from feeder.v1 import feeder_pb2_grpc as pb_grpc
from feeder_client import FeederDataset
from tests.helpers import make_docs, prep_docs

SEQ, MB = 16, 4
SECRET = ("b-secret-run", "b-data")   # what team A must never read


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    root = tmp_path_factory.mktemp("scope")
    (root / "a").mkdir()
    (root / "b").mkdir()
    a = prep_docs(root / "a", make_docs(60, seed=1))
    b = prep_docs(root / "b", make_docs(60, seed=2))
    tokens = root / "tokens.toml"
    tokens.write_text("".join(
        f'[[token]]\nname = "{name}"\njobs = {jobs}\n{datasets}sha256 = "{token_hash(tok)}"\n\n'
        for name, tok, jobs, datasets in (("team-a", "tok-a", '["a-run"]', 'datasets = ["a-data"]\n'),
                                          ("team-b", "tok-b", '["b-secret-run"]', 'datasets = ["b-data"]\n'),
                                          ("admin", "tok-admin", '["*"]', ""))))
    srv = ServerThread(ServeConfig(sources=(("a-data", str(a)), ("b-data", str(b))), listen="127.0.0.1:0",
                                   tokens_file=str(tokens), cache_dir=str(root / "cache")))
    # Team B runs, packed (its packing's figures are in the process-wide part of Status).
    ds = FeederDataset([srv.address], job="b-secret-run", dataset="b-data", rank=0, world_size=1, seq_len=SEQ,
                       micro_batch=MB, packing="best_fit", token="tok-b", num_epochs=1)
    assert list(ds)
    yield srv
    srv.stop()


def call(srv, method: str, request, token: str = "tok-a"):
    sec = ClientSecurity(token=token)
    with sec.channel(srv.address) as ch:
        fn = getattr(pb_grpc.FeederStub(ch), method)
        if method == "Stream":
            return next(fn(request, metadata=sec.metadata(), timeout=10))
        return fn(request, metadata=sec.metadata(), timeout=10)


def refusal(srv, method: str, request, token: str = "tok-a") -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as e:
        call(srv, method, request, token)
    return e.value


def never_named(text: str) -> None:
    for secret in SECRET:
        assert secret not in text, text


def test_status_of_a_job_not_yet_streaming_names_no_other_job(shared):
    e = refusal(shared, "Status", pb.StatusRequest(job="a-run"))
    assert e.code() == grpc.StatusCode.NOT_FOUND and "'a-run' is not known" in e.details()
    never_named(e.details())
    e = refusal(shared, "Status", pb.StatusRequest(job="nope"), token="tok-admin")   # the admin is told all
    assert "b-secret-run" in e.details()


def test_report_of_a_job_not_yet_streaming_names_no_other_job(shared):
    e = refusal(shared, "Report", pb.ReportRequest(job="a-run", rank=0))
    assert e.code() == grpc.StatusCode.NOT_FOUND
    never_named(e.details())


def test_info_names_only_the_datasets_the_token_may_read(shared):
    reply = call(shared, "Info", pb.InfoRequest(dataset="a-data"))
    assert list(reply.datasets) == ["a-data"]
    assert sorted(call(shared, "Info", pb.InfoRequest(dataset="a-data"), token="tok-admin").datasets) == \
        ["a-data", "b-data"]
    e = refusal(shared, "Info", pb.InfoRequest(dataset="b-data"))
    assert e.code() == grpc.StatusCode.PERMISSION_DENIED
    never_named(e.details().replace("Info dataset 'b-data';", ""))   # (what it asked for is said back, no more)


def test_stream_refusals_name_no_other_team(shared):
    for request in (pb.StreamRequest(job="a-run", dataset="b-data", rank=0, world_size=1, seq_len=SEQ, micro_batch=MB),
                    pb.StreamRequest(job="b-secret-run", dataset="a-data", rank=0, world_size=1, seq_len=SEQ,
                                     micro_batch=MB)):
        e = refusal(shared, "Stream", request)
        assert e.code() == grpc.StatusCode.PERMISSION_DENIED
        never_named(e.details().replace("'b-secret-run'; it grants", "").replace("'b-data'; it grants", ""))   # (as asked)


def test_status_of_a_running_job_shows_only_its_teams_jobs_and_packings(shared):
    ds = FeederDataset([shared.address], job="a-run", dataset="a-data", rank=0, world_size=1, seq_len=SEQ,
                       micro_batch=MB, packing="best_fit", token="tok-a", num_epochs=1)
    assert list(ds)
    reply = call(shared, "Status", pb.StatusRequest(job="a-run"))
    assert [j.job for j in reply.jobs] == ["a-run"]
    assert reply.packings and all(p.startswith("a-data seq_len") for p in reply.packings), list(reply.packings)
    assert not reply.building and not reply.preparing
    never_named(str(reply))
    admin = call(shared, "Status", pb.StatusRequest(), token="tok-admin")
    assert {"a-run", "b-secret-run"} <= {j.job for j in admin.jobs}
    assert any(p.startswith("b-data seq_len") for p in admin.packings)

"""Who may reach what (issue 28): /metrics on loopback unless told otherwise and, with a tokens
file, only for a token with the metrics scope; tokens that scope datasets as well as jobs.
A real feeder (gRPC and HTTP over sockets) in this process."""
from __future__ import annotations

import urllib.error
import urllib.request

import pytest

from feeder.cli import build_parser
from feeder.ops.cli_serve import serve_config
from feeder.core.config import ServeConfig
from feeder.core.errors import Code, FeederError
from feeder.service.security import TokenStore, token_hash
from feeder.service.server import ServerThread
from feeder_client import FeederDataset
from feeder_client.stream import feeder_info
from feeder.service.security import ClientSecurity

pytestmark = pytest.mark.security
SEQ, MB = 16, 4


@pytest.fixture(scope="module")
def guarded(dataset, tmp_path_factory):
    """A feeder serving the dataset under two names, `web` and `code`, with a tokens file:
    team-a may run job A on `web` only; ops may scrape metrics only; admin may do any job."""
    d = tmp_path_factory.mktemp("access")
    tokens = d / "tokens.toml"
    tokens.write_text(f'''
[[token]]
name = "team-a"
jobs = ["A"]
datasets = ["web"]
sha256 = "{token_hash('tok-a')}"

[[token]]
name = "ops"
metrics = true
sha256 = "{token_hash('tok-metrics')}"

[[token]]
name = "admin"
jobs = ["*"]
sha256 = "{token_hash('tok-admin')}"
''')
    srv = ServerThread(ServeConfig(sources=(("web", str(dataset)), ("code", str(dataset))), listen="127.0.0.1:0",
                                   tokens_file=str(tokens), metrics_listen="127.0.0.1:0", message_bytes=4096))
    yield srv
    srv.stop()


def scrape(address: str, token: str = "") -> tuple[int, bytes]:
    req = urllib.request.Request(f"http://{address}/metrics",
                                 headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def test_metrics_with_a_tokens_file_need_a_token_with_the_metrics_scope(guarded):
    # A job streams first, so there is something the metrics would give away.
    ds = FeederDataset([guarded.address], job="A", rank=0, world_size=2, seq_len=SEQ, micro_batch=MB,
                       dataset="web", token="tok-a", read_ahead=2)
    next(iter(ds))
    address = guarded.server.metrics_address
    code, body = scrape(address)
    assert code == 401 and b"metrics = true" in body and b'job="A"' not in body
    assert scrape(address, "no-such-token")[0] == 401
    code, body = scrape(address, "tok-a")            # a job's token is not a metrics token
    assert code == 403 and b"team-a" in body
    code, body = scrape(address, "tok-metrics")
    assert code == 200 and b'feeder_batches_sent_total{job="A",rank="0"}' in body


def test_a_token_reads_only_the_datasets_named_for_it(guarded):
    kw = dict(job="A", rank=0, world_size=2, seq_len=SEQ, micro_batch=MB, read_ahead=2, token="tok-a")
    batch = next(iter(FeederDataset([guarded.address], dataset="web", **kw)))
    assert len(batch.sample_ids) == MB
    # The default dataset is `web` too: leaving dataset out is the same request.
    assert next(iter(FeederDataset([guarded.address], **kw))).sample_ids.tolist() == batch.sample_ids.tolist()
    for other in (dict(dataset="code"), dict(mixture={"web": 0.5, "code": 0.5})):
        with pytest.raises(FeederError) as e:
            next(iter(FeederDataset([guarded.address], **other, **kw)))
        assert e.value.code == Code.PERMISSION_DENIED
        assert "'code'" in str(e.value) and "team-a" in str(e.value) and "['web']" in str(e.value)
    with pytest.raises(FeederError) as e:
        feeder_info([guarded.address], dataset="code", security=ClientSecurity(token="tok-a"))
    assert e.value.code == Code.PERMISSION_DENIED
    # A token without `datasets` reads every one; a metrics token streams nothing.
    admin = {**kw, "token": "tok-admin", "job": "B"}
    assert len(next(iter(FeederDataset([guarded.address], dataset="code", **admin))).sample_ids) == MB
    with pytest.raises(FeederError) as e:
        next(iter(FeederDataset([guarded.address], **{**kw, "token": "tok-metrics"})))
    assert e.value.code == Code.PERMISSION_DENIED


def test_tokens_file_entries_for_datasets_and_metrics_are_checked(tmp_path):
    path = tmp_path / "t.toml"
    for entry, words in (('jobs = ["A"]\ndatasets = []', "datasets must be a non-empty list"),
                         ('jobs = ["A"]\nmetrics = "yes"', "metrics must be true or false"),
                         ('name = "x"', "only a metrics = true token may leave it out")):
        path.write_text(f'[[token]]\n{entry}\ntoken = "t"\n')
        with pytest.raises(FeederError, match=words) as e:
            TokenStore(str(path))
        assert e.value.code == Code.INVALID_ARGUMENT


def test_metrics_listen_on_loopback_unless_told_otherwise(dataset, monkeypatch):
    monkeypatch.setenv("FEEDER_CURSOR_SECRET", "k")
    base = ["serve", "--source", str(dataset), "--listen", "0.0.0.0:7070", "--insecure", "--metrics-port", "9464"]
    assert serve_config(build_parser().parse_args(base)).metrics_listen == "127.0.0.1:9464"
    told = serve_config(build_parser().parse_args(base + ["--metrics-host", "0.0.0.0"]))
    assert told.metrics_listen == "0.0.0.0:9464"


def test_feeder_token_prints_an_entry_with_datasets_and_metrics(tmp_path, capsys):
    from feeder.cli import main

    assert main(["token", "--job", "A", "--dataset", "web", "--dataset", "code"]) == 0
    assert main(["token", "--metrics", "--name", "prometheus"]) == 0
    out = capsys.readouterr().out
    tokens = [line.split(": ", 1)[1] for line in out.splitlines() if line.startswith("token: ")]
    path = tmp_path / "tokens.toml"
    path.write_text("\n".join(line for line in out.splitlines() if not line.startswith(("token: ", "#"))))
    store = TokenStore(str(path))
    job, metrics = store.lookup(tokens[0]), store.lookup(tokens[1])
    assert (job.jobs, job.datasets, job.metrics) == ({"A"}, {"web", "code"}, False)
    assert (metrics.name, metrics.jobs, metrics.metrics) == ("prometheus", frozenset(), True)

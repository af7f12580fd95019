from __future__ import annotations

import os

import pytest

from feeder.core.config import ServeConfig
from feeder.service.server import ServerThread
from tests.helpers import byte_stream, make_docs, prep_docs

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def docs():
    return make_docs(400, seed=1)


@pytest.fixture(scope="session")
def stream(docs):
    return byte_stream(docs)


@pytest.fixture(scope="session")
def dataset(tmp_path_factory, docs):
    """Byte-tokenized dataset with many small chunks and shards, so samples cross both."""
    return prep_docs(tmp_path_factory.mktemp("ds"), docs, shard_tokens=3000, chunk_tokens=700)


@pytest.fixture(scope="session")
def feeder(dataset):
    srv = ServerThread(ServeConfig(source=str(dataset), listen="127.0.0.1:0", message_bytes=4096))
    yield srv
    srv.stop()


def _kafka_port() -> int:
    return int(os.environ.get("FEEDER_KAFKA_PORT", 9092))


def _started_mark():
    """Left while a broker the tests started runs: whichever process of the run (`pytest -n 2`
    has a worker per core) started it, the run's controller stops it at the end."""
    import tempfile
    from pathlib import Path

    return Path(tempfile.gettempdir()) / f"feeder-tests-started-kafka-{_kafka_port()}"


def _broker_script():
    from pathlib import Path

    return Path(__file__).resolve().parents[1] / "deploy" / "kafka" / "broker.py"


@pytest.fixture(scope="session")
def kafka_broker():
    """The real broker from `make kafka` (127.0.0.1:$FEEDER_KAFKA_PORT, default 9092); started
    here when the tests run without it (one worker starts it, the others wait on the lock), and
    stopped when the whole run ends (pytest_sessionfinish below)."""
    import fcntl
    import socket
    import subprocess
    import sys

    port = _kafka_port()
    with open(f"{_started_mark()}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
        except OSError:
            subprocess.run([sys.executable, str(_broker_script()), "start", "--port", str(port)], check=True)
            _started_mark().touch()
    yield f"127.0.0.1:{port}"


@pytest.fixture(autouse=True)
def _broker_held(request):
    """A test on the shared broker holds it shared for its whole length, and a test that restarts
    it (marked kafka_restart) holds it alone: with `pytest -n 2` a test of another file met the
    restart mid-run (CI at 2f9c8ea, chaos seed 343: its feeder found the broker gone at start)."""
    node = request.node
    if node.get_closest_marker("kafka") is None and "kafka_broker" not in request.fixturenames:
        yield
        return
    import fcntl

    with open(f"{_started_mark()}.use", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX if node.get_closest_marker("kafka_restart") else fcntl.LOCK_SH)
        yield


def pytest_sessionfinish(session):
    import subprocess
    import sys

    if hasattr(session.config, "workerinput"):   # an xdist worker: the controller ends the run
        return
    if _started_mark().exists():
        subprocess.run([sys.executable, str(_broker_script()), "stop"], check=False)
        _started_mark().unlink(missing_ok=True)

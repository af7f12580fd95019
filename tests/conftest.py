from __future__ import annotations

import os

import pytest

from feeder.config import ServeConfig
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


@pytest.fixture(scope="session")
def kafka_broker():
    """The real broker from `make kafka` (127.0.0.1:$FEEDER_KAFKA_PORT, default 9092); started
    here, and stopped afterwards, when the tests run without it."""
    import socket
    import subprocess
    import sys
    from pathlib import Path

    port = int(os.environ.get("FEEDER_KAFKA_PORT", 9092))
    script = Path(__file__).resolve().parents[1] / "deploy" / "kafka" / "broker.py"
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        started = False
    except OSError:
        subprocess.run([sys.executable, str(script), "start", "--port", str(port)], check=True)
        started = True
    yield f"127.0.0.1:{port}"
    if started:
        subprocess.run([sys.executable, str(script), "stop"], check=False)

"""A single-node Apache Kafka broker (KRaft) for development and tests.

    python deploy/kafka/broker.py start [--port 9092]   # returns once it accepts clients
    python deploy/kafka/broker.py stop | restart | status

The broker is the official kafka_2.13 build from Maven Central, fetched by `mvn` with the pom
next to this file into deploy/kafka/lib (Maven's ~/.m2 cache keeps it across clones). Data
and logs live in a temporary directory; `stop` removes it, `restart` keeps it (the tests use
`restart` to take the broker away mid-stream and bring it back with its data).
Stdlib only, so it runs before any virtual environment exists.
"""
from __future__ import annotations

import argparse
import base64
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

HERE = Path(__file__).resolve().parent
LIB = HERE / "lib"
STATE = Path(os.environ.get("FEEDER_KAFKA_DIR", Path(tempfile.gettempdir()) / f"feeder-kafka-{os.getuid()}"))

PROPS = """\
process.roles=broker,controller
node.id=1
controller.quorum.voters=1@127.0.0.1:{cport}
listeners=PLAINTEXT://127.0.0.1:{port},CONTROLLER://127.0.0.1:{cport}
advertised.listeners=PLAINTEXT://127.0.0.1:{port}
controller.listener.names=CONTROLLER
inter.broker.listener.name=PLAINTEXT
listener.security.protocol.map=PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT
log.dirs={data}
num.partitions=1
auto.create.topics.enable=false
offsets.topic.replication.factor=1
offsets.topic.num.partitions=4
transaction.state.log.replication.factor=1
transaction.state.log.min.isr=1
transaction.state.log.num.partitions=4
group.initial.rebalance.delay.ms=0
message.max.bytes=16777216
"""

LOG4J = """\
log4j.rootLogger=WARN, file
log4j.appender.file=org.apache.log4j.FileAppender
log4j.appender.file.File={log}
log4j.appender.file.layout=org.apache.log4j.PatternLayout
log4j.appender.file.layout.ConversionPattern=[%d] %p %m (%c)%n
log4j.logger.kafka.server.KafkaServer=INFO
log4j.logger.kafka.server.BrokerServer=INFO
"""


def fetch() -> None:
    """Download the broker's jars once (mvn reuses ~/.m2 after the first time)."""
    if (LIB / ".complete").exists():
        return
    mvn = shutil.which("mvn")
    if mvn is None:
        sys.exit("kafka: `mvn` (Apache Maven) is needed to fetch the broker from Maven Central")
    print("kafka: fetching the broker from Maven Central (once) ...", flush=True)
    r = subprocess.run([mvn, "-q", "-B", "package"], cwd=HERE, stdin=subprocess.DEVNULL)
    if r.returncode:
        sys.exit(f"kafka: mvn failed with exit code {r.returncode}")
    (LIB / ".complete").touch()


def _pid() -> int | None:
    try:
        pid = int((STATE / "pid").read_text())
        os.kill(pid, 0)
        return pid
    except (OSError, ValueError):
        return None


def _accepts(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


def _ready(port: int) -> bool:
    """A broker 'accepts clients' once it answers a metadata request, not merely a TCP connect."""
    if not _accepts(port):
        return False
    try:
        from confluent_kafka.admin import AdminClient
    except ImportError:  # before the venv exists: a connect plus a settle period is the best we have
        time.sleep(2)
        return True
    try:
        AdminClient({"bootstrap.servers": f"127.0.0.1:{port}"}).list_topics(timeout=2)
        return True
    except Exception:
        return False


def _cluster_id() -> str:
    """A random Kafka cluster id, as Kafka's own Uuid.randomUuid makes it.

    The id is url-safe base64, so one in 64 starts with '-', and the storage tool's argument
    parser then takes it for an option ("--cluster-id: expected one argument"). Kafka draws
    again in that case; so do we.
    """
    while True:
        cluster = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
        if not cluster.startswith("-"):
            return cluster


def start(port: int, fresh: bool = True, timeout: float = 90.0) -> None:
    if _pid() is not None:
        print(f"kafka: already running (pid {_pid()}) on 127.0.0.1:{(STATE / 'port').read_text()}")
        return
    fetch()
    java = shutil.which("java")
    if java is None:
        sys.exit("kafka: Java 17+ is needed to run the broker")
    data = STATE / "data"
    if fresh:
        shutil.rmtree(STATE, ignore_errors=True)
    STATE.mkdir(parents=True, exist_ok=True)
    props = STATE / "server.properties"
    props.write_text(PROPS.format(port=port, cport=port + 1, data=data))
    (STATE / "log4j.properties").write_text(LOG4J.format(log=STATE / "broker.log"))
    (STATE / "port").write_text(str(port))
    cp = f"{LIB}/*"
    env = dict(os.environ, KAFKA_HEAP_OPTS="")
    jvm = [java, "-Xms256m", "-Xmx768m", "-XX:+UseG1GC", "-Djava.awt.headless=true",
           f"-Dlog4j.configuration=file:{STATE / 'log4j.properties'}", "-cp", cp]
    if not (data / "meta.properties").exists():
        cluster = _cluster_id()
        r = subprocess.run(jvm + ["kafka.tools.StorageTool", "format", "-t", cluster, "-c", str(props)],
                           stdin=subprocess.DEVNULL, capture_output=True, text=True, env=env)
        if r.returncode:
            sys.exit(f"kafka: formatting the storage failed:\n{r.stdout}{r.stderr}")
    out = open(STATE / "stdout.log", "ab")
    p = subprocess.Popen(jvm + ["kafka.Kafka", str(props)], stdin=subprocess.DEVNULL, stdout=out,
                         stderr=subprocess.STDOUT, env=env, start_new_session=True)
    (STATE / "pid").write_text(str(p.pid))
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if p.poll() is not None:
            sys.exit(f"kafka: the broker exited with code {p.returncode}; see {STATE / 'stdout.log'} "
                     f"and {STATE / 'broker.log'}")
        if _ready(port):
            print(f"kafka: broker ready on 127.0.0.1:{port} (pid {p.pid}, data in {data})", flush=True)
            return
        time.sleep(0.3)
    stop(keep=True)
    sys.exit(f"kafka: the broker did not accept clients within {timeout:.0f}s; see {STATE / 'broker.log'}")


def stop(keep: bool = False) -> None:
    pid = _pid()
    if pid is not None:
        os.killpg(pid, signal.SIGTERM)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and _pid() is not None:
            try:  # reap when it is our child (restart); harmless otherwise
                os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                pass
            time.sleep(0.2)
        if _pid() is not None:
            os.killpg(pid, signal.SIGKILL)
        print(f"kafka: broker stopped (pid {pid})", flush=True)
    else:
        print("kafka: no broker running", flush=True)
    if not keep:
        shutil.rmtree(STATE, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("action", choices=["start", "stop", "restart", "status", "fetch"])
    ap.add_argument("--port", type=int, default=int(os.environ.get("FEEDER_KAFKA_PORT", 9092)))
    a = ap.parse_args()
    if a.action == "fetch":
        fetch()
    elif a.action == "start":
        start(a.port)
    elif a.action == "stop":
        stop()
    elif a.action == "restart":
        port = int((STATE / "port").read_text()) if (STATE / "port").exists() else a.port
        stop(keep=True)
        start(port, fresh=False)
    else:
        pid = _pid()
        print(f"kafka: running (pid {pid})" if pid else "kafka: not running")
        sys.exit(0 if pid else 1)


if __name__ == "__main__":
    main()

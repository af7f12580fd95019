"""The seam between sources and the pipeline (feeder/sources/__init__.py): every source and
plan implements its protocol in full, the pipeline probes none of them, and a new source
written against the protocol alone is served, exactly, by a real feeder over real gRPC."""
from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import pytest

from feeder.config import ServeConfig, StreamSpec
from feeder.cursor import Cursor
from feeder.planning import StreamPlan
from feeder.rows import Rows
from feeder.service.server import ServerThread
from feeder.sources import Plan, Source
from feeder.sources.posix import open_source

ROOT = Path(__file__).resolve().parent.parent
SPEC = StreamSpec(job="seam", rank=0, world_size=2, seq_len=8, micro_batch=3, seed=1, num_epochs=2)


class ArraySource:
    """A source in 20 lines: one token array in memory. Nothing else of the feeder knows it."""

    def __init__(self, tokens: np.ndarray, name: str = "mem"):
        self.tokens, self.name = tokens, name
        self.fingerprint = f"mem-{len(tokens)}"
        self.n_tokens, self.n_documents = len(tokens), 1
        self.vocab_size, self.eos_id, self.dtype = 1 << 16, 0, tokens.dtype
        self.closed = False

    def plan(self, spec: StreamSpec, cursor: Cursor | None) -> StreamPlan:
        return StreamPlan(spec, n_tokens=self.n_tokens, fingerprint=self.fingerprint, cursor=cursor, data=self)

    def locate(self, starts: np.ndarray, n: int) -> Rows:
        return Rows([self.tokens], np.zeros(len(starts), dtype=np.int64), np.asarray(starts, dtype=np.int64), n)

    def close(self) -> None:
        self.closed = True


def test_every_source_and_plan_implements_its_protocol(dataset):
    from tests.test_kafka_units import follow_plan

    src = open_source(str(dataset))
    assert isinstance(src, Source) and isinstance(src.plan(SPEC, None), Plan)
    mem = ArraySource(np.arange(500, dtype=np.uint16))
    assert isinstance(mem, Source) and isinstance(mem.plan(SPEC, None), Plan)
    plan, _ = follow_plan([[[1, 2, 3]] * 4], rank=0, world=1)
    assert isinstance(plan, Plan)
    from feeder.sources.mixture import MixtureSource

    mix = MixtureSource((("a", 2.0), ("b", 1.0)), {"a": mem, "b": ArraySource(np.arange(300, dtype=np.uint16))})
    assert isinstance(mix, Source) and isinstance(mix.plan(SPEC, None), Plan)


@pytest.mark.kafka
def test_kafka_sources_and_both_their_plans_implement_the_protocols(kafka_broker, tmp_path):
    """A real broker and topic: the source, a bounded epoch's plan and a follow plan."""
    from feeder.sources.kafka import KafkaSource, KafkaURL
    from tests.helpers import make_docs
    from tests.test_kafka import publish, topic_name

    topic = publish(kafka_broker, make_docs(30, seed=2), tmp_path, topic_name("seam"), partitions=2)
    for mode in ("bounded", "follow"):
        src = KafkaSource(KafkaURL.parse(f"kafka://{kafka_broker}/{topic}?mode={mode}"))
        try:
            plan = src.plan(SPEC, None)
            assert isinstance(src, Source) and isinstance(plan, Plan), mode
            plan.close()
        finally:
            src.close()


def test_the_pipeline_probes_no_source():
    """No hasattr/getattr/isinstance in the engine and the pipeline: what a source can do is
    its protocol, not what it happens to have."""
    for path in [ROOT / "feeder" / "engine.py", *sorted((ROOT / "feeder" / "pipeline").glob("*.py"))]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                assert node.func.id not in ("hasattr", "getattr", "isinstance"), \
                    f"{path.name}:{node.lineno} probes with {node.func.id}"


def test_a_new_source_is_served_exactly_through_the_seam_alone():
    """ArraySource through a real server and client, with two DataLoader-style worker shares
    and compression on and off: the oracle is torch's DistributedSampler."""
    from feeder_client.stream import ClientConfig, FeederClient
    from tests.helpers import reference_ids

    tokens = np.random.default_rng(3).integers(1, 60000, 2000, dtype=np.uint16)
    mem = ArraySource(tokens)
    srv = ServerThread(ServeConfig(source="unused", listen="127.0.0.1:0", message_bytes=256), sources={"mem": mem})
    try:
        n = (len(tokens) - 1) // SPEC.seq_len
        for compression in ("none", "zstd"):
            for rank in range(SPEC.world_size):
                want = [i for e in range(2) for i in reference_ids(n, 2, rank, shuffle=True, seed=1, drop_last=False,
                                                                   epoch=e)]
                got = []
                for w in range(2):   # each worker's share, then merged in round-robin order
                    spec = StreamSpec(**{**SPEC.__dict__, "rank": rank, "compression": compression,
                                         "job": f"seam-{compression}", "worker_index": w, "num_workers": 2})
                    c = FeederClient(ClientConfig(targets=(srv.address,), spec=spec, retry_for_s=10))
                    got.append(list(c))
                    c.close()
                merged = [b for pair in zip(*got) for b in pair] + got[0][len(got[1]):]
                assert [i for b in merged for i in b.sample_ids.tolist()] == want
                for b in merged:
                    for i, row in zip(b.sample_ids.tolist(), b.tokens.numpy()):
                        assert np.array_equal(row, tokens[i * 8:i * 8 + 9])
    finally:
        srv.stop()
    assert mem.closed   # the engine closed it with the server


def test_a_mixture_of_sources_that_only_locate_rows_is_served_exactly():
    """Two ArraySources (no chunk table: the mixture asks each where its rows lie and merges
    them) through a real server and client: every sample is its source's own tokens, and the
    sources tell which filled each position. Sources on files take the joined table instead
    (test_mixture checks their content)."""
    from feeder_client.stream import ClientConfig, FeederClient

    from feeder.sources import ChunkTable

    rng = np.random.default_rng(4)
    arrays = {"a": rng.integers(1, 60000, 900, dtype=np.uint16), "b": rng.integers(1, 60000, 400, dtype=np.uint16)}
    mems = {name: ArraySource(t, name=name) for name, t in arrays.items()}
    assert not any(isinstance(m, ChunkTable) for m in mems.values())
    srv = ServerThread(ServeConfig(source="unused", listen="127.0.0.1:0", message_bytes=256), sources=mems)
    try:
        seen = set()
        for rank in range(SPEC.world_size):
            spec = StreamSpec(**{**SPEC.__dict__, "rank": rank, "job": "seam-mix", "mixture": (("a", 3.0), ("b", 1.0))})
            c = FeederClient(ClientConfig(targets=(srv.address,), spec=spec, retry_for_s=10))
            for b in c:
                for d, i, row in zip(b.sources.tolist(), b.sample_ids.tolist(), b.tokens.numpy()):
                    assert np.array_equal(row, arrays["ab"[d]][i * 8:i * 8 + 9])
                    seen.add(d)
            c.close()
        assert seen == {0, 1}
    finally:
        srv.stop()


# Inside feeder, each layer imports only layers below it (ARCHITECTURE.md).
CORE = {"sampler", "mixture", "sampling_key", "cursor", "planning", "rows", "config", "errors", "manifest", "v1"}
LAYERS = [("core", CORE), ("sources", {"sources"}), ("pipeline", {"pipeline"}), ("domain", {"engine", "process_status"}),
          ("service", {"service"})]


def _feeder_imports(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("feeder."):
            out.add(node.module.split(".")[1])
        elif isinstance(node, ast.ImportFrom) and node.module == "feeder":
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.Import):
            out |= {a.name.split(".")[1] for a in node.names if a.name.startswith("feeder.")}
    return out


def test_the_layers_inside_feeder_import_only_downwards():
    level = {m: i for i, (_, mods) in enumerate(LAYERS) for m in mods}
    bad = []
    for i, (name, mods) in enumerate(LAYERS):
        for mod in mods:
            base = ROOT / "feeder" / mod
            files = sorted(base.rglob("*.py")) if base.is_dir() else [base.with_suffix(".py")]
            for path in files:
                if "_pb2" in path.name:
                    continue
                above = {m for m in _feeder_imports(path) if level.get(m, -1) > i}
                if above:
                    bad.append(f"{path.relative_to(ROOT)} ({name}) imports {sorted(above)}")
    assert not bad, bad

"""The seam between sources and the pipeline (feeder/sources/__init__.py): every source and
plan implements its protocol in full, the pipeline probes none of them, and a new source
written against the protocol alone is served, exactly, by a real feeder over real gRPC."""
from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import pytest

from feeder.core.config import ServeConfig, StreamSpec
from feeder.core.cursor import Cursor
from feeder.core.planning import StreamPlan
from feeder.core.rows import Rows
from feeder.service.server import ServerThread
from feeder.sources import NO_CONTEXT, Context, Plan, PlanBase, Source
from feeder.sources.open import open_source

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

    def plan(self, spec: StreamSpec, cursor: Cursor | None, ctx: Context = NO_CONTEXT) -> StreamPlan:
        return StreamPlan(spec, n_tokens=self.n_tokens, fingerprint=self.fingerprint, cursor=cursor, data=self,
                          orders=ctx.orders)

    def locate(self, starts: np.ndarray, n: int) -> Rows:
        return Rows([self.tokens], np.zeros(len(starts), dtype=np.int64), np.asarray(starts, dtype=np.int64), n)

    def close(self) -> None:
        self.closed = True


def test_every_source_and_plan_implements_its_protocol(dataset):
    from tests.test_kafka_units import follow_plan

    src = open_source(str(dataset))
    assert isinstance(src, Source) and isinstance(src.plan(SPEC, None), Plan)
    assert isinstance(src.plan(SPEC, None), PlanBase)   # the defaults every plan inherits
    mem = ArraySource(np.arange(500, dtype=np.uint16))
    assert isinstance(mem, Source) and isinstance(mem.plan(SPEC, None), Plan)
    plan, _ = follow_plan([[[1, 2, 3]] * 4], rank=0, world=1)
    assert isinstance(plan, Plan) and isinstance(plan, PlanBase)
    from feeder.sources.mixture import MixtureSource

    mix = MixtureSource((("a", 2.0), ("b", 1.0)), {"a": mem, "b": ArraySource(np.arange(300, dtype=np.uint16))})
    assert isinstance(mix, Source) and isinstance(mix.plan(SPEC, None), Plan)
    assert isinstance(mix.plan(SPEC, None), PlanBase)


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
            assert isinstance(src, Source) and isinstance(plan, Plan) and isinstance(plan, PlanBase), mode
            plan.close()
        finally:
            src.close()


def test_the_pipeline_probes_no_source():
    """No hasattr/getattr/isinstance in the engine and the pipeline: what a source can do is
    its protocol, not what it happens to have."""
    for path in [ROOT / "feeder" / "domain" / "engine.py", *sorted((ROOT / "feeder" / "pipeline").glob("*.py"))]:
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


# Inside feeder, each layer imports only layers below it (ARCHITECTURE.md): every module, every
# import in it, function bodies included (a function-level import hid a circle once).
LAYERS = ["core", "sources", "pipeline", "domain", "service", "ops"]
# Generated code and build hooks sit with the core; the command line (feeder/cli.py) above all.
BELOW_ALL = {"v1", "tfrecord", "_protogen", "_native", "_shuffle", "__init__"}


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _feeder_modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted((ROOT / "feeder").rglob("*.py")) if "_pb2" not in p.name}


def _layer(module: str) -> int:
    parts = module.split(".")
    if len(parts) == 1:
        return 0
    top = parts[1]
    if top in LAYERS:
        return LAYERS.index(top)
    return 0 if top in BELOW_ALL else len(LAYERS)   # feeder.cli


def _feeder_imports(path: Path, modules: dict[str, Path]) -> set[str]:
    """The feeder modules `path` imports anywhere in it (a name imported from a package is that
    module when it is one, else the package)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "feeder":
            for a in node.names:
                sub = f"{node.module}.{a.name}"
                out.add(sub if sub in modules else node.module)
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.split(".")[0] == "feeder"}
    return {m for m in out if m in modules}


def test_the_layers_inside_feeder_import_only_downwards():
    modules = _feeder_modules()
    bad = []
    for name, path in modules.items():
        above = {m for m in _feeder_imports(path, modules) if _layer(m) > _layer(name)}
        if above:
            bad.append(f"{path.relative_to(ROOT)} ({(['core'] + LAYERS[1:] + ['cli'])[_layer(name)]}) imports {sorted(above)}")
    assert not bad, bad


def test_no_import_circle_anywhere_in_feeder():
    """No module reaches itself through imports, function-level ones included. (A package's
    __init__ is left out as an importer of its own submodules' users: importing `feeder.sources.x`
    runs `feeder.sources` first, which is not an import of x by the package.)"""
    modules = _feeder_modules()
    graph = {m: {d for d in _feeder_imports(p, modules) if d != m} for m, p in modules.items()}
    state, circles = {}, []

    def visit(m, path):
        state[m] = 1
        for d in sorted(graph[m]):
            if state.get(d) == 1:
                circles.append(" -> ".join(path[path.index(d):] + [d]) if d in path else f"{m} -> {d}")
            elif d not in state:
                visit(d, path + [d])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert not circles, circles


def test_feeder_keeps_at_most_ten_modules_at_its_top_level_and_no_two_differ_only_by_folder():
    top = [p.name for p in (ROOT / "feeder").iterdir() if p.suffix in (".py", ".c")]
    assert len(top) <= 10, top
    names = {}
    for name in _feeder_modules():
        leaf = name.split(".")[-1]
        if leaf not in ("__init__",) and name.count(".") >= 1:
            names.setdefault(leaf, []).append(name)
    packages = {n for n, p in _feeder_modules().items() if p.name == "__init__.py"}
    dup = {leaf: mods for leaf, mods in names.items() if len(mods) > 1 and not all(m in packages for m in mods)}
    assert not dup, dup

"""Extending the feeder (issue 32, docs/extending.md): a new kind of epoch order, and a new
packing, are each one registration, served end to end; the cursor bytes of the kinds released so
far never change."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from feeder.core import order, packing
from feeder.core.config import ServeConfig, StreamSpec
from feeder.core.cursor import Cursor
from feeder.core.layout import Bounds
from feeder.core.rows import Rows
from feeder.core.sampler import n_samples
from feeder.service.server import ServerThread
from feeder_client.stream import ClientConfig, FeederClient

# Every kind ever released, with the byte its cursors carry. Append only: a cursor written by
# any release must name the same kind in every later one.
RELEASED = {"": 0, "torch": 1, "torch-legacy": 2, "stateless": 3}


def test_the_cursor_bytes_of_released_order_kinds_never_change():
    for name, byte in RELEASED.items():
        assert order.kind_of(name).byte == byte and order.by_byte(byte).name == name
    assert set(order.kinds()) >= set(RELEASED)
    assert len({order.kind_of(k).byte for k in order.kinds()}) == len(order.kinds())
    with pytest.raises(ValueError, match="cursor byte is 'stateless'"):
        order.register(order.OrderKind("another", 3, order.Stateless, materialized=False))
    with pytest.raises(ValueError, match="name is 'torch'"):
        order.register(order.OrderKind("torch", 77, order.Stateless, materialized=False))


class Reversed:
    """A toy order: position i holds id n - 1 - i (whatever the seed)."""

    def __init__(self, n: int, seed: int):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, key):
        positions = np.arange(*key.indices(self.n)) if isinstance(key, slice) else np.asarray(key, dtype=np.int64)
        return self.n - 1 - positions


@pytest.fixture
def reversed_kind(monkeypatch):
    """The toy kind, registered for this test only (one registration call)."""
    monkeypatch.setattr(order, "_BY_NAME", dict(order._BY_NAME))
    monkeypatch.setattr(order, "_BY_BYTE", dict(order._BY_BYTE))
    return order.register(order.OrderKind("toy-reversed", 200, Reversed, materialized=False))


def test_a_toy_order_kind_registered_here_is_served_end_to_end(reversed_kind, dataset, stream):
    """Ranks ask for it by name; each gets DistributedSampler's dealing of the toy order's
    positions; its cursors carry its byte and resume it."""
    seq, world, mb = 16, 3, 4
    n = n_samples(len(stream), seq)
    srv = ServerThread(ServeConfig(source=str(dataset), listen="127.0.0.1:0", message_bytes=2048))
    try:
        for rank in range(world):
            spec = StreamSpec(job="toy-order", rank=rank, world_size=world, seq_len=seq, micro_batch=mb,
                              permutation="toy-reversed")
            c = FeederClient(ClientConfig(targets=(srv.address,), spec=spec, retry_for_s=10))
            got = list(c)
            c.close()
            per = -(-n // world)
            positions = (rank + np.arange(per) * world) % n     # DistributedSampler's dealing, padded from the front
            assert [i for b in got for i in b.sample_ids.tolist()] == (n - 1 - positions).tolist()
            for b in got:
                for row, i in zip(b.tokens.numpy(), b.sample_ids.tolist()):
                    assert np.array_equal(row, stream[i * seq:i * seq + seq + 1])
            cursor = Cursor.decode(got[2].cursor, b"")
            assert cursor.permutation == "toy-reversed"
            resumed = FeederClient(ClientConfig(targets=(srv.address,), spec=spec, cursor=got[2].cursor,
                                                retry_for_s=10))
            assert [b.sample_ids.tolist() for b in resumed] == [b.sample_ids.tolist() for b in got[3:]]
            resumed.close()
    finally:
        srv.stop()


class OneDocument:
    """A toy packing: sample i is document i (with its EOS), cut to seq_len + 1 tokens, the rest EOS."""

    def __init__(self, source, seq_len: int, ctx):
        starts, end = source.doc_spans(0, source.n_tokens)          # (feeder.sources.Documents)
        ends = np.minimum(np.append(starts[1:], end), starts + seq_len + 1)
        self.source, self.seq_len, self.spans, self.dtype = source, seq_len, np.stack([starts, ends], 1), source.dtype
        self.n_samples, self.fingerprint = len(starts), "toy-1doc-" + source.fingerprint

    def locate(self, starts: np.ndarray, n: int) -> Rows:
        out = np.full((len(starts), n), self.source.eos_id, dtype=self.dtype)
        for row, (a, b) in zip(out, self.spans[np.asarray(starts) // self.seq_len]):
            self.source.read(int(a), row[:b - a])
        return Rows.of(out)

    def boundaries(self, starts: np.ndarray, n: int) -> Bounds:
        a, b = self.spans[np.asarray(starts) // self.seq_len].T
        return Bounds(np.ones(len(a), np.int32), (b - a).astype(np.int32), np.zeros(len(a), np.int32))


@pytest.fixture
def one_document_packing(monkeypatch):
    """The toy packing, registered for this test only (one registration call)."""
    monkeypatch.setattr(packing, "_KINDS", dict(packing._KINDS))
    return packing.register(packing.PackingKind("toy-one-doc", "toy-1doc-", wrap=OneDocument))


def test_a_toy_packing_registered_here_is_served_end_to_end(one_document_packing, dataset, docs):
    """Ranks ask for it by name: each gets DistributedSampler's dealing of its samples (one per
    document), the document's tokens with their boundaries; its cursors resume it, a concat
    cursor is refused as another packing's, and a feeder that lacks a packing names those it has."""
    from feeder.core.errors import FeederError
    from tests.helpers import reference_ids

    seq, world, mb, eos = 24, 2, 4, 256
    srv = ServerThread(ServeConfig(source=str(dataset), listen="127.0.0.1:0", message_bytes=2048))
    try:
        for rank in range(world):
            spec = StreamSpec(job="toy-pack", rank=rank, world_size=world, seq_len=seq, micro_batch=mb,
                              packing="toy-one-doc", seed=3)
            c = FeederClient(ClientConfig(targets=(srv.address,), spec=spec, retry_for_s=10))
            got = list(c)
            c.close()
            ids = [i for b in got for i in b.sample_ids.tolist()]
            assert ids == reference_ids(len(docs), world, rank, shuffle=True, seed=3, drop_last=False, epoch=0)
            for b in got:
                for row, i, length in zip(b.tokens.numpy(), b.sample_ids.tolist(), b.boundaries.lengths.tolist()):
                    doc = [*docs[i].encode(), eos][:seq + 1]
                    assert row.tolist() == doc + [eos] * (seq + 1 - len(doc)) and length == len(doc)
            assert Cursor.decode(got[1].cursor, b"").fingerprint.startswith("toy-1doc-")
            resumed = FeederClient(ClientConfig(targets=(srv.address,), spec=spec, cursor=got[1].cursor,
                                                retry_for_s=10))
            assert [b.sample_ids.tolist() for b in resumed] == [b.sample_ids.tolist() for b in got[2:]]
            resumed.close()
        spec = StreamSpec(job="toy-pack-1", rank=0, world_size=1, seq_len=seq, micro_batch=mb)
        c = FeederClient(ClientConfig(targets=(srv.address,), retry_for_s=10, spec=spec))
        concat = next(iter(c))
        c.close()
        spec = dataclasses.replace(spec, packing="toy-one-doc", continued=True)
        with pytest.raises(FeederError, match="packing differs: the cursor is of concat samples, the request asks "
                                              "for toy-one-doc"):
            list(FeederClient(ClientConfig(targets=(srv.address,), spec=spec, cursor=concat.cursor, retry_for_s=2)))
        with pytest.raises(FeederError, match="packing 'nope' is not one this feeder serves; it serves: best_fit, "
                                              "concat, toy-one-doc") as e:
            list(FeederClient(ClientConfig(targets=(srv.address,), retry_for_s=2, spec=StreamSpec(
                job="toy-pack-nope", rank=0, world_size=1, seq_len=seq, micro_batch=mb, packing="nope"))))
        assert e.value.code.name == "INVALID_ARGUMENT"
    finally:
        srv.stop()


def test_cursor_position_kinds_are_registered_by_their_owners_with_their_released_bytes():
    """cursor.py knows no source: each kind of source position is registered by the module that
    owns it, and the bytes cursors carry for them never change."""
    import ast
    from pathlib import Path

    from feeder.core import cursor
    from feeder.core.cursor import Mixture, Scheduled
    from feeder.sources.kafka_positions import KafkaEpoch, KafkaFollow, KafkaFollowMix

    # (1: no position; 6: a scheduled mixture's, issue 46)
    released = {2: KafkaEpoch, 3: KafkaFollow, 4: Mixture, 5: KafkaFollowMix, 6: Scheduled}
    assert {b: k.type for b, k in cursor._POSITIONS.items()} == released
    tree = ast.parse(Path(cursor.__file__).read_text())
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert not {m for m in imported if m and m.startswith("feeder.sources")}, imported
    with pytest.raises(ValueError, match="registered already"):
        cursor.register_position(cursor.PositionKind(4, dict, repr, eval))


def test_two_servers_in_one_process_keep_their_own_cache_directories(dataset, stream, tmp_path, monkeypatch):
    """No process-wide state: each server's plans build into and read from its own cache
    directory (best-fit sidecars and torch's large orders), whichever server started last."""
    from feeder.core import sampler
    from feeder.domain.order_store import orders_directory

    monkeypatch.setattr(sampler, "SMALL_ORDER", 16)   # every order here is "large": the order store's
    seq = 16
    caches = [tmp_path / "a", tmp_path / "b"]
    servers = [ServerThread(ServeConfig(source=str(dataset), listen="127.0.0.1:0", message_bytes=2048,
                                        cache_dir=str(c))) for c in caches]
    try:
        got = {}
        for i, srv in enumerate(servers):   # (both started before either streams)
            for packing in ("concat", "best_fit"):
                spec = StreamSpec(job=f"two-{i}-{packing}", rank=0, world_size=2, seq_len=seq, micro_batch=4,
                                  packing=packing, permutation="torch")
                c = FeederClient(ClientConfig(targets=(srv.address,), spec=spec, retry_for_s=30))
                got[i, packing] = [b.sample_ids.tolist() for b in c]
                c.close()
        assert got[0, "concat"] == got[1, "concat"] and got[0, "best_fit"] == got[1, "best_fit"]
        n = n_samples(len(stream), seq)
        from tests.helpers import reference_ids
        assert [i for b in got[0, "concat"] for i in b] == reference_ids(n, 2, 0, shuffle=True, seed=0,
                                                                          drop_last=False, epoch=0)
        for c in caches:
            assert any((c / "packing").iterdir()), f"no packing in {c}"
            assert any(Path(orders_directory(str(c))).iterdir()), f"no order in {c}"
    finally:
        for srv in servers:
            srv.stop()


PLUGIN = '''"""An operator's plugin: an order kind and a packing, registered at import."""
import numpy as np

from feeder.core import order, packing
from feeder.core.layout import Bounds
from feeder.core.rows import Rows


class Reversed:
    def __init__(self, n, seed):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, key):
        positions = np.arange(*key.indices(self.n)) if isinstance(key, slice) else np.asarray(key, dtype=np.int64)
        return self.n - 1 - positions


class OneDocument:
    def __init__(self, source, seq_len, ctx):
        starts, end = source.doc_spans(0, source.n_tokens)
        ends = np.minimum(np.append(starts[1:], end), starts + seq_len + 1)
        self.source, self.seq_len, self.spans, self.dtype = source, seq_len, np.stack([starts, ends], 1), source.dtype
        self.n_samples, self.fingerprint = len(starts), "plg1doc-" + source.fingerprint

    def locate(self, starts, n):
        out = np.full((len(starts), n), self.source.eos_id, dtype=self.dtype)
        for row, (a, b) in zip(out, self.spans[np.asarray(starts) // self.seq_len]):
            self.source.read(int(a), row[:b - a])
        return Rows.of(out)

    def boundaries(self, starts, n):
        a, b = self.spans[np.asarray(starts) // self.seq_len].T
        return Bounds(np.ones(len(a), np.int32), (b - a).astype(np.int32), np.zeros(len(a), np.int32))


order.register(order.OrderKind("plugin-reversed", 201, Reversed, materialized=False))
packing.register(packing.PackingKind("plugin-one-doc", "plg1doc-", wrap=OneDocument))
'''


def test_review_feeder_serve_plugin_serves_an_operators_order_kind_and_packing(dataset, docs, tmp_path,
                                                                               monkeypatch):
    """Issue 44.7: `feeder serve --plugin MODULE` imports an operator's module (here from a
    directory on PYTHONPATH) before serving, and a real `feeder serve` streams with its order kind
    and packing; a plugin that does not import, or clashes, ends serve in one line (exit 2)."""
    import os
    import subprocess
    import sys

    from tests.helpers import FeederProc

    (tmp_path / "toy_feeder_plugin.py").write_text(PLUGIN)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(tmp_path), os.environ.get("PYTHONPATH")) if p))
    # the client names the order kind in its cursors too: the trainer imports the plugin as well
    monkeypatch.setattr(order, "_BY_NAME", dict(order._BY_NAME))
    monkeypatch.setattr(order, "_BY_BYTE", dict(order._BY_BYTE))
    monkeypatch.setattr(packing, "_KINDS", dict(packing._KINDS))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "toy_feeder_plugin", raising=False)
    import toy_feeder_plugin  # noqa: F401
    monkeypatch.delitem(sys.modules, "toy_feeder_plugin")
    monkeypatch.setattr(packing, "_KINDS", {k: v for k, v in packing._KINDS.items() if k != "plugin-one-doc"})

    seq, mb, eos, n = 24, 4, 256, len(docs)
    feeder = FeederProc(dataset, extra=["--plugin", "toy_feeder_plugin"])
    try:
        spec = StreamSpec(job="plugin", rank=0, world_size=1, seq_len=seq, micro_batch=mb, packing="plugin-one-doc",
                          permutation="plugin-reversed", num_epochs=1)
        c = FeederClient(ClientConfig(targets=(feeder.address,), spec=spec, retry_for_s=10))
        got = list(c)
        c.close()
        assert [i for b in got for i in b.sample_ids.tolist()] == list(range(n - 1, -1, -1))
        for b in got:
            for row, i, length in zip(b.tokens.numpy(), b.sample_ids.tolist(), b.boundaries.lengths.tolist()):
                doc = [*docs[i].encode(), eos][:seq + 1]
                assert row.tolist() == doc + [eos] * (seq + 1 - len(doc)) and length == len(doc)
        assert Cursor.decode(got[0].cursor, b"").permutation == "plugin-reversed"
    finally:
        feeder.stop()

    (tmp_path / "clashing_plugin.py").write_text(
        "from feeder.core import packing\n"
        "packing.register(packing.PackingKind('mine', 'bf-x', wrap=lambda s, n, c: s))\n")
    for plugin, why in (("no_such_feeder_plugin", "ModuleNotFoundError: No module named 'no_such_feeder_plugin'"),
                        (str(tmp_path / "missing.py"), f"FileNotFoundError: no file {tmp_path / 'missing.py'}"),
                        ("clashing_plugin", "ValueError: packing 'mine': its fingerprint prefix 'bf-x' is not told "
                                            "apart from 'best_fit''s 'bf-'")):
        out = subprocess.run([sys.executable, "-m", "feeder.cli", "serve", "--source", str(dataset), "--listen",
                              "127.0.0.1:0", "--plugin", "toy_feeder_plugin", "--plugin", plugin],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 2 and out.stdout == "", out
        assert out.stderr.count("\n") == 1 and out.stderr.startswith(
            f"feeder serve: error: --plugin {plugin} cannot be imported: {why}; a plugin is "), out.stderr

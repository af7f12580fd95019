"""Bad input from users and callers (issue 16, finding 6), each through the real entry point:
`feeder prep` as a subprocess (exit 2, one line, no traceback), raw gRPC against a real
`feeder serve` process (the exact status code), and FeederDataset for the client."""
from __future__ import annotations

import bz2
import gzip
import lzma
import re
import subprocess
import sys
import threading
from pathlib import Path

import grpc
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from feeder_client import FeederDataset
from feeder.core.errors import InvalidArgument
from feeder.service.security import token_hash
from feeder.v1 import feeder_pb2 as pb
from tests.helpers import FeederProc, make_docs, refused, write_jsonl

FEEDER = [sys.executable, "-m", "feeder.cli"]
MAX_STATUS_MESSAGE = 2048   # what the servicer promises (feeder.service.servicer), restated as the contract


def prep(*args) -> subprocess.CompletedProcess:
    return subprocess.run([*FEEDER, "prep", *map(str, args), "--workers", "1", "--quiet"],
                          capture_output=True, text=True, timeout=120)


def tokens_of(out: Path) -> list[int]:
    from feeder.sources import manifest as mf

    m = mf.read(out)
    return [t for s in m.shards
            for t in pa.ipc.open_file(pa.memory_map(str(out / s.path))).read_all()
            .column("tokens").combine_chunks().values.to_pylist()]


# ---- feeder prep ------------------------------------------------------------------------

def test_regression_prep_refuses_a_lone_surrogate_naming_file_and_line(tmp_path):
    """Valid JSON may escape half a UTF-16 pair (\\ud800) alone: that is no Unicode text and has
    no UTF-8 bytes. prep refuses the document (file:line), it does not change the text."""
    src = tmp_path / "docs.jsonl"
    src.write_text('{"text": "fine"}\n{"text": "a\\ud800b"}\n', encoding="ascii")
    line = refused(prep(src, "--out", tmp_path / "out"), "docs.jsonl:2:", "lone UTF-16 surrogate \\ud800",
                   "at character 1")
    assert "expected" in line
    assert not (tmp_path / "out" / "manifest.json").exists()
    # A pair in escapes is one character: it preps to that character's UTF-8 bytes.
    pair = tmp_path / "pair.jsonl"
    pair.write_text('{"text": "\\ud83d\\ude00"}\n', encoding="ascii")
    assert prep(pair, "--out", tmp_path / "ok").returncode == 0
    assert tokens_of(tmp_path / "ok") == [*"😀".encode(), 256]


COMPRESSORS = {"gz": gzip.compress, "bz2": bz2.compress, "xz": lzma.compress,
               "zst": lambda b: zstandard.ZstdCompressor().compress(b)}


@pytest.mark.parametrize("kind", ["jsonl", "txt", "tfrecord"])
@pytest.mark.parametrize("packer", sorted(COMPRESSORS))
def test_regression_compressed_inputs_are_read_not_tokenized_as_text(tmp_path, kind, packer):
    """A compressed .jsonl/.txt/.tfrecord preps to exactly the tokens of its plain content; the
    compression is told by the magic bytes, so a compressed file named plain .jsonl etc. is read too."""
    from feeder.ops.prep import write_tfrecord

    plain = tmp_path / f"plain.{kind}"
    if kind == "jsonl":
        write_jsonl(plain, make_docs(40, seed=7))
    elif kind == "txt":
        plain.write_text("one document ✓\nover two lines\n", encoding="utf-8")
    else:
        write_tfrecord(str(plain), [[1, 2, 3], [], list(range(200))])
    data = COMPRESSORS[packer](plain.read_bytes())
    named = tmp_path / f"named.{kind}.{packer}"
    named.write_bytes(data)
    disguised = tmp_path / f"disguised.{kind}"   # the name says nothing of the compression
    disguised.write_bytes(data)
    assert prep(plain, "--out", tmp_path / "want").returncode == 0
    want = tokens_of(tmp_path / "want")
    for src in (named, disguised):
        r = prep(src, "--out", tmp_path / f"out-{src.name}")
        assert r.returncode == 0, r.stderr
        assert tokens_of(tmp_path / f"out-{src.name}") == want, src.name


def test_regression_damaged_compressed_input_exits_2(tmp_path):
    src = tmp_path / "cut.jsonl.gz"
    src.write_bytes(gzip.compress(write_jsonl(tmp_path / "a.jsonl", make_docs(200)).read_bytes())[:300])
    refused(prep(src, "--out", tmp_path / "out"), "cut.jsonl.gz: damaged gzip data")
    whole = tmp_path / "whole.parquet"   # Parquet compresses inside: a gzipped one is refused by name
    whole.write_bytes(gzip.compress(b"PAR1 not really"))
    refused(prep(whole, "--out", tmp_path / "out2"), "whole.parquet: a Parquet file compressed whole")


@pytest.mark.parametrize("name,content,words", [
    ("empty.jsonl", b"", "no documents"),
    ("blank.jsonl", b"\n\n  \n", "no documents"),
    ("empties.jsonl", b'{"text": ""}\n{"text": ""}\n{"text": ""}\n', "only empty documents (3)"),
    ("empty.txt", b"", "only empty documents (1)"),
])
def test_regression_empty_input_is_refused_at_prep(tmp_path, name, content, words):
    """No text: refused when prepared, not later by every stream (nothing is left in --out)."""
    src = tmp_path / name
    src.write_bytes(content)
    refused(prep(src, "--out", tmp_path / "out"), "the inputs hold", words, "expected at least one document")
    assert not (tmp_path / "out" / "manifest.json").exists()
    assert not list((tmp_path / "out").glob("shard-*"))


def test_regression_non_utf8_text_is_refused_with_file_and_byte_offset(tmp_path):
    """Never decoded with replacement characters: the file and the first bad byte are named."""
    txt = tmp_path / "latin1.txt"
    txt.write_bytes("café ok ".encode() + b"\xff rest")    # byte 9 is the first that is not UTF-8
    refused(prep(txt, "--out", tmp_path / "o1"), "latin1.txt: not UTF-8: byte 9 is 0xff", "expected UTF-8")
    packed = tmp_path / "latin1.txt.gz"
    packed.write_bytes(gzip.compress(txt.read_bytes()))
    refused(prep(packed, "--out", tmp_path / "o2"), "latin1.txt.gz (decompressed): not UTF-8: byte 9 is 0xff")
    # Arrow does not check a string column's UTF-8 when it reads one: prep does, per row.
    table = pa.table({"text": pa.array([b"ok", b"caf\xe9"], type=pa.binary()).view(pa.string())})
    pq.write_table(table, tmp_path / "rows.parquet")
    refused(prep(tmp_path / "rows.parquet", "--out", tmp_path / "o3"),
            "rows.parquet: row 2: 'text': not UTF-8: byte 3 is 0xe9")


def test_regression_out_that_is_a_file_exits_2(tmp_path):
    src = write_jsonl(tmp_path / "a.jsonl", ["text"])
    (tmp_path / "taken").write_text("a file, not a directory")
    refused(prep(src, "--out", tmp_path / "taken"), "--out", "taken: cannot make the directory")


# ---- the client -------------------------------------------------------------------------

@pytest.mark.parametrize("kw,words", [
    (dict(epoch=2**32), "epoch must be at most 4294967295"),
    (dict(seed=2**64), "seed must be at most 18446744073709551615"),
    (dict(epoch=2**32 - 1, num_epochs=2), "epoch + num_epochs must be at most 4294967295"),
    (dict(num_epochs=2**32), "num_epochs must be at most"),
    (dict(compression="none", compression_level=2**31), "compression level must be an integer"),
    (dict(dataset="a\ud800"), "dataset must be a string of Unicode characters"),
    (dict(expected_fingerprint=b"abc"), "expected_fingerprint must be a string"),
    (dict(shuffle="no"), "shuffle must be True or False"),
])
def test_regression_values_the_wire_cannot_carry_raise_in_the_constructor(kw, words):
    """Before, these passed the constructor and failed in the stream thread, hanging the loop."""
    with pytest.raises(InvalidArgument, match=re.escape(words)):
        FeederDataset(["127.0.0.1:1"], job="j", rank=0, world_size=1, seq_len=8, micro_batch=2, **kw)


def test_regression_an_unexpected_error_in_the_stream_thread_reaches_the_loop(feeder):
    """Any exception in the client's stream thread is raised to the training loop, which
    would otherwise wait forever. A value past the wire's uint32 is forced into the frozen
    spec (as a validation gap would let it through) so the thread's request building fails."""
    ds = FeederDataset([feeder.address], job="thread-error", rank=0, world_size=1, seq_len=8, micro_batch=2)
    object.__setattr__(ds.spec, "epoch", 2**32)
    outcome: list = []

    def loop():
        try:
            next(iter(ds))
            outcome.append("a batch")
        except Exception as e:
            outcome.append(e)

    t = threading.Thread(target=loop, daemon=True)
    t.start()
    t.join(30)
    assert not t.is_alive(), "the training loop hung on an error in the stream thread"
    assert isinstance(outcome[0], ValueError) and "out of range" in str(outcome[0]), outcome


# ---- the wire ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def served(dataset):
    f = FeederProc(dataset)
    yield f
    f.stop()


REQUESTS = {"Stream": pb.StreamRequest, "Info": pb.InfoRequest, "Status": pb.StatusRequest,
            "Report": pb.ReportRequest}


def call(address: str, method: str, body: bytes, metadata=()):
    """One raw call with these request bytes (no protobuf in the way); the RpcError it ends with."""
    with grpc.insecure_channel(address) as ch:
        path = f"/feeder.v1.Feeder/{method}"
        with pytest.raises(grpc.RpcError) as e:
            if method == "Stream":
                list(ch.unary_stream(path, request_serializer=None, response_deserializer=None)(
                    body, timeout=10, metadata=metadata))
            else:
                ch.unary_unary(path, request_serializer=None, response_deserializer=None)(
                    body, timeout=10, metadata=metadata)
    return e.value


# Truncated varint tag; wire type 7 (none such); a string field with bad UTF-8.
GARBAGE = (b"\xff\xff\xff", b"\x0f", b"\x0a\x01\xff")


@pytest.mark.parametrize("method", sorted(REQUESTS))
def test_regression_malformed_request_bytes_get_invalid_argument(served, method):
    for body in GARBAGE:
        e = call(served.address, method, body)
        assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, (body, e.code(), e.details())
        assert f"not a valid feeder.v1.{method}Request" in e.details()


def test_regression_malformed_request_under_tokens_gets_unauthenticated_then_invalid_argument(dataset, tmp_path):
    """With per-job tokens the token is checked first; a request that names no job because it
    does not parse is then INVALID_ARGUMENT, not an error of the token check."""
    tokens = tmp_path / "tokens.toml"
    tokens.write_text(f'[[token]]\nname = "a"\njobs = ["A"]\nsha256 = "{token_hash("tok-a")}"\n')
    f = FeederProc(dataset, extra=["--tokens-file", str(tokens)])
    try:
        for method in ("Stream", "Status"):
            assert call(f.address, method, GARBAGE[0]).code() == grpc.StatusCode.UNAUTHENTICATED
            e = call(f.address, method, GARBAGE[0], metadata=(("authorization", "Bearer tok-a"),))
            assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, (e.code(), e.details())
    finally:
        f.stop()


def test_regression_huge_job_name_gets_invalid_argument_with_a_short_message(served):
    """A 1 MiB job name was echoed whole: the status exceeded gRPC's metadata limit and came as
    RESOURCE_EXHAUSTED. Config messages now show a value abbreviated."""
    big = "j" * (1 << 20)
    e = call(served.address, "Stream", pb.StreamRequest(job=big, world_size=1, seq_len=8, micro_batch=1)
             .SerializeToString())
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, (e.code(), e.details()[:200])
    assert e.details().startswith("job must be a printable name of 1..256 characters, got 'jjj")
    assert "(1,048,576 characters in all)" in e.details() and len(e.details()) < 300


@pytest.mark.parametrize("method,field,value", [
    ("Info", "dataset", "d" * (1 << 20)),
    ("Status", "job", "s" * (1 << 20)),
    ("Info", "dataset", "é✓" * (200 << 10)),     # percent-encoded on the wire: 5 bytes -> 15
])
def test_regression_any_status_message_is_capped(served, method, field, value):
    """Not only config errors: whatever a refusal echoes, its status keeps its code."""
    e = call(served.address, method, REQUESTS[method](**{field: value}).SerializeToString())
    assert e.code() == grpc.StatusCode.NOT_FOUND, (e.code(), e.details()[:200])
    assert e.details().startswith(f"{field} '") and e.details().endswith("characters in all)")
    assert len(e.details().encode()) <= MAX_STATUS_MESSAGE


# -- found by the outside review of issue 16 ---------------------------------------------------

def test_regression_prep_of_json_nested_past_the_parsers_depth_exits_2(tmp_path):
    deep = tmp_path / "deep.jsonl"
    deep.write_text("[" * 100_000 + "]" * 100_000 + "\n")
    refused(prep(deep, "--out", tmp_path / "out"), "deep.jsonl:1", "not valid JSON")


def test_regression_serve_with_a_ledger_it_cannot_append_to_exits_2(dataset, tmp_path):
    for ledger in (tmp_path, tmp_path / "missing" / "ledger.jsonl"):
        r = subprocess.run([*FEEDER, "serve", "--source", str(dataset), "--listen", "127.0.0.1:0",
                            "--ledger", str(ledger)], capture_output=True, text=True, timeout=60)
        refused(r, "--ledger", str(ledger), "expected a file path")


def test_regression_audit_of_a_file_that_is_not_a_ledger_exits_2(tmp_path):
    for name, data in (("binary", b"\xff\xfe\x00garbage\n"), ("json", b'[1, 2]\n'), ("other", b'{"a": 1}\n')):
        path = tmp_path / name
        path.write_bytes(data)
        r = subprocess.run([*FEEDER, "audit", str(path)], capture_output=True, text=True, timeout=60)
        refused(r, f"{path}:1", "not a ledger line")


def test_regression_an_unbounded_stream_ends_at_the_last_epoch_the_wire_can_name(feeder, stream):
    """epoch=2**32-2, num_epochs=0: the plan reached epoch 2**32, which no cursor can hold, and
    the stream failed INTERNAL, retried until retry_for_s. Now it ends after epoch 2**32-1."""
    from feeder.core.sampler import n_samples

    ds = FeederDataset([feeder.address], job="last-epochs", rank=0, world_size=1, seq_len=256, micro_batch=64,
                       epoch=2**32 - 2, num_epochs=0, retry_for_s=10)
    got = list(ds)
    per_epoch = -(-n_samples(len(stream), 256) // 64)
    assert [b.epoch for b in got] == [2**32 - 2] * per_epoch + [2**32 - 1] * per_epoch

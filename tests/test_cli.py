"""The command line as users run it: subprocesses, exit codes, messages, no tracebacks."""
from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.ipc
import pyarrow.parquet as pq
import pytest

from feeder.sources import manifest as mf
from tests.helpers import make_docs, write_jsonl

FEEDER = [sys.executable, "-m", "feeder.cli"]


def run(*args, **kw):
    return subprocess.run([*FEEDER, *map(str, args)], capture_output=True, text=True, timeout=120, **kw)


def read_stream(out: Path) -> np.ndarray:
    m = mf.read(out)
    parts = []
    for s in m.shards:
        table = pa.ipc.open_file(pa.memory_map(str(out / s.path))).read_all()
        parts.append(table.column("tokens").combine_chunks().values.to_numpy())
    return np.concatenate(parts).astype(np.int64)


def test_prep_byte_contract_over_every_input_kind(tmp_path):
    from feeder.ops.prep import write_tfrecord

    docs = make_docs(30, seed=3)
    jsonl = write_jsonl(tmp_path / "a.jsonl", docs[:20])
    txt = tmp_path / "b.txt"
    txt.write_text("a whole file is one document\nwith two lines ✓\n", encoding="utf-8")
    parquet = tmp_path / "c.parquet"
    pq.write_table(pa.table({"text": docs[20:], "other": list(range(10))}), parquet, row_group_size=3)
    tfrec = tmp_path / "d.tfrecord"
    write_tfrecord(str(tfrec), [[1, 2, 3], [], [255, 0]])
    r = run("prep", jsonl, txt, parquet, tfrec, "--out", tmp_path / "out", "--chunk-tokens", 50,
            "--shard-tokens", 200, "--workers", 2)
    assert r.returncode == 0, r.stderr
    want = []
    for d in docs[:20]:
        want += list(d.encode()) + [256]
    want += list(txt.read_bytes()) + [256]
    for d in docs[20:]:
        want += list(d.encode()) + [256]
    want += [1, 2, 3, 256, 256, 255, 0, 256]
    got = read_stream(tmp_path / "out")
    assert got.tolist() == want
    m = mf.read(tmp_path / "out")
    assert m.vocab_size == 257 and m.eos_id == 256 and m.dtype == "uint16"
    assert m.n_documents == 20 + 1 + 10 + 3 and m.n_tokens == len(want)
    assert len(m.shards) > 1 and all(len(s.chunks) >= 1 for s in m.shards)
    for s in m.shards:
        assert s.sha256 == mf.file_sha256(tmp_path / "out" / s.path)
    assert "prep:" in r.stderr  # progress, as plain lines when not on a terminal


def test_prep_output_does_not_depend_on_the_number_of_workers(tmp_path):
    src = write_jsonl(tmp_path / "a.jsonl", make_docs(500, seed=4))
    fps = []
    for w in (1, 2):
        r = run("prep", src, "--out", tmp_path / f"o{w}", "--workers", w, "--chunk-tokens", 1000, "--quiet")
        assert r.returncode == 0, r.stderr
        fps.append(mf.read(tmp_path / f"o{w}").fingerprint)
    assert fps[0] == fps[1]


def test_prep_with_a_huggingface_tokenizer_file(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    docs = make_docs(200, seed=5)
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(docs, trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "<|endoftext|>"]))
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    src = write_jsonl(tmp_path / "a.jsonl", docs)
    r = run("prep", src, "--out", tmp_path / "out", "--tokenizer", path, "--workers", 2, "--quiet")
    assert r.returncode == 0, r.stderr
    eos = tok.token_to_id("<|endoftext|>")
    want = []
    for d in docs:
        want += tok.encode(d, add_special_tokens=False).ids + [eos]
    assert read_stream(tmp_path / "out").tolist() == want
    m = mf.read(tmp_path / "out")
    assert m.tokenizer["kind"] == "huggingface" and m.eos_id == eos and m.vocab_size == tok.get_vocab_size()


@pytest.mark.parametrize("make,words", [
    (lambda d: ["prep", d / "missing.jsonl", "--out", d / "o"], "missing.jsonl: no such file"),
    (lambda d: ["prep", _bad_jsonl(d), "--out", d / "o"], "bad.jsonl:3: not valid JSON"),
    (lambda d: ["prep", _bad_jsonl(d, '{"txt": 1}'), "--out", d / "o"], "bad.jsonl:3: expected a JSON object"),
    (lambda d: ["prep", write_jsonl(d / "ok.jsonl", ["x"]), "--out", d / "o", "--tokenizer", "gpt7"],
     "unknown tokenizer 'gpt7'"),
    (lambda d: ["prep", _file(d / "x.csv"), "--out", d / "o"], "x.csv: unknown input type"),
    (lambda d: ["serve", "--source", d / "nothing-here"], "does not exist"),
    (lambda d: ["serve", "--source", d, "--listen", "nonsense"], "listen must be HOST:PORT"),
    (lambda d: ["serve", "--source", d / "nothing-here", "--processes", "2"], "does not exist"),
    (lambda d: ["serve", "--source", d, "--processes", "0"], "processes must be a positive integer"),
])
def test_user_mistakes_exit_nonzero_with_a_clear_message(tmp_path, make, words):
    r = run(*make(tmp_path))
    assert r.returncode == 2
    assert words in r.stderr
    assert "Traceback" not in r.stderr


def _bad_jsonl(d: Path, bad: str = "{not json") -> Path:
    p = d / "bad.jsonl"
    p.write_text('{"text": "a"}\n{"text": "b"}\n' + bad + "\n")
    return p


def _file(p: Path) -> Path:
    p.write_text("a,b\n")
    return p


def test_serve_on_a_taken_port_or_metrics_port_exits_with_a_clear_message(tmp_path):
    """A port held by another program, and a second feeder process given the metrics port of
    the first: exit 2 with what to do, no traceback, and no stream ever taken."""
    import socket

    src = write_jsonl(tmp_path / "a.jsonl", make_docs(20, seed=2))
    assert run("prep", src, "--out", tmp_path / "ds", "--quiet").returncode == 0
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        r = run("serve", "--source", tmp_path / "ds", "--listen", f"127.0.0.1:{port}")
        assert r.returncode == 2 and "Traceback" not in r.stderr
        assert f"cannot listen on 127.0.0.1:{port}: the port is taken by another program" in r.stderr
        r = run("serve", "--source", tmp_path / "ds", "--listen", "127.0.0.1:0", "--metrics-port", port)
        assert r.returncode == 2 and "Traceback" not in r.stderr
        assert f"cannot serve metrics on 127.0.0.1:{port}" in r.stderr
        assert "needs a metrics port of its own (--metrics-port)" in r.stderr
        assert "listening on" not in r.stdout


def test_serve_prints_its_address_streams_and_stops_on_sigterm(tmp_path):
    from feeder_client import FeederDataset

    src = write_jsonl(tmp_path / "a.jsonl", make_docs(100, seed=6))
    assert run("prep", src, "--out", tmp_path / "ds", "--quiet").returncode == 0
    proc = subprocess.Popen([*FEEDER, "serve", "--source", str(tmp_path / "ds"), "--listen", "127.0.0.1:0",
                             "--region", "test-1"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert "listening on 127.0.0.1:" in line, proc.stderr.read() if proc.poll() is not None else line
        address = line.split("listening on ")[1].strip()
        assert not address.endswith(":0")
        batches = list(FeederDataset([address], job="cli", rank=0, world_size=2, seq_len=32, micro_batch=4))
        assert batches and all(b.region == "test-1" for b in batches)
        # SIGTERM during a live stream: exit 0 well within 20 s
        it = iter(FeederDataset([address], job="cli2", rank=0, world_size=1, seq_len=8, micro_batch=1,
                                num_epochs=0, read_ahead=1))
        next(it)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
        assert time.monotonic() - t0 < 20
    finally:
        if proc.poll() is None:
            proc.kill()

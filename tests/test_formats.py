"""Corpora in other tools' formats, served in place (issue 19). The files are written by the
formats' own tools (tests/format_writers.py: megatron-core, datasets, streaming, numpy, llm.c's
write_datafile); the reference is `feeder prep` of the same documents (and the packed stream
computed without the feeder's code, tests.helpers.byte_stream): same samples, same ids, every
rank, through real `feeder serve` processes and FeederDataset."""
from __future__ import annotations

import json
import random
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from feeder.core.config import ServeConfig
from feeder.core.errors import Code
from feeder.service.server import ServerThread
from feeder.sources.open import open_source
from feeder_client import FeederDataset
from tests import format_writers as W
from tests.helpers import (FeederProc, byte_stream, check_batches, expected_ids, make_docs, prep_docs, refused,
                           served_until_error, take_killing)

VOCAB = ["--vocab-size", "257", "--eos-id", "256"]     # the byte tokenizer's
SEQ, SEED = 16, 5


def ids_of(docs):
    return [list(d.encode("utf-8")) for d in docs]


@pytest.fixture(scope="module")
def docs():
    return make_docs(240, seed=19)        # some empty documents (i % 17 == 5)


@pytest.fixture(scope="module")
def corpora(tmp_path_factory, docs):
    """{format: (source, documents it holds, serve flags)}, each written by its own tool, in
    several files so that samples cross files (and, where indexed, chunks)."""
    t = tmp_path_factory.mktemp("formats")
    ids = ids_of(docs)
    full = [d for d in docs if d]      # MDS's ndarray encoding refuses an empty array
    out = {}
    (t / "megatron").mkdir()
    for k, part in enumerate((ids[:70], ids[70:160], ids[160:])):
        W.megatron(t / "megatron" / f"corpus_{k:02d}_text_document", part, 256)
    out["megatron"] = (t / "megatron", docs, VOCAB)
    (t / "prefix").mkdir()
    out["megatron-prefix"] = (W.megatron(t / "prefix" / "c_text_document", ids, 256), docs, VOCAB)
    (t / "wide").mkdir()   # int32 ids: what Megatron writes for a vocabulary of 65500 or more
    out["megatron-int32"] = (W.megatron(t / "wide" / "c_text_document", ids, 256, dtype=np.int32), docs, VOCAB)
    out["hf"] = (W.hf(t / "hf", ids), docs, VOCAB)
    out["mds"] = (W.mds(t / "mds", ids_of(full)), full, VOCAB)
    out["mds-bytes"] = (W.mds(t / "mds-bytes", ids_of(full), encoding="bytes", column="tokens"), full,
                        VOCAB + ["--column", "tokens", "--dtype", "int64"])
    out["nanogpt"] = (W.nanogpt(t / "train.bin", ids, 256), docs, VOCAB)
    (t / "llmc").mkdir()
    packed = byte_stream(docs).tolist()
    W.llmc(t / "llmc" / "corpus_train_000000.bin", packed[:9000])
    W.llmc(t / "llmc" / "corpus_train_000001.bin", packed[9000:])
    out["llmc"] = (t / "llmc", docs, VOCAB)
    # Indexed with small chunks, so that samples also cross verified chunks inside a file.
    for name in ("megatron", "nanogpt", "hf"):
        src, _, flags = out[name]
        run("index", src, *flags, "--chunk-tokens", 2500, "--quiet", check=True)
    return out


def run(*args, check=False) -> subprocess.CompletedProcess:
    r = subprocess.run([sys.executable, "-m", "feeder.cli", *map(str, args)], capture_output=True, text=True,
                       timeout=120)
    if check:
        assert r.returncode == 0, r.stderr
    return r


def whole(src) -> np.ndarray:
    out = np.empty(src.n_tokens, src.dtype)
    src.read(0, out)
    return out.astype(np.int64)


def flags_kw(flags):
    it = iter(flags)
    kw = {a.lstrip("-").replace("-", "_"): b for a, b in zip(it, it)}
    return {"vocab_size": int(kw["vocab_size"]), "eos_id": int(kw["eos_id"]), "column": kw.get("column", ""),
            "dtype": kw.get("dtype", "")}


FORMATS = ["megatron", "megatron-prefix", "megatron-int32", "hf", "mds", "mds-bytes", "nanogpt", "llmc"]


@pytest.mark.parametrize("fmt", FORMATS)
def test_each_format_is_the_stream_feeder_prep_makes_of_the_same_documents(fmt, corpora, tmp_path):
    source, docs, flags = corpora[fmt]
    src = open_source(str(source), **flags_kw(flags))
    prepped = open_source(str(prep_docs(tmp_path, docs)))
    np.testing.assert_array_equal(whole(src), whole(prepped))
    np.testing.assert_array_equal(whole(src), byte_stream(docs))
    assert (src.n_tokens, src.vocab_size, src.eos_id) == (prepped.n_tokens, 257, 256)
    if fmt not in ("nanogpt", "llmc"):     # flat files record no document boundaries
        assert src.n_documents == len(docs)
    assert src.verified == (fmt in ("megatron", "nanogpt", "hf"))


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_rank_of_world_1_2_3_gets_the_ids_and_tokens_of_feeder_prep(fmt, corpora):
    source, docs, flags = corpora[fmt]
    stream = byte_stream(docs)
    f = FeederProc(source, extra=flags)
    try:
        for world in (1, 2, 3):
            for rank in range(world):
                ds = FeederDataset([f.address], job=f"{fmt}-{world}", rank=rank, world_size=world, seq_len=SEQ,
                                   micro_batch=8, seed=SEED, read_ahead=2)
                check_batches(list(ds), stream, SEQ, expected_ids(stream, rank, world, SEQ, SEED))
    finally:
        f.stop()


@pytest.mark.parametrize("fmt", ["megatron", "hf", "mds", "llmc"])
def test_resume_from_random_cursors_is_exact(fmt, corpora):
    source, docs, flags = corpora[fmt]
    stream = byte_stream(docs)
    src = open_source(str(source), **flags_kw(flags))
    with ServerThread(ServeConfig(source=str(source), listen="127.0.0.1:0", message_bytes=4096,
                                  **{k: v for k, v in flags_kw(flags).items() if k in ("vocab_size", "eos_id")},
                                  column=flags_kw(flags)["column"], token_dtype=flags_kw(flags)["dtype"])) as srv:
        rng = random.Random(fmt)
        want = expected_ids(stream, 1, 2, SEQ, SEED)
        got, cursor = [], None
        while True:   # a new dataset from the last cursor, every few batches, until the epoch ends
            ds = FeederDataset([srv.address], job=f"resume-{fmt}", rank=1, world_size=2, seq_len=SEQ, micro_batch=4,
                               seed=SEED, cursor=cursor, read_ahead=1)
            take, part = rng.randint(1, 60), []
            for b in ds:
                part.append(b)
                if len(part) == take:
                    break
            got += part
            if len(part) < take:
                break
            cursor = part[-1].cursor
        check_batches(got, stream, SEQ, want)
        assert src.fingerprint   # the cursors carried this source's fingerprint (a mismatch is refused)


@pytest.mark.fault
@pytest.mark.parametrize("fmt", ["megatron-prefix", "mds"])
def test_sigkilled_feeder_fails_over_to_a_feeder_reading_a_copy(fmt, corpora, tmp_path):
    source, docs, flags = corpora[fmt]
    source = Path(source)
    if source.is_dir():
        copy = tmp_path / source.name
        shutil.copytree(source, copy)
    else:   # a Megatron prefix: its two files
        copy = tmp_path / source.name
        for ext in (".bin", ".idx"):
            shutil.copy(f"{source}{ext}", f"{copy}{ext}")
    assert open_source(str(copy), **flags_kw(flags)).fingerprint == \
        open_source(str(source), **flags_kw(flags)).fingerprint     # same bytes, same fingerprint
    stream = byte_stream(docs)
    feeders = [FeederProc(source, extra=flags), FeederProc(copy, extra=flags)]
    try:
        want = expected_ids(stream, 0, 2, SEQ, SEED)
        n_batches = -(-len(want) // 4)
        points = sorted(random.Random(fmt).sample(range(3, n_batches - 3), 6))
        ds = FeederDataset([f.address for f in feeders], job=f"kill-{fmt}", rank=0, world_size=2, seq_len=SEQ,
                           micro_batch=4, seed=SEED, read_ahead=2, retry_for_s=60)
        got, kills = take_killing(ds, feeders, points)
        assert kills == len(points)
        check_batches(got, stream, SEQ, want)
    finally:
        for f in feeders:
            f.stop()


# ---- bad input: exit 2 with one line at start, or DATA_LOSS naming the file while serving ----

def serve_refused(source, *flags):
    return run("serve", "--source", source, "--listen", "127.0.0.1:0", *flags)


def copy_prefix(prefix: Path, to: Path) -> Path:
    to.mkdir(exist_ok=True)
    for ext in (".bin", ".idx"):
        shutil.copy(f"{prefix}{ext}", to / f"{prefix.name}{ext}")
    return to / prefix.name


def test_truncated_bin_idx_of_other_data_wrong_magic_and_version_refused_at_start(corpora, docs, tmp_path):
    prefix = corpora["megatron-prefix"][0]
    p = copy_prefix(prefix, tmp_path / "trunc")
    data = Path(f"{p}.bin").read_bytes()
    Path(f"{p}.bin").write_bytes(data[:-10])
    refused(serve_refused(p, *VOCAB), f"{p}.bin", "truncated")

    other = W.megatron(tmp_path / "other", ids_of(docs[:50]), 256)   # an index of other documents
    p = copy_prefix(prefix, tmp_path / "mixed")
    shutil.copy(f"{other}.idx", f"{p}.idx")
    refused(serve_refused(p, *VOCAB), f"{p}.bin", "index", "describes")

    p = copy_prefix(prefix, tmp_path / "magic")
    idx = bytearray(Path(f"{p}.idx").read_bytes())
    idx[0:7] = b"TNTIDX\x00"
    Path(f"{p}.idx").write_bytes(bytes(idx))
    refused(serve_refused(p, *VOCAB), f"{p}.idx", "not a Megatron index")

    p = copy_prefix(prefix, tmp_path / "version")
    idx = bytearray(Path(f"{p}.idx").read_bytes())
    idx[9] = 2
    Path(f"{p}.idx").write_bytes(bytes(idx))
    refused(serve_refused(p, *VOCAB), f"{p}.idx", "version 2")

    llmc = tmp_path / "llmc.bin"
    shutil.copy(corpora["llmc"][0] / "corpus_train_000000.bin", llmc)
    head = bytearray(llmc.read_bytes())
    head[4] = 3                                   # header[1], the version
    llmc.write_bytes(bytes(head))
    refused(serve_refused(llmc, *VOCAB), str(llmc), "version 3")
    llmc.write_bytes(bytes(head[:-7]))            # truncated too: the version is reported first
    head[4] = 1
    llmc.write_bytes(bytes(head[:-7]))
    refused(serve_refused(llmc, *VOCAB), str(llmc), "truncated")


def test_unknown_column_unrecognized_directory_and_missing_vocabulary_refused_at_start(corpora, tmp_path):
    refused(serve_refused(corpora["hf"][0], *VOCAB, "--column", "labels"), "no column 'labels'", "input_ids",
            "--column")
    refused(serve_refused(corpora["mds"][0], *VOCAB, "--column", "labels"), "no column 'labels'", "--column")
    refused(serve_refused(corpora["mds-bytes"][0], *VOCAB, "--column", "tokens"), "bytes", "--dtype")
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "notes.txt").write_text("hello")
    refused(serve_refused(tmp_path / "junk"), "no dataset format recognized", "Megatron", "MDS", "llm.c")
    refused(serve_refused(corpora["megatron"][0]), "does not record its vocabulary", "--vocab-size")
    import datasets

    one = datasets.load_from_disk(str(corpora["hf"][0]))
    datasets.DatasetDict({"train": one, "test": one}).save_to_disk(str(tmp_path / "dict"))
    refused(serve_refused(tmp_path / "dict", *VOCAB), "DatasetDict of splits train, test", f"{tmp_path / 'dict' / 'train'}")


def test_token_id_beyond_the_vocabulary_is_data_loss_naming_file_and_offset(tmp_path, docs):
    ids = ids_of(docs)
    flat = np.asarray([t for d in ids for t in d + [256]], dtype=np.uint16)
    bad_at = len(flat) * 2 // 3
    flat[bad_at] = 300
    path = tmp_path / "train.bin"
    flat.tofile(path)
    with ServerThread(ServeConfig(source=str(path), listen="127.0.0.1:0", vocab_size=257, eos_id=256)) as srv:
        served, err = served_until_error(FeederDataset([srv.address], job="vocab", rank=0, world_size=1, seq_len=SEQ,
                                                       micro_batch=4, shuffle=False, retry_for_s=2))
    assert err.code == Code.DATA_LOSS
    assert str(path) in str(err) and f"byte offset {bad_at * 2}" in str(err) and "300" in str(err)
    assert served == []          # the file is one chunk (16 Mi tokens a chunk), and that chunk holds the bad id
    # `feeder index` refuses it too, with the same words.
    refused(run("index", path, *VOCAB, "--quiet", "--out", tmp_path / "side"), str(path), f"byte offset {bad_at * 2}")

    bad = [list(d) for d in ids]
    bad[100] = bad[100][:1] + [70000] + bad[100][1:] if bad[100] else [70000]
    W.hf(tmp_path / "hf", bad)
    with ServerThread(ServeConfig(source=str(tmp_path / "hf"), listen="127.0.0.1:0", vocab_size=257,
                                  eos_id=256)) as srv:
        served, err = served_until_error(FeederDataset([srv.address], job="vocab-hf", rank=0, world_size=1,
                                                       seq_len=SEQ, micro_batch=4, shuffle=False, retry_for_s=2))
    assert err.code == Code.DATA_LOSS
    assert served      # the first file's record batch came; nothing of the second, which holds the bad id
    check_batches(served, byte_stream(docs), SEQ, list(range(sum(len(b.sample_ids) for b in served))))
    assert "data-00001-of-00003.arrow" in str(err) and "row 20 " in str(err) and "70000" in str(err)


def test_mds_shard_with_a_flipped_byte_is_data_loss_with_a_sidecar(corpora, tmp_path):
    source, docs, flags = corpora["mds"]
    copy = tmp_path / "mds"
    shutil.copytree(source, copy)
    run("index", copy, *flags, "--quiet", check=True)
    shard = copy / "shard.00002.mds"
    data = bytearray(shard.read_bytes())
    # An 'e' in the middle becomes a 'd': a token value (not a size or header byte), still in the
    # vocabulary, and outside the ends a fingerprint without a sidecar reads.
    at = data.index(b"e", len(data) // 2)
    assert 4096 < at < len(data) - 4096
    data[at] ^= 0x01
    shard.write_bytes(bytes(data))
    with ServerThread(ServeConfig(source=str(copy), listen="127.0.0.1:0", vocab_size=257, eos_id=256)) as srv:
        served, err = served_until_error(FeederDataset([srv.address], job="flip", rank=0, world_size=1, seq_len=SEQ,
                                                       micro_batch=4, shuffle=False, retry_for_s=2))
    assert err.code == Code.DATA_LOSS
    assert "shard.00002.mds" in str(err) and "sha256" in str(err)
    assert served
    check_batches(served, byte_stream(docs), SEQ, list(range(sum(len(b.sample_ids) for b in served))))


# ---- feeder index ----

def test_index_is_resumable_and_the_same_bytes_have_the_same_fingerprint(corpora, tmp_path):
    from feeder.sources.formats import Options
    from feeder.sources.formats.sidecar import index

    source, docs, flags = corpora["nanogpt"]
    opts = Options(**flags_kw(flags), chunk_tokens=1000)
    whole_run = index(str(source), opts, out=str(tmp_path / "a"), progress=False)
    assert whole_run["hashed"] == whole_run["chunks"] > 10
    sidecar = json.loads(Path(whole_run["path"]).read_text())
    # An interrupted run: its partial file holds the key and the first 4 chunks, the last line cut.
    out = tmp_path / "b"
    out.mkdir()
    key_and_lines = [sidecar_key(source, opts)] + [json.dumps([0, ci, sha]) for ci, sha in
                                                   enumerate(sidecar["shards"][0]["sha256"][:4])]
    (out / f"{Path(source).name}.feeder-index.json.partial").write_text("\n".join(key_and_lines) + "\n[0, 4, \"ab")
    resumed = index(str(source), opts, out=str(out), progress=False)
    assert resumed["hashed"] == whole_run["chunks"] - 4
    assert json.loads(Path(resumed["path"]).read_text()) == sidecar
    # Interrupted for real (a chunk read raises, as Ctrl-C would) after 7 chunks: the run goes on from there.
    from feeder.sources.formats.flat import TokenFiles

    calls, real_load = [], TokenFiles.load

    def failing_load(self, si, ci):
        calls.append(ci)
        if len(calls) > 7:
            raise KeyboardInterrupt
        return real_load(self, si, ci)

    TokenFiles.load = failing_load
    try:
        with pytest.raises(KeyboardInterrupt):
            index(str(source), opts, out=str(tmp_path / "d"), workers=1, progress=False)
    finally:
        TokenFiles.load = real_load
    assert not (tmp_path / "d" / f"{Path(source).name}.feeder-index.json").exists()
    again = index(str(source), opts, out=str(tmp_path / "d"), workers=1, progress=False)
    assert again["hashed"] == whole_run["chunks"] - 7
    assert json.loads(Path(again["path"]).read_text()) == sidecar
    # A copy elsewhere: the same fingerprint, indexed or not; served with --index from a read-only place.
    copy = tmp_path / "elsewhere" / "train.bin"
    copy.parent.mkdir()
    shutil.copy(source, copy)
    assert index(str(copy), opts, out=str(tmp_path / "c"), progress=False)["fingerprint"] == whole_run["fingerprint"]
    served = open_source(str(copy), **flags_kw(flags), index=str(tmp_path / "c"))
    assert served.verified and served.fingerprint == whole_run["fingerprint"]
    # Without sidecars, two copies have the same (sizes-and-headers) fingerprint too.
    other = tmp_path / "third" / "train.bin"
    other.parent.mkdir()
    shutil.copy(source, other)
    unverified = open_source(str(copy), **flags_kw(flags))
    assert not unverified.verified and unverified.fingerprint == open_source(str(other), **flags_kw(flags)).fingerprint
    # A sidecar made with other flags is refused with one line.
    refused(serve_refused(copy, "--vocab-size", "300", "--eos-id", "256", "--index", tmp_path / "c"),
            "vocab_size=257", "feeder index")


def sidecar_key(source, opts):
    import hashlib
    from dataclasses import replace

    from feeder.sources.formats import open_format
    from feeder.sources.formats.sidecar import _table

    reader = open_format(str(source), replace(opts, index=""))
    return hashlib.sha256(json.dumps(_table(reader), sort_keys=True).encode()).hexdigest()


def test_a_mixture_of_two_formats_is_exact(tmp_path):
    """Megatron files and a Hugging Face save_to_disk directory, mixed 60/40 (issue 18's rules):
    every rank of world 2 gets the oracle's (source, id) pairs, each sample the tokens of its
    own source, and resuming from a cursor in the middle goes on exactly."""
    from tests.mixture_oracle import Oracle

    a_docs, b_docs = make_docs(120, seed=31), make_docs(80, seed=32)
    (tmp_path / "meg").mkdir()
    meg = W.megatron(tmp_path / "meg" / "a_text_document", ids_of(a_docs), 256)
    hf = W.hf(tmp_path / "hf", ids_of(b_docs))
    streams = [byte_stream(a_docs), byte_stream(b_docs)]
    sizes = [(len(s) - 1) // SEQ for s in streams]
    oracle = Oracle(("web", "code"), sizes, (0.6, 0.4), sum(sizes), seed=SEED, shuffle=True, drop_last=False)
    f = FeederProc(None, source=f"web={meg}", extra=["--source", f"code={hf}", *VOCAB])
    try:
        for rank in (0, 1):
            kw = dict(job="two-formats", rank=rank, world_size=2, seq_len=SEQ, micro_batch=3, seed=SEED,
                      mixture={"web": 0.6, "code": 0.4}, num_epochs=2, retry_for_s=20)
            got = []
            for b in FeederDataset([f.address], **kw):
                got.append(b)
            pairs = {e: [p for b in got if b.epoch == e for p in zip(b.sources.tolist(), b.sample_ids.tolist())]
                     for e in (0, 1)}
            assert pairs[0] == oracle.rank(2, rank, 0) and pairs[1] == oracle.rank(2, rank, 1)
            for b in got:
                for d, i, row in zip(b.sources.tolist(), b.sample_ids.tolist(), b.tokens.numpy()):
                    assert (row == streams[d][i * SEQ:i * SEQ + SEQ + 1]).all()
            cut = len(got) // 3
            rest = list(FeederDataset([f.address], cursor=got[cut].cursor, **kw))
            assert [(b.epoch, b.step, b.sample_ids.tolist(), b.sources.tolist()) for b in rest] == \
                [(b.epoch, b.step, b.sample_ids.tolist(), b.sources.tolist()) for b in got[cut + 1:]]
    finally:
        f.stop()

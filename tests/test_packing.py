"""Document-aware samples (issue 27): boundaries served with every batch, for every format, and
best-fit packing. References are computed here from the documents themselves (their lengths,
as the byte tokenizer makes them), without the feeder's code: a document of d bytes is d + 1
tokens with its EOS, and starts where the ones before it end."""
from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from feeder.config import ServeConfig
from feeder.service.server import ServerThread
from feeder_client import FeederDataset
from tests import format_writers as W
from tests.helpers import byte_stream, expected_ids, make_docs, prep_docs

SEQ, SEED, EOS = 16, 7, 256


def ids_of(docs):
    return [list(d.encode("utf-8")) for d in docs]


def doc_starts(docs) -> list[int]:
    """Where each document starts in the packed stream: after the previous one and its EOS."""
    out, at = [], 0
    for d in docs:
        out.append(at)
        at += len(d.encode("utf-8")) + 1
    return out


def window_starts(starts: list[int], i: int) -> list[int]:
    """The documents starting inside sample i (tokens [i·SEQ, i·SEQ + SEQ + 1)), as offsets."""
    return [s - i * SEQ for s in starts if i * SEQ <= s < i * SEQ + SEQ + 1]


def positions(inside: list[int], length: int = SEQ + 1) -> list[int]:
    """Megatron's reset_position_ids over the SEQ inputs: counting from the latest start (or the
    sample's first token; or the padding's)."""
    cuts = sorted(set(inside) | ({length} if length < SEQ + 1 else set()))
    return [j - max([0] + [c for c in cuts if c <= j]) for j in range(SEQ)]


def check_boundaries(batch, starts_of) -> None:
    """A batch's position_ids and cu_seqlens are those of the documents `starts_of(id)`."""
    n = len(batch.sample_ids)
    cu = [0]
    for r, i in enumerate(batch.sample_ids.tolist()):
        inside = starts_of(i)
        assert batch.position_ids[r].tolist() == positions(inside), (i, inside)
        cu += [r * SEQ + s for s in sorted(set(inside)) if 0 < s < SEQ] + [(r + 1) * SEQ]
    assert batch.cu_seqlens.tolist() == cu
    assert batch.position_ids.shape == (n, SEQ) and batch.cu_seqlens.dtype.is_floating_point is False


@pytest.fixture(scope="module")
def docs():
    return make_docs(200, seed=27)         # some empty documents (i % 17 == 5): EOS alone


@pytest.fixture(scope="module")
def formats(tmp_path_factory, docs):
    """{name: (path, the documents it holds)}: each format written by its own library."""
    t = tmp_path_factory.mktemp("formats27")
    ids = ids_of(docs)
    full = [d for d in docs if d]          # MDS's ndarray encoding refuses an empty array
    (t / "megatron").mkdir()
    for k, part in enumerate((ids[:70], ids[70:150], ids[150:])):
        W.megatron(t / "megatron" / f"c_{k:02d}_text_document", part, EOS)
    packed = byte_stream(docs).tolist()
    (t / "llmc").mkdir()
    W.llmc(t / "llmc" / "c_000000.bin", packed[:3000])
    W.llmc(t / "llmc" / "c_000001.bin", packed[3000:])
    (t / "parquet").mkdir()
    pq.write_table(pa.table({"tokens": pa.array(ids, type=pa.list_(pa.int32()))}), t / "parquet" / "part-0.parquet",
                   row_group_size=37)
    (t / "prep").mkdir()
    return {"manifest": (prep_docs(t / "prep", docs, shard_tokens=3000, chunk_tokens=700), docs),
            "megatron": (t / "megatron", docs), "hf": (W.hf(t / "hf", ids), docs),
            "mds": (W.mds(t / "mds", ids_of(full)), full), "nanogpt": (W.nanogpt(t / "train.bin", ids, EOS), docs),
            "llmc": (t / "llmc", docs), "parquet": (t / "parquet", docs)}


@pytest.fixture(scope="module")
def feeder(formats):
    srv = ServerThread(ServeConfig(sources=tuple((k, str(p)) for k, (p, _) in formats.items()),
                                   listen="127.0.0.1:0", message_bytes=4096, vocab_size=257, eos_id=EOS))
    yield srv
    srv.stop()


@pytest.mark.parametrize("fmt", ["manifest", "megatron", "hf", "mds", "nanogpt", "llmc", "parquet"])
def test_served_boundaries_are_the_documents_of_every_format_on_worlds_1_2_3(fmt, formats, feeder):
    _, docs = formats[fmt]
    stream, starts = byte_stream(docs), doc_starts(docs)
    for world in (1, 2, 3):
        for rank in range(world):
            ds = FeederDataset([feeder.address], job=f"b-{fmt}-{world}", rank=rank, world_size=world, seq_len=SEQ,
                               micro_batch=8, seed=SEED, dataset=fmt, boundaries=True, read_ahead=2)
            got = []
            for b in ds:
                check_boundaries(b, lambda i: window_starts(starts, i))
                assert not (b.loss_mask == 0).any()                 # concat windows have no padding
                for r, i in enumerate(b.sample_ids.tolist()):
                    assert b.tokens[r].tolist() == stream[i * SEQ:i * SEQ + SEQ + 1].tolist()
                got += b.sample_ids.tolist()
            assert got == expected_ids(stream, rank, world, SEQ, SEED)

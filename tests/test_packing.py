"""Document-aware samples (issue 27): boundaries served with every batch, for every format, and
best-fit packing. References are computed here from the documents themselves (their lengths,
as the byte tokenizer makes them), without the feeder's code: a document of d bytes is d + 1
tokens with its EOS, and starts where the ones before it end."""
from __future__ import annotations

import dataclasses

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from feeder.core.config import PackingConfig, ServeConfig
from feeder.service.server import ServerThread
from feeder.sources import NO_CONTEXT
from feeder_client import FeederDataset
from tests import format_writers as W
from tests.helpers import byte_stream, expected_ids, make_docs, prep_docs

SEQ, SEED, EOS = 16, 7, 256
BLOCK = PackingConfig().block_tokens   # (the default block size: the sidecars' names hold it)


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
def feeder(formats, tmp_path_factory):
    srv = ServerThread(ServeConfig(sources=tuple((k, str(p)) for k, (p, _) in formats.items()),
                                   listen="127.0.0.1:0", message_bytes=4096, vocab_size=257, eos_id=EOS,
                                   ledger=str(tmp_path_factory.mktemp("ledger") / "ledger.jsonl")))
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


# ------------------------------------------------------------------ what a model makes of them

def tiny_llama():
    """transformers' Llama with a small random config (nothing downloaded), deterministic."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=257, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    return LlamaForCausalLM(cfg).to(torch.float64).eval()


def token_losses(model, input_ids, shift_labels, **kw):
    import torch

    with torch.no_grad():
        logits = model(input_ids=input_ids, **kw).logits
    return torch.nn.functional.cross_entropy(logits.transpose(1, 2), shift_labels, ignore_index=-100,
                                             reduction="none")


@pytest.mark.parametrize("packing", ["concat", "best_fit"])
def test_a_packed_batch_with_the_block_mask_gives_each_documents_own_loss(packing, formats, feeder):
    """A tiny Llama on a served batch with the block-diagonal mask from the served boundaries
    gives, token for token, the loss of each document run alone; without it, it does not."""
    import torch

    from feeder_client.packing import block_causal_mask, hf_inputs, segment_ids

    model = tiny_llama()
    ds = FeederDataset([feeder.address], job=f"llama-{packing}", rank=0, world_size=1, seq_len=64, micro_batch=4,
                       seed=SEED, dataset="manifest", packing=packing, boundaries=True, read_ahead=1)
    batch = next(iter(ds))
    ds.client.close()
    x = hf_inputs(batch)
    served = token_losses(model, x["input_ids"], x["shift_labels"], attention_mask=block_causal_mask(batch),
                          position_ids=x["position_ids"])
    plain = token_losses(model, x["input_ids"], x["shift_labels"])           # causal over the whole sample
    seg, alone_counted, crossed = segment_ids(batch), 0, 0
    for r in range(len(seg)):
        for s in seg[r].unique().tolist():
            at = (seg[r] == s).nonzero().flatten()
            a, e = int(at[0]), int(at[-1]) + 1
            alone = token_losses(model, x["input_ids"][r:r + 1, a:e], x["shift_labels"][r:r + 1, a:e])[0]
            counted = x["shift_labels"][r, a:e] != -100
            torch.testing.assert_close(served[r, a:e][counted], alone[counted], rtol=1e-9, atol=1e-9)
            alone_counted += int(counted.sum())
            crossed += int(a > 0 and counted.any())
    assert alone_counted > 100 and crossed > 0     # documents after the first in a sample were compared
    counted = x["shift_labels"] != -100
    assert (plain - served)[counted].abs().max() > 1e-3   # without the mask, later documents see earlier ones


def test_megatron_inputs_are_megatrons_own_under_each_flag(feeder):
    """On a corpus whose documents end with EOD, the masks made from the served boundaries are
    those megatron.core's GPTDataset makes by scanning for EOD, under each of its three flags."""
    import itertools

    import torch
    from megatron.core.datasets.gpt_dataset import _get_ltor_masks_and_position_ids

    from feeder_client.packing import megatron_inputs

    ds = FeederDataset([feeder.address], job="megatron-flags", rank=0, world_size=1, seq_len=SEQ, micro_batch=16,
                       seed=SEED, dataset="manifest", boundaries=True, read_ahead=1)
    batch = next(iter(ds))
    ds.client.close()
    for flags in itertools.product((False, True), repeat=3):
        ours = megatron_inputs(batch, eod_token=EOS, reset_position_ids=flags[0], reset_attention_mask=flags[1],
                               eod_mask_loss=flags[2])
        for r in range(len(batch.tokens)):
            mask, loss_mask, pos = _get_ltor_masks_and_position_ids(batch.tokens[r, :-1], EOS, *flags, True)
            assert torch.equal(ours["position_ids"][r], pos), flags
            assert torch.equal(ours["loss_mask"][r], loss_mask), flags
            assert torch.equal(ours["attention_mask"][r], mask), flags
        assert torch.equal(ours["labels"], batch.tokens[:, 1:])


def test_hf_inputs_of_a_bin_are_data_collator_with_flattening_of_its_documents(feeder):
    """A best-fit bin's Hugging Face inputs are what transformers' DataCollatorWithFlattening
    makes of the documents in it (then padding: never a label)."""
    from transformers import DataCollatorWithFlattening

    from feeder_client.packing import hf_inputs

    ds = FeederDataset([feeder.address], job="hf-flat", rank=0, world_size=1, seq_len=64, micro_batch=8,
                       seed=SEED, dataset="manifest", packing="best_fit", read_ahead=1)
    batch = next(iter(ds))
    ds.client.close()
    x = hf_inputs(batch, whole=True)
    collate = DataCollatorWithFlattening(return_position_ids=True, separator_id=-100)
    b, padded = batch.boundaries, 0
    for r, (lo, hi) in enumerate(zip(b.ptr()[:-1], b.ptr()[1:])):
        cuts = [*b.starts[lo:hi].tolist(), int(b.lengths[r])]
        docs = [{"input_ids": batch.tokens[r, a:e].tolist()} for a, e in zip(cuts, cuts[1:])]
        want = collate(docs)
        n = int(b.lengths[r])
        assert x["input_ids"][r, :n].tolist() == want["input_ids"][0].tolist()
        assert x["position_ids"][r, :n].tolist() == want["position_ids"][0].tolist()
        assert x["labels"][r, :n].tolist() == want["labels"][0].tolist()
        assert (x["labels"][r, n:] == -100).all()
        padded += 65 - n
    assert padded > 0 and len(batch.tokens) == 8


# ------------------------------------------------------------------------------ best-fit packing

BIN = 64   # seq_len of the packing tests: bins of 65 tokens; many documents are longer


def expected_pieces(docs) -> list[tuple[int, ...]]:
    """What best-fit bins must hold, from the documents alone: each document (with its EOS)
    whole if it fits a bin, else cut into bin-sized pieces and the remainder."""
    out = []
    for d in docs:
        toks = [*d.encode("utf-8"), EOS]
        out += [tuple(toks[a:a + BIN + 1]) for a in range(0, len(toks), BIN + 1)]
    return out


def served_pieces(batches) -> dict[int, list[tuple[int, ...]]]:
    """{bin id: the segments it holds}, from served batches (a bin served twice: the same)."""
    bins = {}
    for b in batches:
        bd = b.boundaries
        ptr = bd.ptr()
        for r, i in enumerate(b.sample_ids.tolist()):
            cuts = [*bd.starts[ptr[r]:ptr[r + 1]].tolist(), int(bd.lengths[r])]
            segs = [tuple(b.tokens[r, a:e].tolist()) for a, e in zip(cuts, cuts[1:])]
            assert bins.setdefault(i, segs) == segs
            assert b.loss_mask[r].tolist() == [1.0] * (int(bd.lengths[r]) - 1) + [0.0] * (BIN + 1 - int(bd.lengths[r]))
    return bins


def packed_epoch(address, job, world, dataset="manifest", **kw):
    out = []
    for rank in range(world):
        ds = FeederDataset([address], job=job, rank=rank, world_size=world, seq_len=BIN, micro_batch=4, seed=SEED,
                           dataset=dataset, packing="best_fit", read_ahead=2, **kw)
        out.append(list(ds))
    return out


def test_best_fit_bins_hold_every_document_whole_and_every_token_once_an_epoch(formats, feeder):
    from collections import Counter

    _, docs = formats["manifest"]
    epoch = packed_epoch(feeder.address, "bf-epoch", 3)
    bins = served_pieces(b for rank in epoch for b in rank)
    n_bins = len(bins)
    assert sorted(bins) == list(range(n_bins))                  # every bin dealt (padding repeats some)
    served = Counter(seg for segs in bins.values() for seg in segs)
    assert served == Counter(expected_pieces(docs))             # whole documents, every token once
    n_tokens = len(byte_stream(docs))
    assert n_bins <= 1.10 * -(-n_tokens // (BIN + 1))           # within 10 % of a perfect packing
    per_rank = -(-n_bins // 3)
    assert [sum(len(b.sample_ids) for b in rank) for rank in epoch] == [per_rank] * 3
    from feeder.ops.status import fetch, render

    line = next(p for p in fetch(feeder.address).packings if p.startswith(f"manifest seq_len {BIN}:"))
    truncated = sum(len(d.encode("utf-8")) + 1 > BIN + 1 for d in docs)
    padding = 1 - n_tokens / (n_bins * (BIN + 1))
    assert f"{len(docs)} documents in {n_bins} bins, {100 * padding:.2f}% padding, {truncated} truncated" in line
    assert "per 10^6 documents" in line and render(fetch(feeder.address), feeder.address).caption
    from feeder.ops.audit import audit

    [verdict] = audit([feeder.cfg.ledger], job="bf-epoch")      # `feeder audit` of the bins, unchanged
    assert verdict["exactly_once"] and verdict["samples"] == n_bins and verdict["n_missing"] == 0


def test_best_fit_resumes_exactly_from_random_cursors(feeder):
    import random

    whole = packed_epoch(feeder.address, "bf-resume", 2)[1]
    for k in random.Random(27).sample(range(len(whole) - 1), 4):
        ds = FeederDataset([feeder.address], job="bf-resume", rank=1, world_size=2, seq_len=BIN, micro_batch=4,
                           seed=SEED, dataset="manifest", packing="best_fit", read_ahead=2, cursor=whole[k].cursor)
        rest = list(ds)
        assert [b.sample_ids.tolist() for b in rest] == [b.sample_ids.tolist() for b in whole[k + 1:]]
        assert all((x.tokens == y.tokens).all() and (x.position_ids == y.position_ids).all()
                   for x, y in zip(rest, whole[k + 1:]))


def test_best_fit_reshards_from_two_ranks_to_three_without_loss_or_repeat(feeder):
    two = [FeederDataset([feeder.address], job="bf-reshard", rank=r, world_size=2, seq_len=BIN, micro_batch=4,
                         seed=SEED, dataset="manifest", packing="best_fit", read_ahead=2) for r in range(2)]
    before, cursors = [], []
    for ds in two:
        it = iter(ds)
        taken = [next(it) for _ in range(5)]
        ds.client.close()
        before += [i for b in taken for i in b.sample_ids.tolist()]
        cursors.append(taken[-1].cursor)
    after = []
    for r in range(3):
        ds = FeederDataset([feeder.address], job="bf-reshard", rank=r, world_size=3, seq_len=BIN, micro_batch=4,
                           seed=SEED, dataset="manifest", packing="best_fit", read_ahead=2, cursor=cursors[0],
                           reshard=True)
        after += [i for b in ds for i in b.sample_ids.tolist()]
    n_bins = len(served_pieces(b for rank in packed_epoch(feeder.address, "bf-count", 1) for b in rank))
    served = before + after
    assert set(served) == set(range(n_bins))
    assert len(served) - n_bins < 3                          # only DistributedSampler's padding repeats


def test_a_mixture_of_a_packed_source_and_another_serves_each_sources_bins_exactly(formats, feeder):
    """Mixture positions draw bins of their sources: the bins the sources serve alone, and a
    resumed mixture goes on exactly."""
    tables = [served_pieces(b for rank in packed_epoch(feeder.address, f"bf-alone-{name}", 1, name) for b in rank)
              for name in ("manifest", "mds")]
    got = list(FeederDataset([feeder.address], job="bf-mix", rank=0, world_size=1, seq_len=BIN, micro_batch=4,
                             seed=SEED, mixture={"manifest": 0.6, "mds": 0.4}, packing="best_fit", read_ahead=2))
    counts = [0, 0]
    for b in got:
        for r, (i, d) in enumerate(zip(b.sample_ids.tolist(), b.sources.tolist())):
            assert served_pieces([dataclasses.replace(b, sample_ids=b.sample_ids[r:r + 1], tokens=b.tokens[r:r + 1],
                                                      boundary_bytes=b.boundaries.part(r, r + 1).to_bytes())])[i] \
                == tables[d][i]
            counts[d] += 1
    assert min(counts) > 10
    k = len(got) // 2
    again = list(FeederDataset([feeder.address], job="bf-mix", rank=0, world_size=1, seq_len=BIN, micro_batch=4,
                               seed=SEED, mixture={"manifest": 0.6, "mds": 0.4}, packing="best_fit", read_ahead=2,
                               cursor=got[k].cursor))
    assert [(b.sample_ids.tolist(), b.sources.tolist()) for b in again] == \
        [(b.sample_ids.tolist(), b.sources.tolist()) for b in got[k + 1:]]


@pytest.mark.fault
def test_best_fit_fails_over_exactly_from_a_sigkilled_feeder_to_one_that_packed_alone(formats, tmp_path):
    """Two feeders with caches of their own each pack the corpus (the same bins: a pure
    function of it); killing the serving one mid-epoch loses and repeats nothing."""
    import random

    from tests.helpers import FeederProc, take_killing

    source, _ = formats["manifest"]
    feeders = [FeederProc(source, extra=["--cache-dir", str(tmp_path / f"cache{k}")]) for k in range(2)]
    common = dict(rank=0, world_size=2, seq_len=BIN, micro_batch=4, seed=SEED, packing="best_fit", read_ahead=2,
                  num_epochs=0)   # no end: every kill breaks a stream the rank must reopen elsewhere
    try:
        n = 600                   # batches: a dozen epochs, more than the transport holds in flight
        ref = iter(FeederDataset([feeders[1].address], job="bf-kill-ref", **common))
        want = [next(ref) for _ in range(n)]
        ref.close()
        points = sorted(random.Random(5).sample(range(2, 150), 3))
        ds = FeederDataset([f.address for f in feeders], job="bf-kill", retry_for_s=60, **common)
        got, kills = take_killing(ds, feeders, points, limit=n)
        assert kills == len(points) and ds.client.failovers >= 1
        ds.client.close()
        assert [b.sample_ids.tolist() for b in got] == [b.sample_ids.tolist() for b in want]
        assert all((x.tokens == y.tokens).all() and (x.cu_seqlens == y.cu_seqlens).all() for x, y in zip(got, want))
        assert all(len(list((tmp_path / f"cache{k}" / "packing").iterdir())) == 1 for k in range(2))
    finally:
        for f in feeders:
            f.stop()


def test_ranks_that_disagree_on_packing_or_boundaries_and_concat_cursors_are_refused(feeder):
    from feeder.core.errors import Code, FeederError

    common = dict(world_size=2, seq_len=BIN, micro_batch=4, seed=SEED, dataset="manifest", read_ahead=1,
                  retry_for_s=5)
    for job, first, second, word in (("dis-pack", {"packing": "best_fit"}, {}, "packing"),
                                     ("dis-bounds", {}, {"boundaries": True}, "boundaries")):
        one = iter(FeederDataset([feeder.address], job=job, rank=0, num_epochs=0, **common, **first))
        next(one)                                   # rank 0 streams (with no end), so the job runs with its values
        with pytest.raises(FeederError) as e:
            next(iter(FeederDataset([feeder.address], job=job, rank=1, num_epochs=0, **common, **second)))
        assert e.value.code == Code.FAILED_PRECONDITION and word in str(e.value)
        one.close()
    concat = next(iter(FeederDataset([feeder.address], job="dis-cursor", rank=0, **common)))
    with pytest.raises(FeederError) as e:
        next(iter(FeederDataset([feeder.address], job="dis-cursor", rank=0, packing="best_fit", cursor=concat.cursor,
                                **common)))
    assert e.value.code == Code.FAILED_PRECONDITION and "packing" in str(e.value)


def test_the_packer_is_best_fit_decreasing_in_c_and_python_alike_and_pads_web_lengths_little():
    """The C packer and its Python twin give the same bins; on web-like (log-normal) lengths
    the padding is far below 3 %; every piece is whole and within its bin."""
    from feeder.core import layout

    rng = np.random.default_rng(27)
    for _ in range(30):
        n, cap = int(rng.integers(1, 400)), int(rng.integers(2, 90))
        lengths = rng.integers(1, cap, size=n).astype(np.uint32)
        order, ptr = np.empty(n, np.int64), np.empty(n + 1, np.int64)
        bins = layout._best_fit(lengths, cap, order, ptr)
        want_order, want_ptr = layout._best_fit_py(lengths, cap)
        assert bins == len(want_ptr) - 1 and (order == want_order).all() and (ptr[:bins + 1] == want_ptr).all()
    lengths = np.maximum(1, rng.lognormal(6, 1.2, size=100_000)).astype(np.int64)   # mean ~ 800 tokens
    starts = np.concatenate(([0], np.cumsum(lengths)[:-1]))
    total = int(lengths.sum())
    p = layout.best_fit(starts, total, 2049)
    assert 1 - total / (p.n_bins * 2049) < 0.03
    counts, at, length, offset = p.pieces(np.arange(p.n_bins))
    assert length.sum() == total and (offset + length <= 2049).all()
    assert sorted(at.tolist()) == sorted(set(at.tolist()))              # each piece once
    doc = np.searchsorted(starts, at, side="right") - 1
    whole = (at == starts[doc]) & (length == lengths[doc])
    assert sorted(doc[whole].tolist()) == np.flatnonzero(lengths <= 2049).tolist()   # each that fits: whole, once


@pytest.mark.kafka
def test_kafka_records_are_documents_when_bounded_and_a_followed_topic_refuses_them(kafka_broker, tmp_path):
    from collections import Counter

    from feeder.core.errors import Code, FeederError
    from tests.test_kafka import publish, topic_name

    docs = make_docs(60, seed=4)
    topic = publish(kafka_broker, docs, tmp_path, topic_name("bounds"))
    ordered = [docs[i] for p in range(3) for i in range(p, len(docs), 3)]   # (partition, offset) order
    starts = doc_starts(ordered)
    with ServerThread(ServeConfig(source=f"kafka://{kafka_broker}/{topic}?mode=follow", listen="127.0.0.1:0")) as srv:
        for ask in ({"boundaries": True}, {"packing": "best_fit"}):
            with pytest.raises(FeederError) as e:
                next(iter(FeederDataset([srv.address], job="follow", rank=0, world_size=1, seq_len=SEQ,
                                        micro_batch=2, num_epochs=0, retry_for_s=5, **ask)))
            assert e.value.code == Code.FAILED_PRECONDITION and repr(topic) in str(e.value) and "follow" in str(e.value)
    with ServerThread(ServeConfig(source=f"kafka://{kafka_broker}/{topic}?spool={tmp_path}",
                                  listen="127.0.0.1:0")) as srv:
        for b in FeederDataset([srv.address], job="bounded", rank=1, world_size=2, seq_len=SEQ, micro_batch=4,
                               seed=SEED, boundaries=True):
            check_boundaries(b, lambda i: window_starts(starts, i))
        bins = served_pieces(FeederDataset([srv.address], job="bounded-bf", rank=0, world_size=1, seq_len=BIN,
                                           micro_batch=4, seed=SEED, packing="best_fit"))
        assert Counter(s for segs in bins.values() for s in segs) == Counter(expected_pieces(ordered))


def test_review_a_damaged_or_misplaced_sidecar_is_built_again(formats, feeder):
    """Found by the outside review: a sidecar was trusted as it lay. Zeroed piece starts were
    served (146 of 147 samples wrong), a seq_len-8 packing copied under the seq_len-16 name was
    served as bins, a truncated array or a bad stats.json failed every stream with UNKNOWN. Each
    is now found when the sidecar is opened (its digest, its figures, its sizes) and built again."""
    from collections import Counter

    from feeder.sources import packed as pk

    _, docs = formats["manifest"]
    want = Counter(expected_pieces(docs))

    def served(job):
        pk._tables.clear()   # (a new process: the sidecar is opened again)
        epoch = packed_epoch(feeder.address, job, 1)
        return Counter(seg for segs in served_pieces(b for rank in epoch for b in rank).values() for seg in segs)

    assert served("bf-side-0") == want
    src = next(t.source for t in pk._tables.values() if t.seq_len == BIN and t.source.name == "manifest")
    where = pk.directory() / pk.identity(src.fingerprint, BIN, BLOCK)

    def zero_starts():
        a = np.load(where / "start.npy", mmap_mode="r+")
        a[:] = 0
        a.flush()

    def other_seq_len():
        pk.packed(src, 8, NO_CONTEXT)
        import shutil

        shutil.rmtree(where)
        shutil.copytree(pk.directory() / pk.identity(src.fingerprint, 8, BLOCK), where)

    def truncate_ptr():
        p = where / "ptr.npy"
        p.write_bytes(p.read_bytes()[:-16])

    def bad_stats():
        (where / "stats.json").write_text("{")

    def other_dataset():   # (issue 44.1) the same documents from another format: another source's sidecar
        other = feeder.engine.sources["megatron"]
        pk.packed(other, BIN, NO_CONTEXT)
        import shutil

        shutil.rmtree(where)
        shutil.copytree(pk.directory() / pk.identity(other.fingerprint, BIN, BLOCK), where)

    def flipped_byte():   # (issue 34)
        from tests.test_cache_damage import flip_a_byte

        flip_a_byte(where / "length.npy", 0.9)

    from feeder.sources import cache

    for k, damage in enumerate((zero_starts, other_seq_len, truncate_ptr, bad_stats, flipped_byte, other_dataset), 1):
        damage()
        before = cache.damaged_counts()["packing"]
        assert served(f"bf-side-{k}") == want, damage.__name__
        assert cache.damaged_counts()["packing"] == before + 1, damage.__name__   # said and counted once
        assert not [p for p in where.parent.iterdir() if ".damaged-" in p.name]


def test_review_the_integrations_inputs_keep_documents_apart_in_a_hugging_face_model(feeder):
    """Found by the outside review: transformers reads packed position_ids as document
    boundaries only without a KV cache, and a model's config asks for one by default; the
    integrations' batch_dict now says use_cache=False, so each document sees only itself."""
    import torch

    from feeder_trainer.integrations.common import batch_dict

    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=257, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                         attn_implementation="sdpa")).train()   # (a config's default: use_cache)
    ds = FeederDataset([feeder.address], job="llama-batch-dict", rank=0, world_size=1, seq_len=255, micro_batch=4,
                       seed=SEED, dataset="manifest", packing="best_fit", boundaries=True, read_ahead=1)
    batch = next(iter(ds))
    ds.client.close()
    x = batch_dict(batch)
    assert x["use_cache"] is False
    with torch.no_grad():
        logits = model(**{k: v for k, v in x.items() if k != "labels"}).logits
        ends = batch.boundaries.lengths.tolist()
        ptr = batch.boundaries.ptr()
        compared = 0
        for r in range(len(ends)):
            cuts = [*batch.boundaries.starts[ptr[r]:ptr[r + 1]].tolist(), ends[r]]
            for a, e in zip(cuts[1:], cuts[2:]):   # a later document in the bin: alone, the same logits
                alone = model(input_ids=batch.tokens[r:r + 1, a:e]).logits[0]
                torch.testing.assert_close(logits[r, a:e], alone, rtol=1e-5, atol=1e-5)
                compared += 1
    assert compared > 0   # (bins of several documents were compared)


def test_review_feeders_whose_bins_differ_refuse_each_others_packed_cursors(tmp_path):
    """Found by the outside review: a flat file rewritten in place with the same size and the same
    first and last 4 KiB keeps its fingerprint, so a feeder that had packed it before and one
    that packed it after took each other's cursors and dealt other bins. The packed cursors'
    fingerprint now holds the bins' digest: refused, marked for another feeder."""
    from feeder.core.errors import Code, FeederError
    from tests.helpers import FeederProc

    docs = make_docs(120, seed=5)
    path = W.nanogpt(tmp_path / "train.bin", ids_of(docs), EOS)
    before = path.read_bytes()
    flags = ["--vocab-size", "257", "--eos-id", str(EOS)]

    def cursor_of(address, job, packing, cursor=None):
        ds = FeederDataset([address], job=job, rank=0, world_size=1, seq_len=BIN, micro_batch=2, seed=SEED,
                           packing=packing, read_ahead=1, retry_for_s=5, cursor=cursor)
        it = iter(ds)
        c = [next(it) for _ in range(3)][-1].cursor
        ds.client.close()
        return c

    a = FeederProc(path, extra=["--cache-dir", str(tmp_path / "a"), *flags])
    try:
        packed, plain = cursor_of(a.address, "bf-a", "best_fit"), cursor_of(a.address, "plain-a", "concat")
    finally:
        a.stop()
    middle = docs[:40] + docs[40:80][::-1] + docs[80:]          # same tokens, other documents' order
    W.nanogpt(path, ids_of(middle), EOS)
    after = path.read_bytes()
    assert len(after) == len(before) and after[:4096] == before[:4096] and after[-4096:] == before[-4096:]
    b = FeederProc(path, extra=["--cache-dir", str(tmp_path / "b"), *flags])
    try:
        cursor_of(b.address, "plain-a", "concat", plain)         # (the same fingerprint: a window cursor goes on)
        ds = FeederDataset([b.address], job="bf-a", rank=0, world_size=1, seq_len=BIN, micro_batch=2, seed=SEED,
                           packing="best_fit", read_ahead=1, retry_for_s=3, cursor=packed)
        with pytest.raises(FeederError) as e:
            next(iter(ds))
    finally:
        b.stop()
    assert e.value.code in (Code.FAILED_PRECONDITION, Code.UNAVAILABLE), e.value
    assert "fingerprint" in str(e.value)


def test_review_a_packing_build_does_not_hold_up_other_packings_or_status(formats, feeder, monkeypatch):
    """Found by the outside review: one lock was held across every build, so while a large
    dataset was packed (minutes at 10^9 documents) `feeder status` timed out and streams of
    packings already built waited. Builds are now locked per (source, seq_len)."""
    import threading
    import time

    from feeder.sources import packed as pk
    from feeder.ops.status import fetch

    packed_epoch(feeder.address, "bf-lock-0", 1)
    src = next(t.source for t in pk._tables.values() if t.seq_len == BIN and t.source.name == "manifest")
    started, release = threading.Event(), threading.Event()
    real = pk.build

    def slow(source, seq_len, where, ctx):
        started.set()
        release.wait(20)
        return real(source, seq_len, where, ctx)

    monkeypatch.setattr(pk, "build", slow)
    import shutil

    shutil.rmtree(pk.directory() / pk.identity(src.fingerprint, 40, BLOCK), ignore_errors=True)   # (an earlier run's)
    pk._tables.pop((src.fingerprint, 40), None)
    other = threading.Thread(target=pk.packed, args=(src, 40, NO_CONTEXT))   # another seq_len: built, slowly
    other.start()
    try:
        assert started.wait(10)
        t0 = time.monotonic()
        assert pk.packed(src, BIN, NO_CONTEXT).seq_len == BIN
        assert fetch(feeder.address).packings
        assert len(packed_epoch(feeder.address, "bf-lock-1", 1)[0]) > 0
        assert time.monotonic() - t0 < 5
    finally:
        release.set()
        other.join(30)


def test_a_document_that_fills_a_bin_exactly_is_not_cut_and_one_token_longer_is():
    """Issue 34 asked whether a document of exactly seq_len + 1 tokens is cut. A bin holds
    seq_len + 1 tokens, and a document is counted with the EOS after it (docs/packing.md, rule 1):
    seq_len tokens and its EOS fill one bin whole, not cut, not counted as truncated; seq_len + 1
    tokens and its EOS are one token longer than a bin: one whole bin, and the EOS as the remainder
    (the code, the oracle and the rule agree)."""
    from feeder.core.layout import best_fit
    from tests.helpers import packed_bins

    seq_len = 8
    exact, longer, short = "a" * seq_len, "b" * (seq_len + 1), "c" * 3
    for docs, bins, cut in (([exact, short], 2, 0), ([longer, short], 2, 1)):
        lengths = np.array([len(d) + 1 for d in docs])
        p = best_fit(np.concatenate([[0], np.cumsum(lengths)[:-1]]), int(lengths.sum()), seq_len + 1)
        assert p.n_bins == bins == len(packed_bins(docs, seq_len)), docs
        assert int(np.count_nonzero(lengths > seq_len + 1)) == cut   # what stats.json calls truncated
        first = p.length[p.ptr[0]:p.ptr[1]].tolist()
        assert first == [seq_len + 1]   # the first document's bin: whole, alone
    oracle = packed_bins([exact, short], seq_len)
    assert oracle[0].tolist() == [*b"a" * seq_len, 256]   # the exact one with its EOS, uncut


# ------------------------------------------------------------- packing helpers on context parallelism

def _member_part(whole: dict, at) -> dict:
    """A member's part of a helper's whole-sample answers: its input positions along the
    sequence (the query rows of an attention mask: Megatron's get_batch_on_this_cp_rank slices
    its dim 2)."""
    import torch

    return {k: v.index_select(2 if k in ("attention_mask", "block_causal_mask") else 1, torch.as_tensor(at))
            for k, v in whole.items()}


@pytest.mark.parametrize("layout,cp_size", [("zigzag", 2), ("contiguous", 2), ("zigzag", 4), ("contiguous", 4)])
def test_review_packing_helpers_give_a_context_parallel_member_its_slice_of_the_whole_samples(layout, cp_size,
                                                                                             feeder, monkeypatch):
    """Issue 44.4: megatron_inputs, hf_inputs, model_inputs, segment_ids and block_causal_mask
    on a served cp_size > 1 best-fit batch are the member's positions of what each gives for the
    whole sample (then Megatron-core's own get_batch_on_this_cp_rank for the zigzag layout);
    hf_inputs(whole=True) is refused in one line."""
    import itertools

    import torch
    from megatron.core import parallel_state, utils as mc_utils

    from feeder.core import context
    from feeder.core.errors import FeederError
    from feeder_client.packing import block_causal_mask, hf_inputs, megatron_inputs, model_inputs, segment_ids

    def first(**kw):
        ds = FeederDataset([feeder.address], rank=0, world_size=1, seq_len=BIN, micro_batch=8, seed=SEED,
                           dataset="manifest", packing="best_fit", read_ahead=1, **kw)
        batch = next(iter(ds))
        ds.client.close()
        return batch

    whole = first(job=f"cp-helpers-whole-{layout}-{cp_size}")
    assert (whole.boundaries.lengths < BIN + 1).any() and whole.boundaries.counts.max() > 1   # padding, documents
    helpers = {"hf_inputs": hf_inputs, "model_inputs": model_inputs, "segment_ids": segment_ids,
               "block_causal_mask": block_causal_mask,
               **{f"megatron_inputs{f}": (lambda b, f=f: megatron_inputs(b, eod_token=EOS, reset_position_ids=f[0],
                                                                          reset_attention_mask=f[1], eod_mask_loss=f[2]))
                  for f in itertools.product((False, True), repeat=3)}}
    for rank in range(cp_size):
        m = first(job=f"cp-helpers-{layout}-{cp_size}", cp_rank=rank, cp_size=cp_size, cp_layout=layout)
        assert m.sample_ids.tolist() == whole.sample_ids.tolist()
        at = context.positions(BIN, cp_size, rank, layout)
        for name, helper in helpers.items():
            got, want = helper(m), helper(whole)
            got, want = (got, want) if isinstance(got, dict) else ({name: got}, {name: want})
            want = _member_part(want, at)
            assert got.keys() == want.keys(), name
            for k in want:
                assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), (name, k, rank)
            if layout == "zigzag" and name.startswith("megatron_inputs"):   # as Megatron-core slices it
                monkeypatch.setattr(parallel_state, "get_context_parallel_world_size", lambda: cp_size)
                monkeypatch.setattr(parallel_state, "get_context_parallel_rank", lambda: rank)
                theirs = mc_utils.get_batch_on_this_cp_rank(dict(helper(whole)))
                assert all(torch.equal(got[k], theirs[k]) for k in want), (name, rank)
        # Ulysses's attention sees every position after its all-to-all: the whole sample's, on asking
        assert torch.equal(block_causal_mask(m, whole_sample=True), block_causal_mask(whole))
        assert torch.equal(segment_ids(m, whole_sample=True), segment_ids(whole))
        with pytest.raises(FeederError, match=r"hf_inputs\(whole=True\) needs all 65 tokens .* call "
                                              r"hf_inputs\(batch\) and train on its shift_labels"):
            hf_inputs(m, whole=True)

"""Unit tests of the Kafka package's pure parts, no broker: the record codec (round trips and
every bad-record kind), the URL options (every option, every bad value's message), the epoch
ranges, and the follow plan's packing and cursors over a scripted reader."""
from __future__ import annotations

import dataclasses
import struct
import time

import numpy as np
import pytest

from feeder.core.config import StreamSpec
from feeder.core.errors import FailedPrecondition, InvalidArgument
from feeder.sources.kafka import (BAD_KINDS, EPOCH_TTL_S, MAGIC, BadRecord, FollowPlan, FollowState, KafkaURL,
                                  decode_record, encode_record, parse_ranges)
from feeder.sources.kafka.codec import HEADER, read_header
from feeder.sources.kafka.ranges import format_ranges

U16, U32 = np.dtype(np.uint16), np.dtype(np.uint32)


def decode(value, *, dtype=U16, vocab_size=300, max_bytes=1 << 20):
    return decode_record(value, dtype=dtype, vocab_size=vocab_size, max_bytes=max_bytes)


def kind_of(value, **kw) -> str:
    with pytest.raises(BadRecord) as e:
        decode(value, **kw)
    assert e.value.kind in BAD_KINDS
    assert str(e.value) == f"{e.value.kind}: {e.value.detail}"
    return e.value.kind


# --------------------------------------------------------------------------- codec: round trips

@pytest.mark.parametrize("vocab_size,dtype", [(300, U16), (65536, U16), (65537, U32), (200_000, U32)])
def test_encode_decode_round_trip_in_the_vocab_id_width(vocab_size, dtype):
    ids = np.array([0, 1, vocab_size - 1, 7, vocab_size // 2], dtype=np.int64)
    value = encode_record(ids, vocab_size=vocab_size, eos_id=vocab_size - 1, tokenizer="byte")
    assert value[:4] == MAGIC
    assert len(value) == HEADER.size + len("byte") + len(ids) * dtype.itemsize
    got = decode(value, dtype=dtype, vocab_size=vocab_size)
    assert got.dtype.itemsize == dtype.itemsize
    assert got.tolist() == ids.tolist()
    assert read_header(value) == (vocab_size, vocab_size - 1)


def test_empty_document_round_trips_as_no_tokens_in_both_formats():
    for value in (encode_record(np.zeros(0, np.int64), vocab_size=300, eos_id=299, tokenizer="t"), b'{"tokens": []}'):
        got = decode(value)
        assert got.size == 0 and got.dtype == U16


def test_json_record_decodes_to_its_ids():
    assert decode(b'{"tokens": [5, 0, 299]}').tolist() == [5, 0, 299]
    assert decode(b' {"tokens": [1]}').tolist() == [1]          # leading space: still JSON
    assert read_header(b'{"tokens": [1]}') is None


def test_tokenizer_name_is_cut_to_255_bytes_and_skipped_on_decode():
    value = encode_record(np.array([3, 4]), vocab_size=300, eos_id=0, tokenizer="x" * 1000)
    assert struct.unpack_from("<4sBBII", value)[2] == 255
    assert decode(value).tolist() == [3, 4]


def test_record_at_the_size_limit_is_served_one_byte_over_is_too_large():
    value = encode_record(np.array([1, 2, 3]), vocab_size=300, eos_id=0, tokenizer="b")
    assert decode(value, max_bytes=len(value)).tolist() == [1, 2, 3]
    assert kind_of(value, max_bytes=len(value) - 1) == "too_large"


# --------------------------------------------------------------------------- codec: every bad kind

BAD = {
    "null value": (None, "empty"),
    "zero bytes": (b"", "empty"),
    "shorter than the header": (MAGIC + b"\x02\x00", "undecodable"),
    "name runs past the end": (HEADER.pack(MAGIC, 2, 200, 300, 0) + b"ab", "undecodable"),
    "payload not whole ids": (HEADER.pack(MAGIC, 2, 0, 300, 0) + b"\x01\x00\x02", "undecodable"),
    "4-byte ids on a 2-byte topic": (HEADER.pack(MAGIC, 4, 0, 300, 0) + b"\x01\x00\x00\x00", "wrong_dtype"),
    "binary id out of vocab": (HEADER.pack(MAGIC, 2, 0, 300, 0) + struct.pack("<HH", 1, 300), "out_of_vocab"),
    "neither format": (b"hello world", "undecodable"),
    "invalid JSON": (b'{"tokens": [1, 2', "undecodable"),
    "JSON not an object": (b" [1, 2]", "undecodable"),
    "JSON without tokens": (b'{"ids": [1]}', "undecodable"),
    "JSON tokens not a list": (b'{"tokens": "12"}', "undecodable"),
    "JSON deep nesting": (b'{"tokens": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "undecodable"),
    "JSON 5000 digits": (b'{"tokens": [' + b"9" * 5000 + b"]}", "undecodable"),
    "JSON float": (b'{"tokens": [1, 2.0]}', "wrong_dtype"),
    "JSON bool": (b'{"tokens": [true]}', "wrong_dtype"),
    "JSON string": (b'{"tokens": ["1"]}', "wrong_dtype"),
    "JSON negative": (b'{"tokens": [-1]}', "out_of_vocab"),
    "JSON at vocab_size": (b'{"tokens": [300]}', "out_of_vocab"),
    "JSON beyond int64": (b'{"tokens": [100000000000000000000000]}', "out_of_vocab"),
    "JSON bad UTF-8": (b'{"tokens": [1]}\xff', "undecodable"),
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_every_bad_record_is_a_bad_record_of_its_kind(name):
    value, kind = BAD[name]
    assert kind_of(value) == kind


def test_every_bad_kind_is_covered():
    assert {kind for _, kind in BAD.values()} | {"too_large"} == set(BAD_KINDS)


def test_bad_record_details_say_what_is_wrong():
    with pytest.raises(BadRecord, match=r"^wrong_dtype: the record holds 4-byte ids, this topic's vocab \(300\) "
                                        r"uses 2-byte ids \(uint16\)$"):
        decode(BAD["4-byte ids on a 2-byte topic"][0])
    with pytest.raises(BadRecord, match=r"^out_of_vocab: token ids must be in \[0, 300\), found 300$"):
        decode(BAD["binary id out of vocab"][0])
    with pytest.raises(BadRecord, match=r"^too_large: 20 bytes, the limit is max_record_bytes=10$"):
        decode(b'{"tokens": [1, 2, 3]}'[:20], max_bytes=10)
    with pytest.raises(BadRecord, match=r"^undecodable: neither a feeder record \(b'FTK1' header\) nor JSON "):
        decode(b"hello world")


@pytest.mark.parametrize("dtype,vocab_size", [(U16, 300), (U16, 65536), (U32, 65537), (U32, 1 << 32)])
def test_binary_records_decode_the_same_with_or_without_the_c_extension(monkeypatch, dtype, vocab_size):
    """_native.c's ids (range check and EOS in one pass, holding the GIL) against numpy's: the
    same ids, the same EOS, the same out-of-vocab refusals, for every length around the
    thresholds where numpy changes how it copies."""
    import feeder.sources.kafka.codec as codec

    if codec._ids is None:
        pytest.fail("the C extension is not built (python setup.py build_ext --inplace)")
    rng = np.random.default_rng(vocab_size)
    top = min(vocab_size, 1 << 32) - 1
    for n in (0, 1, 2, 499, 500, 501, 1200, 5000):
        # an id at vocab_size, where the id width holds one
        for hi in (top, top + 1) if top + 1 <= np.iinfo(dtype).max else (top,):
            ids = rng.integers(0, top + 1, n).astype(np.int64)
            if n:
                ids[rng.integers(n)] = hi
            value = HEADER.pack(MAGIC, dtype.itemsize, 1, min(vocab_size, (1 << 32) - 1), 0) + b"t" + \
                ids.astype(dtype.newbyteorder("<")).tobytes()
            got = {}
            for native in (True, False):
                monkeypatch.setattr(codec, "_ids", codec._ids if native else None)
                for eos in (None, 7):
                    try:
                        out = decode_record(value, dtype=dtype, vocab_size=vocab_size, max_bytes=1 << 30, eos_id=eos)
                        got[native, eos] = (out.dtype, out.tolist())
                    except BadRecord as e:
                        got[native, eos] = str(e)
                monkeypatch.undo()
            assert got[True, None] == got[False, None] and got[True, 7] == got[False, 7], (n, hi)
            if n and hi > top:
                assert got[True, 7] == f"out_of_vocab: token ids must be in [0, {vocab_size}), found {hi}"
            else:
                assert got[True, None] == (dtype, ids.tolist()) and got[True, 7] == (dtype, ids.tolist() + [7])


# --------------------------------------------------------------------------- URL options

def test_url_defaults():
    u = KafkaURL.parse("kafka://h1:9092,h2:9092/topic-a")
    assert u == KafkaURL(bootstrap="h1:9092,h2:9092", topic="topic-a")
    assert (u.mode, u.bad_records, u.vocab_size, u.eos_id, u.max_record_bytes, u.spool, u.group, u.epoch_ttl_s,
            u.window_bytes) == ("bounded", "fail", 0, -1, 16 << 20, "", "", EPOCH_TTL_S, 64 << 20)
    with pytest.raises(dataclasses.FrozenInstanceError):
        u.mode = "follow"


def test_every_url_option_is_read():
    u = KafkaURL.parse("kafka://h:1/t?mode=follow&bad_records=skip&vocab_size=50257&eos_id=50256"
                       "&max_record_bytes=1024&spool=/tmp/sp&group=dash&epoch_ttl_s=2.5&window_bytes=4096")
    assert u == KafkaURL(bootstrap="h:1", topic="t", mode="follow", bad_records="skip", vocab_size=50257,
                         eos_id=50256, max_record_bytes=1024, spool="/tmp/sp", group="dash", epoch_ttl_s=2.5,
                         window_bytes=4096)


def test_command_line_vocab_applies_unless_the_url_names_one():
    u = KafkaURL.parse("kafka://h:1/t", vocab_size=300, eos_id=7)
    assert (u.vocab_size, u.eos_id) == (300, 7)
    u = KafkaURL.parse("kafka://h:1/t?vocab_size=500&eos_id=1", vocab_size=300, eos_id=7)
    assert (u.vocab_size, u.eos_id) == (500, 1)
    assert KafkaURL.parse("kafka://h:1/t?mode=bounded&mode=follow").mode == "follow"   # the last one counts


URL_SHAPE = "a Kafka source is kafka://HOST:PORT[,HOST:PORT]/TOPIC[?options], got "
BAD_URLS = {
    "http://h:1/t": URL_SHAPE + "'http://h:1/t'",
    "kafka:///t": URL_SHAPE + "'kafka:///t'",
    "kafka://h:1": URL_SHAPE + "'kafka://h:1'",
    "kafka://h:1/": URL_SHAPE + "'kafka://h:1/'",
    "kafka://h:1/a/b": URL_SHAPE + "'kafka://h:1/a/b'",
    "kafka://h:1/t?colour=red&mode=follow": "unknown Kafka URL option(s) ['colour']; known: ['bad_records', 'eos_id', "
                                            "'epoch_ttl_s', 'group', 'max_record_bytes', 'mode', 'spool', "
                                            "'vocab_size', 'window_bytes']",
    "kafka://h:1/t?mode=tail": "Kafka URL option mode must be bounded or follow, got 'tail'",
    "kafka://h:1/t?mode=": "Kafka URL option mode must be bounded or follow, got ''",
    "kafka://h:1/t?bad_records=drop": "Kafka URL option bad_records must be fail or skip, got 'drop'",
    "kafka://h:1/t?vocab_size=big": "Kafka URL option vocab_size must be an integer, got 'big'",
    "kafka://h:1/t?vocab_size=1.5": "Kafka URL option vocab_size must be an integer, got '1.5'",
    "kafka://h:1/t?eos_id=": "Kafka URL option eos_id must be an integer, got ''",
    "kafka://h:1/t?max_record_bytes=1e6": "Kafka URL option max_record_bytes must be an integer, got '1e6'",
    "kafka://h:1/t?max_record_bytes=0": "max_record_bytes must be positive, got 0",
    "kafka://h:1/t?max_record_bytes=-5": "max_record_bytes must be positive, got -5",
    "kafka://h:1/t?window_bytes=0": "Kafka URL option window_bytes must be positive, got 0",
    "kafka://h:1/t?window_bytes=1M": "Kafka URL option window_bytes must be an integer, got '1M'",
    "kafka://h:1/t?epoch_ttl_s=soon": "Kafka URL option epoch_ttl_s must be a number, got 'soon'",
    "kafka://h:1/t?epoch_ttl_s=0": "Kafka URL option epoch_ttl_s must be a positive number of seconds, got 0.0",
    "kafka://h:1/t?epoch_ttl_s=-1": "Kafka URL option epoch_ttl_s must be a positive number of seconds, got -1.0",
    "kafka://h:1/t?epoch_ttl_s=inf": "Kafka URL option epoch_ttl_s must be a positive number of seconds, got inf",
    "kafka://h:1/t?epoch_ttl_s=nan": "Kafka URL option epoch_ttl_s must be a positive number of seconds, got nan",
}


@pytest.mark.parametrize("url", sorted(BAD_URLS))
def test_every_bad_url_value_is_invalid_argument_with_its_message(url):
    with pytest.raises(InvalidArgument) as e:
        KafkaURL.parse(url)
    assert str(e.value) == BAD_URLS[url]


# --------------------------------------------------------------------------- epoch ranges

def test_ranges_round_trip_and_bad_ranges_are_failed_precondition():
    spans = [(0, 0, 10), (1, 5, 5), (2, 7, 1000)]
    text = format_ranges("my.topic-1", spans)
    assert text == "kafka:my.topic-1:0=0-10,1=5-5,2=7-1000"
    assert parse_ranges(text) == ("my.topic-1", spans)
    for bad in ("kafka:t", "file:t:0=0-1", "kafka:t:0=0", "kafka:t:0=a-1", "kafka:t:0=0-1,", ""):
        with pytest.raises(FailedPrecondition, match=r"is not a Kafka epoch \(kafka:TOPIC:P=LO-HI,\.\.\.\)"):
            parse_ranges(bad)


# --------------------------------------------------------------------------- follow plan, no broker

class ScriptedReader:
    """The FollowReader's interface over in-memory partitions (document j of partition p at
    offset j), interleaved round-robin and dealt k mod W as the real reader does."""

    def __init__(self, parts: list[list[list[int]]], rank: int, world: int, eos: int):
        self.docs, self.rank, self.world, self.eos = parts, rank, world, eos
        self.parts = list(range(len(parts)))
        self.executor, self.lag, self.bad_records, self.closed = None, {}, 0, False

    def first_offsets(self) -> list[int]:
        return [0] * len(self.parts)

    def close(self) -> None:
        self.closed = True

    def records(self, st: FollowState):
        while st.next[st.turn] < len(self.docs[st.turn]):
            j, before = st.turn, st.copy()
            doc = self.docs[j][st.next[j]]
            st.next[j], st.turn, st.k = st.next[j] + 1, (j + 1) % len(self.parts), st.k + 1
            mine = before.k % self.world == self.rank
            yield before, (np.array([*doc, self.eos], dtype=np.uint16) if mine else None)
        yield None   # the tail is reached: a real reader would wait for more


class _Src:
    url = KafkaURL(bootstrap="h:1", topic="t", mode="follow")
    dtype = U16

    def __init__(self):
        self.commits = []

    def commit_taken(self, job, rank, world, offsets):
        self.commits.append((job, rank, world, offsets))


def follow_plan(parts, rank, world, cursor=None, seq_len=5, mb=2):
    spec = StreamSpec(job="j", rank=rank, world_size=world, seq_len=seq_len, micro_batch=mb, num_epochs=0)
    reader = ScriptedReader(parts, rank, world, eos=99)
    return FollowPlan(_Src(), spec, cursor, "fail", reader=reader), reader


class ScriptedTopic(ScriptedReader):
    """A topic of a follow-mode mixture as a Subscription taking every record gives it: the state
    it starts at first, then every record, decoded only where `want(k)` says (noted in `decoded`)."""

    def __init__(self, parts, want):
        super().__init__(parts, 0, 1, eos=99)
        self.want, self.decoded = want, []

    def records(self, st: FollowState):
        yield st.copy(), None
        for item in ScriptedReader.records(self, st):   # (world 1: every record read)
            if item is None:
                break
            before, tokens = item
            if self.want(before.k):
                self.decoded.append(before.k)
                yield before, tokens
            else:
                yield before, None
        while True:   # the tail is reached: a real subscription waits for more
            yield None


class _Topic:
    """A followed KafkaSource as a follow-mode mixture uses it."""
    dtype, vocab_size, eos_id = U16, 100, 99

    def __init__(self, name, parts):
        self.url, self.parts, self.subs = KafkaURL(bootstrap="h:1", topic=name, mode="follow"), parts, []

    def subscribe(self, spec, policy, want=None):
        self.subs.append(ScriptedTopic(self.parts, want))
        return self.subs[-1]


def taken(plan):
    out = []
    for b in plan.batches():
        if b is None:
            return out
        out.append(b)
    return out


def test_follow_plan_packs_this_ranks_records_and_resumes_exactly_from_every_cursor():
    rng = np.random.default_rng(3)
    parts = [[rng.integers(0, 90, rng.integers(0, 9)).tolist() for _ in range(20)] for _ in range(3)]
    for rank in range(2):
        plan, reader = follow_plan(parts, rank, 2)
        batches = taken(plan)
        assert len(batches) >= 3
        # What the rank reads: records k = rank, rank + 2, ... in round-robin order, each + EOS.
        order = [parts[k % 3][k // 3] for k in range(60)]
        stream = np.concatenate([np.array([*d, 99]) for d in order[rank::2]])
        for n, b in enumerate(batches):
            assert b.step == n and b.cursor.step == n + 1
            for row, sample_id in zip(b.tokens, b.ids.tolist()):
                i = sample_id // 2
                assert sample_id % 2 == rank
                assert row.tolist() == stream[i * 5:i * 5 + 6].tolist()
        for n, b in enumerate(batches):
            again, _ = follow_plan(parts, rank, 2, cursor=b.cursor)
            assert again.start.step == n + 1
            rest = taken(again)
            assert [r.tokens.tolist() for r in rest] == [r.tokens.tolist() for r in batches[n + 1:]]
            assert [r.cursor for r in rest] == [r.cursor for r in batches[n + 1:]]
        plan.close()
        assert reader.closed


@pytest.mark.parametrize("native", [True, False], ids=["native", "numpy"])
@pytest.mark.parametrize("seq_len,mb", [(1, 1), (5, 1), (7, 3), (64, 2)])
def test_follow_plan_rows_are_the_ranks_stream_cut_with_or_without_the_c_extension(monkeypatch, native, seq_len,
                                                                                    mb):
    """Samples are cut from the rank's records joined (take_rows: _native.c's rows, or numpy's
    without the extension): whatever the record lengths (empty ones, ones longer than a batch),
    sequence length and micro-batch, and from every cursor."""
    import feeder.sources.kafka.follow as follow

    if not native:
        monkeypatch.setattr(follow, "_rows", None)
    elif follow._rows is None:
        pytest.fail("the C extension is not built (python setup.py build_ext --inplace)")
    rng = np.random.default_rng(seq_len * 10 + mb)
    parts = [[rng.integers(0, 90, rng.choice([0, 1, 3, 40, 300])).tolist() for _ in range(25)] for _ in range(3)]
    order = [parts[k % 3][k // 3] for k in range(75)]
    for rank, world in ((0, 1), (1, 3)):
        stream = np.concatenate([np.array([*d, 99]) for d in order[rank::world]])
        plan, _ = follow_plan(parts, rank, world, seq_len=seq_len, mb=mb)
        batches = taken(plan)
        assert len(batches) == (len(stream) - 1) // seq_len // mb
        for b in batches:
            assert b.tokens.shape == (mb, seq_len + 1) and b.tokens.dtype == np.uint16
            for row, sample_id in zip(b.tokens, b.ids.tolist()):
                i = sample_id // world
                assert row.tolist() == stream[i * seq_len:i * seq_len + seq_len + 1].tolist()
        for n in sorted({int(n) for n in np.linspace(0, len(batches) - 1, 12)}):   # 12 cursors, first to last
            again, _ = follow_plan(parts, rank, world, cursor=batches[n].cursor, seq_len=seq_len, mb=mb)
            assert [r.tokens.tolist() for r in taken(again)] == [r.tokens.tolist() for r in batches[n + 1:]]


def test_take_rows_refuses_pieces_too_short_for_the_rows():
    from feeder.sources.kafka.follow import _rows

    if _rows is None:
        pytest.fail("the C extension is not built (python setup.py build_ext --inplace)")
    pieces = [np.arange(5, dtype=np.uint16), np.arange(3, dtype=np.uint16)]
    assert np.frombuffer(_rows(pieces, 1, 3, 2, 2), dtype=np.uint16).tolist() == [1, 2, 3, 4, 4, 0, 1, 2]
    with pytest.raises(ValueError, match="2 rows of 4 from item 2 need 9 items, the pieces hold 8"):
        _rows(pieces, 2, 3, 2, 2)


def test_follow_streams_opening_together_share_a_metadata_answer_asked_after_they_came(monkeypatch):
    """Streams that wait on the source's lock while one asks where the topic starts share the
    next answer, one asked after they came (single flight: W round trips in a row become a
    few); nothing is kept for a time (a later stream asks again, so a topic given partitions or
    created again is seen at once); each stream gets its own list (its state moves in place)."""
    import threading

    import feeder.sources.kafka.source as source

    first_in, release, asked = threading.Event(), threading.Event(), []

    def watermarks(c, topic, p, bootstrap):
        asked.append(p)
        if len(asked) == 1:   # the first stream's question is slow: the others come meanwhile
            first_in.set()
            assert release.wait(10)
        return (10 * p + (len(asked) - 1) // 3, 99)   # + how many answers were asked before this one

    monkeypatch.setattr(source, "watermarks", watermarks)
    src = object.__new__(source.KafkaSource)
    src.url, src._consumer = KafkaURL(bootstrap="h:1", topic="t", mode="follow"), None
    src._meta_lock, src._recent = threading.Lock(), {}
    got: dict[int, list[int]] = {}

    def open_stream(i):
        got[i] = src._low_watermarks([0, 1, 2])

    first = threading.Thread(target=open_stream, args=(0,))
    first.start()
    assert first_in.wait(10)
    others = [threading.Thread(target=open_stream, args=(i,)) for i in range(1, 8)]
    for t in others:
        t.start()
    time.sleep(0.2)   # (they wait on the lock)
    release.set()
    for t in (first, *others):
        t.join(10)
    assert got[0] == [0, 10, 20]          # the first stream's own answer
    assert asked == [0, 1, 2] * 2         # the seven that came while it asked: one more answer
    assert all(got[i] == [1, 11, 21] for i in range(1, 8)) and len({id(v) for v in got.values()}) == 8
    got[1][1] = 555                       # a stream's state moves in place: no other start moves
    assert got[2] == [1, 11, 21]
    assert src._low_watermarks([0, 1, 2]) == [2, 12, 22] and asked == [0, 1, 2] * 3   # later: asked again


def test_follow_plan_refuses_a_cursor_of_another_stream():
    parts = [[[1, 2, 3]] * 10, [[4, 5]] * 10]
    plan, _ = follow_plan(parts, 0, 1)
    cursor = taken(plan)[0].cursor
    with pytest.raises(FailedPrecondition, match="cursor does not fit this stream: world_size differs: the cursor "
                                                 "has 1, the request has 2"):
        follow_plan(parts, 0, 2, cursor=cursor)
    with pytest.raises(FailedPrecondition, match="topic t had 2 partitions when this cursor was made and has 3 now"):
        follow_plan([*parts, [[6]]], 0, 1, cursor=cursor)
    with pytest.raises(FailedPrecondition, match="dataset fingerprint differs"):
        follow_plan(parts, 0, 1, cursor=dataclasses.replace(cursor, fingerprint="kafka-follow:other"))
    assert cursor.src.partitions == 2 and len(cursor.src.next) == 2


def test_follow_plan_runs_carry_tokens_and_cursors_and_commit_what_the_loop_took():
    """The seam: a follow plan's runs are its batches (one each), with the tokens it read and
    the cursors it wrote; `taken(step)` passes that batch's offsets to the consumer group."""
    from feeder.core.planning import PENDING

    parts = [[[1, 2, 3, 4, 5, 6, 7]] * 6, [[8, 9, 10, 11, 12, 13]] * 6]
    plan, _ = follow_plan(parts, rank=0, world=1)
    runs = []
    for run in plan.runs():
        if run is PENDING:
            break
        runs.append(run)
        if len(runs) == 3:
            break
    batches = list(follow_plan(parts, rank=0, world=1)[0].batches())
    for run, b in zip(runs, batches):
        assert len(run) == 1 and run.step == b.step and run.cursors == (b.cursor,)
        assert np.array_equal(run.tokens, b.tokens) and np.array_equal(run.ids, b.ids)
    plan.taken(1)
    (job, rank, world, offsets), = plan._commit.__self__.commits
    assert (job, rank, world) == ("j", 0, 1) and offsets == plan.offsets_at(1)
    plan.taken(10**6)   # not remembered: nothing to commit
    assert len(plan._commit.__self__.commits) == 1


# --------------------------------------------------------------------------- shared follow window, no broker

class _Msg:
    def __init__(self, offset: int, value: bytes):
        self._o, self._v = offset, value

    def offset(self):
        return self._o

    def value(self):
        return self._v


class _NoConsumer:
    """What FollowWindow._append asks of its consumer, with nothing behind it."""

    def resume(self, parts):
        pass

    def get_watermark_offsets(self, tp, cached=True):
        return 0, -1


def test_follow_window_deals_every_wth_record_drops_over_budget_and_a_dropped_stream_reads_alone():
    """The window's rules without a broker (the fetcher's thread is not started; records go in
    as the fetcher puts them): each stream takes only its own records (k mod W), with the state
    before each; the window keeps to its budget by dropping its oldest records even if a slow
    stream still needs them, which then reads on its own; a stream at the window's tail joins it."""
    from collections import deque

    from feeder.sources.kafka.shared import FollowWindow, Subscription

    record = encode_record(np.arange(40), vocab_size=257, eos_id=256, tokenizer="byte")   # +64 per entry
    url = KafkaURL(bootstrap="h:1", topic="t", mode="follow", window_bytes=10 * (len(record) + 64))
    w = FollowWindow(url, [0, 1], dtype=U16, vocab_size=257, eos_id=256)
    w._thread = "not started"                        # no fetcher: the test appends
    fast, slow = (Subscription(w, policy="fail", job="j", rank=r, world_size=2, low_watermarks=lambda: [0, 0])
                  for r in (0, 1))
    assert w.join(fast, FollowState(next=[0, 0])) and w.join(slow, FollowState(next=[0, 0]))
    queues = [deque(), deque()]

    def produce(n):   # n records on each partition, then into the window in interleave order
        base = produce.next
        for j in range(n):
            queues[0].append(_Msg(base + j, record))
            queues[1].append(_Msg(base + j, record))
        produce.next += n
        w._append(w._seed, queues, _NoConsumer())
    produce.next = 0

    produce(2)                                       # records k = 0..3: p0@0, p1@0, p0@1, p1@1
    got = w.take(fast, wait_s=0)
    assert [(g, e.partition, e.offset) for g, e in got] == [(0, 0, 0), (2, 0, 1)]   # rank 0: k = 0, 2
    assert [e.before.next for _, e in got] == [[0, 0], [1, 1]]
    assert [(g, e.partition) for g, e in w.take(slow, wait_s=0)] == [(1, 1), (3, 1)]  # rank 1: k = 1, 3
    assert w.take(fast, wait_s=0) == []              # at the tail: nothing yet
    # the fast stream goes on; the window holds at most its budget (10 records), so the slow
    # stream's next record is dropped while it still needs it
    for _ in range(6):
        produce(2)
        assert w.take(fast, wait_s=0)
        assert w.figures()["bytes"] <= url.window_bytes
    assert w.take(slow, wait_s=0) is None and w.figures()["dropped"] == 1
    # the slow stream's state is no longer in the window: it reads on its own (join refuses it)...
    assert not w.join(slow, FollowState(next=[2, 2], turn=0, k=4))
    # ...and a stream whose state is the window's tail joins it there
    tail = w._tail
    late = Subscription(w, policy="fail", job="j", rank=1, world_size=2, low_watermarks=lambda: [0, 0])
    assert w.join(late, FollowState(next=list(tail.next), turn=tail.turn, k=tail.k))
    produce(1)
    assert [(g % 2, e.partition) for g, e in w.take(late, wait_s=0)] == [(1, 1)]


def test_follow_mixture_interleaves_by_megatrons_rule_decodes_only_its_slots_and_resumes_from_every_cursor():
    """A follow-mode mixture without a broker (sources/kafka/mixed.py): slot k is the next record
    of the topic Megatron's rule picks at k, slot k is rank k mod W's, packed as one topic's
    records are; a rank decodes only its own slots' records; every cursor resumes exactly."""
    from feeder.core import blend as mx
    from feeder.sources.kafka.mixed import FollowMixPlan
    from tests.mixture_oracle import megatron_blend

    rng = np.random.default_rng(4)
    docs = {n: [[rng.integers(0, 90, rng.integers(0, 9)).tolist() for _ in range(12)] for _ in range(p)]
            for n, p in (("a", 3), ("b", 2))}
    order = {n: [parts[k % len(parts)][k // len(parts)] for k in range(12 * len(parts))] for n, parts in docs.items()}
    names, weights, world = ("a", "b"), mx.normalized([0.6, 0.4]), 2
    index, draw = megatron_blend(weights, 60)
    slots = [order[names[d]][j] for d, j in zip(index, draw)]   # (both topics last past slot 60)

    def plan(rank, cursor=None):
        topics = [_Topic(n, docs[n]) for n in names]
        spec = StreamSpec(job="j", rank=rank, world_size=world, seq_len=5, micro_batch=2, num_epochs=0,
                          mixture=tuple(zip(names, weights)))
        return FollowMixPlan(names, weights, topics, spec, cursor), topics

    for rank in range(world):
        p, topics = plan(rank)
        batches = taken(p)
        assert len(batches) >= 3
        stream = np.concatenate([np.array([*d, 99]) for d in slots[rank::world]])
        for n, b in enumerate(batches):
            assert b.step == n and b.ids.tolist() == [(2 * n + j) * world + rank for j in range(2)]
            for j, row in enumerate(b.tokens):
                i = 2 * n + j
                assert row.tolist() == stream[i * 5:i * 5 + 6].tolist()
        # each topic decoded exactly the records that filled this rank's slots (as far as it read)
        for d, t in enumerate(topics):
            mine = [j for k, (dd, j) in enumerate(zip(index, draw)) if dd == d and k % world == rank]
            assert t.subs[0].decoded == mine[:len(t.subs[0].decoded)] and t.subs[0].decoded
        for n, b in enumerate(batches):
            again, _ = plan(rank, cursor=b.cursor)
            rest = taken(again)
            assert [r.tokens.tolist() for r in rest] == [r.tokens.tolist() for r in batches[n + 1:]], n
            assert [r.cursor for r in rest] == [r.cursor for r in batches[n + 1:]]
    wrong = dataclasses.replace(batches[0].cursor, src=dataclasses.replace(batches[0].cursor.src, weights=(0.5, 0.5)))
    with pytest.raises(FailedPrecondition, match="mixture differs"):
        plan(1, cursor=wrong)
    spec = StreamSpec(job="j", rank=0, world_size=world, seq_len=5, micro_batch=2, num_epochs=0, remix=True,
                      mixture=tuple(zip(names, weights)))
    with pytest.raises(FailedPrecondition, match="follow-mode mixture is not remixed or re-dealt"):
        FollowMixPlan(names, weights, [_Topic(n, docs[n]) for n in names], spec, batches[0].cursor)

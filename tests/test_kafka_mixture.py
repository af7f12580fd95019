"""Mixtures with Kafka topics (issue 26, item 3), against the real broker.

Bounded topics mix by the rules every source follows (docs/mixtures.md): each topic is the job's
frozen epoch of it (its snapshot), and the blending starts from the sizes those have. Checked
against tests/mixture_oracle.py, which knows nothing of Kafka: a bounded topic is the file
dataset of its documents in (partition, offset) order. Follow-mode topics mix record by record
(feeder/sources/kafka/mixed.py), checked against an interleave computed here from the docs.
"""
from __future__ import annotations

import itertools
import random
import signal

import numpy as np
import pytest

from feeder.core.config import ServeConfig
from feeder.core.errors import Code, FeederError
from feeder.core.sampler import n_samples
from feeder.service.server import ServerThread
from feeder_client import FeederDataset
from tests.helpers import FeederProc, byte_stream, make_docs, prep_docs, sample
from tests.mixture_oracle import Oracle, megatron_blend, remixed_rank
from tests.test_kafka import publish, topic_name

pytestmark = pytest.mark.kafka

SEQ, MB, SEED = 16, 4, 5


def by_partition(docs, partitions):
    """The documents as a bounded epoch holds them: `publish` writes document i to partition
    i mod P, and an epoch orders records by (partition, offset)."""
    return [docs[i] for p in range(partitions) for i in range(p, len(docs), partitions)]


@pytest.fixture(scope="module")
def world3(kafka_broker, tmp_path_factory):
    """Two bounded topics ("ta", 3 partitions; "tb", 2) and a file dataset ("files"), with the
    packed stream of each as the oracle reads it, and the --source of each."""
    tmp = tmp_path_factory.mktemp("kmix")
    docs = {"ta": (make_docs(90, seed=51), 3), "tb": (make_docs(60, seed=52), 2), "files": (make_docs(70, seed=53), 0)}
    streams, where = {}, {}
    for name, (d, parts) in docs.items():
        if parts:
            topic = publish(kafka_broker, d, tmp, topic_name(f"kmix-{name}"), partitions=parts)
            where[name] = f"kafka://{kafka_broker}/{topic}"
            streams[name] = byte_stream(by_partition(d, parts))
        else:
            (tmp / name).mkdir()
            where[name] = str(prep_docs(tmp / name, d, shard_tokens=1500, chunk_tokens=400))
            streams[name] = byte_stream(d)
    return streams, where, tmp


def sources(world3, *names, **extra):
    return tuple((n, extra.get(n, world3[1][n])) for n in names)


def sizes_of(streams, names):
    return tuple(n_samples(len(streams[n]), SEQ) for n in names)


def pairs(batches):
    """[(epoch, [(source, id)], tokens, cursor)] of batches."""
    return [(b.epoch, list(zip(b.sources.tolist(), b.sample_ids.tolist())), b.tokens.numpy(), b.cursor)
            for b in batches]


def by_epoch(got):
    out = {}
    for e, p, _, _ in got:
        out.setdefault(e, []).extend(p)
    return out


def check_tokens(streams, names, got):
    for _, ps, tokens, _ in got:
        for (d, i), row in zip(ps, tokens):
            s = streams[names[d]]
            assert (row == s[i * SEQ:i * SEQ + SEQ + 1]).all(), f"sample {i} of {names[d]} differs"


def rank(targets, job, world, r, mixture, **kw):
    kw = {"seq_len": SEQ, "micro_batch": MB, "seed": SEED, "num_epochs": 2, "retry_for_s": 30, **kw}
    return FeederDataset(targets, job=job, rank=r, world_size=world, mixture=mixture, **kw)


def test_bounded_topic_mixtures_equal_the_oracle_on_worlds_1_2_3(world3):
    """Two bounded topics, and a topic and a file source, every rank of worlds 1, 2 and 3 over two
    epochs, id by id and token by token; a followed topic mixed with a bounded one is refused."""
    streams, where, tmp = world3
    follow = ("tf", where["ta"] + "?mode=follow")
    with ServerThread(ServeConfig(sources=(*sources(world3, "ta", "tb", "files"), follow), listen="127.0.0.1:0",
                                  cache_dir=str(tmp / "cache-a"))) as srv:
        for names, weights in ((("ta", "tb"), (0.6, 0.4)), (("ta", "files"), (0.5, 0.5))):
            sizes = sizes_of(streams, names)
            oracle = Oracle(names, sizes, weights, sum(sizes), seed=SEED, shuffle=True, drop_last=False)
            for world in (1, 2, 3):
                for r in range(world):
                    got = pairs(rank([srv.address], f"w{world}-{'+'.join(names)}", world, r, dict(zip(names, weights))))
                    for e in (0, 1):
                        assert by_epoch(got)[e] == oracle.rank(world, r, e), (names, world, r, e)
                    check_tokens(streams, names, got)
        with pytest.raises(FeederError) as e:
            list(rank([srv.address], "refused", 1, 0, {"ta": 1, "tf": 1}, retry_for_s=3))
    assert e.value.code == Code.FAILED_PRECONDITION, e.value
    for words in ("'tf' is a followed Kafka topic (mode=follow)", "'ta' is not", "only with other followed topics"):
        assert words in str(e.value)


def test_bounded_topic_mixtures_fail_over_exactly_after_a_sigkill(world3):
    """Two feeders of one region (one cache directory); the one serving the rank is SIGKILLed
    mid-epoch and the rank goes on on the other from its cursor, exactly: two topics, then a
    topic and files (the killed feeder restarted in between)."""
    streams, where, tmp = world3
    flags = ["--cache-dir", str(tmp / "cache-region")]
    for n in ("tb", "files"):
        flags += ["--source", f"{n}={where[n]}"]
    a, b = (FeederProc(None, source=f"ta={where['ta']}", extra=flags) for _ in range(2))
    try:
        for names, weights in ((("ta", "tb"), (0.3, 0.7)), (("ta", "files"), (0.6, 0.4))):
            sizes = sizes_of(streams, names)
            oracle = Oracle(names, sizes, weights, sum(sizes), seed=SEED, shuffle=True, drop_last=False)
            ds = rank([a.address, b.address], f"kill-{names[1]}", 2, 0, dict(zip(names, weights)), num_epochs=1,
                      micro_batch=2, read_ahead=1, prefer="order")
            got = []
            for k, batch in enumerate(ds):
                got.extend(zip(batch.sources.tolist(), batch.sample_ids.tolist()))
                if k == 15:
                    a.signal(signal.SIGKILL)
            assert ds.client.failovers >= 1
            assert got == oracle.rank(2, 0, 0), names
            a.start()
    finally:
        a.stop()
        b.stop()


def test_bounded_topic_mixture_resumes_on_another_cache_and_remixes_exactly(kafka_broker, world3):
    """Cursors of a mixture name each topic's epoch (its offset ranges): a feeder on another cache
    directory, after records were added to a topic, rebuilds those epochs and goes on exactly
    (a topic and files, two topics); a remix that adds the second topic re-deals the rest of the
    epoch as the oracle says."""
    streams, where, tmp = world3
    names, weights = ("ta", "files"), (0.8, 0.2)
    mix = dict(zip(names, weights))
    both = {"ta": 0.5, "tb": 0.5}
    srcs = sources(world3, "ta", "tb", "files")
    with ServerThread(ServeConfig(sources=srcs, listen="127.0.0.1:0", cache_dir=str(tmp / "cache-b"))) as a:
        whole = {m: pairs(rank([a.address], "resume-" + "+".join(dict(m)), 2, 1, dict(m)))
                 for m in (tuple(mix.items()), tuple(both.items()))}
        cut = random.Random(4).randint(3, 12)
        before = pairs(itertools.islice(rank([a.address], "remix", 2, 0, mix, num_epochs=3), cut))
    # (records the jobs' epochs must not see, published after they started, to the topic both mix)
    publish(kafka_broker, make_docs(30, seed=54), tmp, where["ta"].rsplit("/", 1)[1])
    with ServerThread(ServeConfig(sources=srcs, listen="127.0.0.1:0", cache_dir=str(tmp / "cache-c"))) as b:
        for m, run in whole.items():
            for at in sorted(random.Random(5).sample(range(len(run) - 1), 2)):
                rest = pairs(rank([b.address], "resume-" + "+".join(dict(m)), 2, 1, dict(m), cursor=run[at][3]))
                assert [(e, p) for e, p, _, _ in rest] == [(e, p) for e, p, _, _ in run[at + 1:]], (m, at)
                check_tokens(streams, [n for n, _ in m], rest)
        names3, new_w = ("ta", "files", "tb"), (0.3, 0.2, 0.5)
        after = [pairs(rank([b.address], "remix", 2, r, dict(zip(names3, new_w)), num_epochs=3,
                            cursor=before[-1][3], remix=True)) for r in range(2)]
    sizes = sizes_of(streams, names3)
    for r in range(2):
        want = remixed_rank(names3, sizes, weights, new_w, sizes[0] + sizes[1], world=2, rank=r, base=2 * MB * cut,
                            seed=SEED, epochs=3)
        assert by_epoch(after[r]) == want, f"rank {r}"
        check_tokens(streams, names3, after[r])


# -- follow mode: a weighted interleave of records ---------------------------------------------

def follow_mixture_stream(docs_of, weights, world, r):
    """Rank r's packed tokens of a follow-mode mixture, from the rules (docs/kafka.md): slot k is
    filled by the topic Megatron's rule picks at k, with that topic's next document (published
    round-robin, a topic's interleave is its documents in order), and goes to rank k mod world.
    Only the slots before the first topic runs out are known."""
    index, draw = megatron_blend(weights, sum(len(d) for d in docs_of))
    mine = []
    for k, (d, j) in enumerate(zip(index, draw)):
        if j >= len(docs_of[d]):
            break
        if k % world == r:
            mine.append(docs_of[d][j])
    return byte_stream(mine)


def check_follow_mixture(batches, stream, world, r):
    for k, b in enumerate(b for bt in batches for b in zip(bt.sample_ids.tolist(), bt.tokens.numpy())):
        gid, row = b
        assert gid == k * world + r, (gid, k)
        np.testing.assert_array_equal(row, sample(stream, k, SEQ))


@pytest.fixture(scope="module")
def followed(kafka_broker, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("kmix-follow")
    docs = {"fa": make_docs(200, seed=61), "fb": make_docs(120, seed=62)}
    urls = {n: f"kafka://{kafka_broker}/{publish(kafka_broker, d, tmp, topic_name(f'kmixf-{n}'), partitions=p)}"
                f"?mode=follow" for (n, d), p in zip(docs.items(), (3, 2))}
    return docs, urls


def test_follow_mode_mixture_replays_exactly_after_a_feeder_sigkill(followed):
    """Two followed topics by weight, world 2: rank 1 through a feeder SIGKILLed mid-stream and
    restarted, rank 0 resumed from a cursor on a fresh feeder; both exactly the interleave the
    rules give. A cursor resumed under other weights is refused, naming both mixtures."""
    docs, urls = followed
    names, weights, world = ("fa", "fb"), (0.7, 0.3), 2
    mix = dict(zip(names, weights))
    streams = [follow_mixture_stream([docs[n] for n in names], weights, world, r) for r in range(world)]
    total = [n_samples(len(s), SEQ) // MB for s in streams]
    assert min(total) > 40
    feeder = FeederProc(None, source=f"fa={urls['fa']}", extra=["--source", f"fb={urls['fb']}"])
    try:
        ds = rank([feeder.address], "fmix", world, 1, mix, num_epochs=0, read_ahead=1, retry_for_s=60)
        it = iter(ds)
        got = [next(it) for _ in range(15)]
        feeder.signal(signal.SIGKILL)                      # the feeder dies mid-stream ...
        feeder.start()                                     # ... and comes back on the same address
        got += [next(it) for _ in range(total[1] - 15)]
        assert ds.client.failovers >= 1
        ds.client.close()
    finally:
        feeder.stop()
    check_follow_mixture(got, streams[1], world, 1)
    assert [b.step for b in got] == list(range(len(got)))
    srcs = tuple(urls.items())
    with ServerThread(ServeConfig(sources=srcs, listen="127.0.0.1:0")) as a:   # both ranks share its readers
        both = [rank([a.address], "fmix0", world, r, mix, num_epochs=0, read_ahead=1) for r in range(world)]
        its = [iter(d) for d in both]
        head, again = [], []
        for _ in range(10):
            head.append(next(its[0]))
            again.append(next(its[1]))
        for d in both:
            d.client.close()
    check_follow_mixture(again, streams[1], world, 1)
    with ServerThread(ServeConfig(sources=srcs, listen="127.0.0.1:0")) as b:
        ds = rank([b.address], "fmix0", world, 0, mix, num_epochs=0, read_ahead=1, cursor=head[4].cursor)
        it = iter(ds)
        tail = [next(it) for _ in range(total[0] - 5)]
        ds.client.close()
        with pytest.raises(FeederError) as e:
            next(iter(rank([b.address], "fmix0", world, 0, {"fa": 0.5, "fb": 0.5}, num_epochs=0, retry_for_s=3,
                           cursor=head[4].cursor)))
        with pytest.raises(FeederError) as e2:
            next(iter(rank([b.address], "fmix2", world, 0, mix, num_epochs=0, retry_for_s=3, epoch_samples=100)))
        # (found by the outside review: a follow mixture served packing/boundaries requests as plain windows)
        for kw in ({"packing": "best_fit"}, {"boundaries": True}):
            with pytest.raises(FeederError) as e3:
                next(iter(rank([b.address], f"fmix-{len(kw)}-{next(iter(kw))}", world, 0, mix, num_epochs=0,
                               retry_for_s=3, **kw)))
            assert e3.value.code == Code.FAILED_PRECONDITION and "mode=follow" in str(e3.value), e3.value
    assert e2.value.code == Code.INVALID_ARGUMENT and "epoch_samples (100) has no meaning" in str(e2.value)
    check_follow_mixture(head[:5] + tail, streams[0], world, 0)
    assert e.value.code == Code.FAILED_PRECONDITION, e.value
    assert "mixture differs" in str(e.value) and "fa=0.7" in str(e.value) and "fa=0.5" in str(e.value)

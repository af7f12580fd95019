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

import pytest

from feeder.config import ServeConfig
from feeder.errors import Code, FeederError
from feeder.sampler import n_samples
from feeder.service.server import ServerThread
from feeder_client import FeederDataset
from tests.helpers import FeederProc, byte_stream, make_docs, prep_docs
from tests.mixture_oracle import Oracle, remixed_rank
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


def test_bounded_topic_mixture_fails_over_exactly_after_a_sigkill(world3):
    """Two feeders of one region (one cache directory); the one serving the rank is SIGKILLed
    mid-epoch and the rank goes on on the other from its cursor, exactly."""
    streams, where, tmp = world3
    names, weights = ("ta", "files"), (0.6, 0.4)
    sizes = sizes_of(streams, names)
    oracle = Oracle(names, sizes, weights, sum(sizes), seed=SEED, shuffle=True, drop_last=False)
    flags = ["--cache-dir", str(tmp / "cache-region")]
    for n in ("tb", "files"):
        flags += ["--source", f"{n}={where[n]}"]
    a, b = (FeederProc(None, source=f"ta={where['ta']}", extra=flags) for _ in range(2))
    try:
        ds = rank([a.address, b.address], "kill", 2, 0, dict(zip(names, weights)), num_epochs=1, micro_batch=2,
                  read_ahead=1, prefer="order")
        got = []
        for k, batch in enumerate(ds):
            got.extend(zip(batch.sources.tolist(), batch.sample_ids.tolist()))
            if k == 15:
                a.signal(signal.SIGKILL)
        assert ds.client.failovers >= 1
        assert got == oracle.rank(2, 0, 0)
    finally:
        a.stop()
        b.stop()


def test_bounded_topic_mixture_resumes_on_another_cache_and_remixes_exactly(kafka_broker, world3):
    """Cursors of a mixture name each topic's epoch (its offset ranges): a feeder on another cache
    directory, after records were added to the topic, rebuilds that epoch and goes on exactly;
    a remix that adds the second topic re-deals the rest of the epoch as the oracle says."""
    streams, where, tmp = world3
    names, weights = ("ta", "files"), (0.8, 0.2)
    mix = dict(zip(names, weights))
    srcs = sources(world3, "ta", "tb", "files")
    with ServerThread(ServeConfig(sources=srcs, listen="127.0.0.1:0", cache_dir=str(tmp / "cache-b"))) as a:
        whole = pairs(rank([a.address], "resume", 2, 1, mix))
        cut = random.Random(4).randint(3, 12)
        before = pairs(itertools.islice(rank([a.address], "remix", 2, 0, mix, num_epochs=3), cut))
    # (records the job's epoch must not see, published after it started)
    topic = where["ta"].rsplit("/", 1)[1]
    publish(kafka_broker, make_docs(30, seed=54), tmp, topic)
    with ServerThread(ServeConfig(sources=srcs, listen="127.0.0.1:0", cache_dir=str(tmp / "cache-c"))) as b:
        for at in sorted(random.Random(5).sample(range(len(whole) - 1), 3)):
            rest = pairs(rank([b.address], "resume", 2, 1, mix, cursor=whole[at][3]))
            assert [(e, p) for e, p, _, _ in rest] == [(e, p) for e, p, _, _ in whole[at + 1:]], at
            check_tokens(streams, names, rest)
        names3, new_w = ("ta", "files", "tb"), (0.3, 0.2, 0.5)
        after = [pairs(rank([b.address], "remix", 2, r, dict(zip(names3, new_w)), num_epochs=3,
                            cursor=before[-1][3], remix=True)) for r in range(2)]
    sizes = sizes_of(streams, names3)
    for r in range(2):
        want = remixed_rank(names3, sizes, weights, new_w, sizes[0] + sizes[1], world=2, rank=r, base=2 * MB * cut,
                            seed=SEED, epochs=3)
        assert by_epoch(after[r]) == want, f"rank {r}"
        check_tokens(streams, names3, after[r])

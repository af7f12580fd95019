"""Best-fit bins at scale (issue 35): documents read a token range at a time from each format's
own table, bins packed block by block on threads and by every feeder sharing the cache, the same
bytes whoever built which block; progress noted; a stop ends a build within a block."""
from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from feeder_bench.scale import megatron_corpus
from feeder.core import layout
from feeder.core.errors import Unavailable
from feeder.core.config import PackingConfig
from feeder.sources import Context, pack_blocks, packed, preparing
from feeder.sources.formats import Options, open_any

SEQ, EOS = 16, 256
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def cache(tmp_path):
    """A cache directory of its own (and the process's tables of packings forgotten afterwards)."""
    yield tmp_path / "cache"
    packed._tables.clear()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """A Megatron prefix of 3,000 documents (lognormal lengths, median 12 tokens): a real index."""
    return megatron_corpus(tmp_path_factory.mktemp("mega35"), 3000, seed=35, median=12)


def source(prefix):
    return open_any(str(prefix), Options(vocab_size=257, eos_id=EOS), name="m")


def sidecar(cache_dir: Path, src, block: int) -> dict[str, bytes]:
    where = cache_dir / "packing" / packed.identity(src.fingerprint, SEQ, block)
    return {k: (where / f"{k}.npy").read_bytes() for k in ("ptr", "start", "length")}


def test_bins_follow_the_block_rule_and_one_block_is_the_whole_corpus_pass(corpus, cache):
    """Blocks of B tokens: the documents starting in each, packed on their own, block 0's bins
    first. With B at least the corpus, the bins are one whole-corpus pass (the earlier rule)."""
    src = source(corpus)
    starts, end = src.doc_spans(0, src.n_tokens)
    whole = layout.best_fit(starts, end, SEQ + 1)
    one = packed.packed(src, SEQ, Context(str(cache), packing=PackingConfig(block_tokens=src.n_tokens))).packing
    assert [(one.ptr == whole.ptr).all(), (one.start == whole.start).all(), (one.length == whole.length).all()] \
        == [True] * 3 and one.n_bins == whole.n_bins
    B = 997
    got = packed.packed(src, SEQ, Context(str(cache), packing=PackingConfig(block_tokens=B, workers=3)))
    parts = []
    for b in range(-(-src.n_tokens // B)):
        inside = starts[(starts >= b * B) & (starts < (b + 1) * B)]
        after = starts[starts >= (b + 1) * B]
        parts.append(layout.best_fit(inside, int(after[0]) if len(after) else end, SEQ + 1))
    counts, at, length, _ = got.packing.pieces(np.arange(got.n_samples))
    want = [(int(p.start[i]), int(p.length[i])) for p in parts for i in range(len(p.start))]
    assert list(zip(at.tolist(), length.tolist())) == want
    assert counts.tolist() == [c for p in parts for c in np.diff(p.ptr.astype(np.int64)).tolist()]
    assert got.stats["blocks"] == len(parts) and got.stats["documents"] == len(starts)
    # each document's tokens once: whole where it fits a bin
    assert int(length.sum()) == end - int(starts[0])


CHILD = textwrap.dedent("""
    import sys, time
    from feeder.core.config import PackingConfig
    from feeder.sources import Context, pack_blocks, packed
    from feeder.sources.formats import Options, open_any
    slow = float(sys.argv[3])
    real = pack_blocks.pack_block
    def pack_block(*a, **k):
        time.sleep(slow)        # (a large block's time, so the other builder and the kill find it busy)
        return real(*a, **k)
    pack_blocks.pack_block = pack_block
    ctx = Context(sys.argv[2], packing=PackingConfig(block_tokens=%d, workers=int(sys.argv[4])))
    t = packed.packed(open_any(sys.argv[1], Options(vocab_size=257, eos_id=256), name="m"), %d, ctx)
    print("bins", t.n_samples, flush=True)
""")


def test_the_bins_are_the_same_bytes_by_one_thread_two_threads_and_two_feeders_one_killed(corpus, cache, tmp_path):
    """One builder on one thread, one on two, and two processes sharing a cache directory of which
    one is SIGKILLed mid-build (its block's flock goes with it; the other builds what it left):
    the same three arrays, byte for byte, and nothing left beside the sidecar."""
    B = 701
    src = source(corpus)
    blocks = -(-src.n_tokens // B)
    assert blocks > 40
    script = CHILD % (B, SEQ)

    def run(cache, slow, workers):
        return subprocess.Popen([sys.executable, "-c", script, str(corpus), str(cache), str(slow), str(workers)],
                                cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)

    got = {}
    for name, workers in (("one", 1), ("two", 2)):
        p = run(tmp_path / name, 0, workers)
        assert p.communicate(timeout=120)[0].startswith("bins"), name
        got[name] = sidecar(tmp_path / name, src, B)
    shared = tmp_path / "shared"
    a, b = run(shared, 0.03, 1), run(shared, 0.03, 1)
    parts = shared / "packing" / f"{packed.identity(src.fingerprint, SEQ, B)}.blocks"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:   # both at work, a few blocks done
        if parts.is_dir() and sum(1 for e in parts.iterdir() if e.is_dir() and not e.name.startswith(".")) >= 8:
            break
        time.sleep(0.02)
    a.kill()
    a.wait()
    assert b.communicate(timeout=120)[0].startswith("bins")
    got["shared"] = sidecar(shared, src, B)
    assert got["one"] == got["two"] == got["shared"]
    assert sorted(p.name for p in (shared / "packing").iterdir()) == [packed.identity(src.fingerprint, SEQ, B)]
    # The digest every packed cursor is bound to is sha256(ptr | start | length), as one pass over
    # the joined arrays made it before the join was divided among threads: cursors written then resume.
    where = shared / "packing" / packed.identity(src.fingerprint, SEQ, B)
    want = hashlib.sha256(b"".join(np.load(where / f"{k}.npy").tobytes() for k in ("ptr", "start", "length")))
    assert json.loads((where / "stats.json").read_text())["digest"] == want.hexdigest()


def _build_in_thread(src, ctx) -> tuple[threading.Thread, dict]:
    """packed.packed on a thread of its own, started: `out` gets the error it ended with, if any,
    and when it ended ("at", time.monotonic)."""
    out = {}

    def build():
        try:
            packed.packed(src, SEQ, ctx)
        except Unavailable as e:
            out["error"] = str(e)
        out["at"] = time.monotonic()

    t = threading.Thread(target=build)
    t.start()
    return t, out


def test_a_stop_ends_a_build_within_a_block_leaving_whole_blocks_that_the_next_build_takes_up(
        corpus, cache, monkeypatch):
    """SIGTERM (the server's Context.stopping) while blocks are packed: the build ends within a second with
    UNAVAILABLE; what it leaves is whole blocks only, which a later build uses (one found torn
    is built again). Meanwhile the waiting ranks, `feeder status` and the metrics read its
    progress (preparing)."""
    src = source(corpus)
    ctx = Context(str(cache), packing=PackingConfig(block_tokens=503, workers=2))
    real = pack_blocks.pack_block

    def slow(*a, **k):
        time.sleep(0.05)
        return real(*a, **k)

    monkeypatch.setattr(pack_blocks, "pack_block", slow)
    t, out = _build_in_thread(src, ctx)
    seen = []
    while len(seen) < 3:
        seen += [v for k, v in preparing.current().items() if k.startswith("packing m") and (v["done"] or 0) > 0]
        time.sleep(0.01)
    assert "block" in seen[-1]["what"] and 0 < seen[-1]["done"] < 1
    asked = time.monotonic()
    ctx.stopping.set()
    t.join(5)
    assert not t.is_alive() and out["at"] - asked < 1.0 and "stopping" in out["error"]
    where = packed.directory(str(cache)) / packed.identity(src.fingerprint, SEQ, 503)
    parts = Path(f"{where}.blocks")
    left = [p for p in parts.iterdir() if p.is_dir()]
    assert not where.exists() and left and all(not p.name.startswith(".") for p in left)
    assert all(sorted(f.name for f in p.iterdir()) == ["figures.json", "length.npy", "ptr.npy", "start.npy"]
               for p in left)
    torn = left[0] / "start.npy"    # (as a host crash can leave a block renamed before its data)
    torn.write_bytes(torn.read_bytes()[:128] + bytes(len(torn.read_bytes()) - 128))
    built = []
    monkeypatch.setattr(pack_blocks, "pack_block", lambda *a, **k: built.append(a[1]) or real(*a, **k))
    ctx = Context(str(cache), packing=ctx.packing)   # (a new server: not stopping)
    table = packed.packed(src, SEQ, ctx)
    assert table.stats["blocks"] == len(built) + len(left) - 1 and not parts.exists()
    assert int(left[0].name) in built     # found by the join's check, built again
    assert not preparing.current()
    again = sidecar(cache, src, 503)
    packed._tables.clear()
    packed.packed(src, SEQ, Context(str(cache.parent / "clean"), packing=ctx.packing))
    assert sidecar(cache.parent / "clean", src, 503) == again


def test_a_stop_during_the_join_ends_it_within_a_second_and_the_next_build_joins_the_blocks(
        corpus, cache, monkeypatch):
    """The join (the blocks copied into the sidecar on every thread, hashed in order) hears the stop
    too: at 10^9 documents it writes 13 GB. Stopped mid-join, it leaves the blocks whole and no
    half-written sidecar; the next build joins them, building none, into the same bytes."""
    src = source(corpus)
    ctx = Context(str(cache), packing=PackingConfig(block_tokens=211, workers=2))
    real = pack_blocks._Build._array
    monkeypatch.setattr(pack_blocks._Build, "_array", lambda *a: time.sleep(0.01) or real(*a))
    t, out = _build_in_thread(src, ctx)
    where = packed.directory(str(cache)) / packed.identity(src.fingerprint, SEQ, 211)
    while not list(where.parent.glob(f".{where.name}.*/start.npy")):   # the join under way
        time.sleep(0.005)
    asked = time.monotonic()
    ctx.stopping.set()
    t.join(5)
    assert not t.is_alive() and out["at"] - asked < 1.0 and "stopping" in out["error"]
    assert not where.exists() and not list(where.parent.glob(f".{where.name}.*"))
    blocks = [p for p in Path(f"{where}.blocks").iterdir() if p.is_dir()]
    assert len(blocks) == -(-src.n_tokens // 211)
    monkeypatch.setattr(pack_blocks._Build, "_array", real)
    built = []
    real_pack = pack_blocks.pack_block
    monkeypatch.setattr(pack_blocks, "pack_block", lambda *a, **k: built.append(a[1]) or real_pack(*a, **k))
    packed.packed(src, SEQ, Context(str(cache), packing=ctx.packing))
    assert built == [] and not Path(f"{where}.blocks").exists()
    again = sidecar(cache, src, 211)
    packed._tables.clear()
    packed.packed(src, SEQ, Context(str(cache.parent / "clean"), packing=PackingConfig(block_tokens=211, workers=1)))
    assert sidecar(cache.parent / "clean", src, 211) == again


def test_a_server_stopping_ends_its_packing_build_within_a_second(corpus, cache, monkeypatch):
    """SIGTERM's path (the server's stop: engine.shutdown) ends a build under way for a rank that
    waits for its first bin, within a block, leaving whole blocks only."""
    from feeder.core.config import ServeConfig
    from feeder.service.server import ServerThread
    from feeder_client import FeederDataset

    real = pack_blocks.pack_block
    monkeypatch.setattr(pack_blocks, "pack_block", lambda *a, **k: time.sleep(0.02) or real(*a, **k))
    srv = ServerThread(ServeConfig(sources=(("m", str(corpus)),), listen="127.0.0.1:0", vocab_size=257, eos_id=EOS,
                                   cache_dir=str(cache), packing=PackingConfig(block_tokens=53, workers=2)))

    def first_batch():
        try:
            next(iter(FeederDataset([srv.address], job="stop-35", rank=0, world_size=1, seq_len=SEQ, micro_batch=1,
                                    packing="best_fit", retry_for_s=1)))
        except Exception:   # (the feeder went away: what the rank does then is not this test's)
            pass

    threading.Thread(target=first_batch, daemon=True).start()
    while not any((v["done"] or 0) > 0.05 for k, v in preparing.current().items() if k.startswith("packing m")):
        time.sleep(0.01)
    asked = time.monotonic()
    stopping = threading.Thread(target=srv.stop)
    stopping.start()
    while any(k.startswith("packing m") for k in preparing.current()):
        time.sleep(0.01)
    assert time.monotonic() - asked < 1.0
    stopping.join(30)
    parts = next((cache / "packing").glob("*.blocks"))
    assert not any(p.name.startswith(".") for p in parts.iterdir() if p.is_dir())
    assert not [p for p in (cache / "packing").iterdir() if not p.name.endswith(".blocks")]


def test_a_sidecar_is_checked_a_segment_at_a_time_on_first_use_and_a_damaged_one_is_never_served(
        corpus, cache, monkeypatch):
    """Issue 35's second feeder: opening a built sidecar reads its figures, not its arrays (16 GB
    at 10^9 documents); each segment of the arrays is checked (crc32c) the first time a bin reads
    it. A flipped byte in a segment no bin has read yet is found when one does: nothing of it
    served, the sidecar counted, removed and built again, the same bytes."""
    from feeder.sources import cache as entries

    monkeypatch.setattr(pack_blocks, "SEGMENT", 64)   # (many segments at this size)
    src = source(corpus)
    ctx = Context(str(cache), packing=PackingConfig(block_tokens=701))
    built = packed.packed(src, SEQ, ctx)
    want = built.locate(np.arange(built.n_samples) * SEQ, SEQ + 1).gather(src.dtype)
    sound = sidecar(cache, src, 701)
    packed._tables.clear()   # (another feeder on the cache)
    where = packed.directory(str(cache)) / packed.identity(src.fingerprint, SEQ, 701)
    table = packed.packed(src, SEQ, ctx)
    check = table.first_use
    assert check is not None and not any(ok.any() for ok in check.ok.values())   # nothing read at open
    assert len(check.ok["start"]) > 20
    got = table.locate(np.array([3, 4]) * SEQ, SEQ + 1).gather(src.dtype)
    assert np.array_equal(got, want[[3, 4]])
    assert 0 < sum(int(ok.sum()) for ok in check.ok.values()) <= 6                # a bin's segments, no more

    # a byte flipped in the piece starts of a segment no bin has read
    seg = len(check.ok["start"]) - 2
    victim = int(np.searchsorted(np.asarray(table.packing.ptr), seg * 64 + 1, side="right")) - 1
    header = len((where / "start.npy").read_bytes()) - table.packing.start.nbytes
    with open(where / "start.npy", "r+b") as f:
        f.seek(header + (seg * 64 + 1) * table.packing.start.itemsize)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0x40]))
    packed._tables.clear()
    table = packed.packed(src, SEQ, ctx)                                  # opens: the figures are sound
    assert np.array_equal(table.locate(np.array([0, 1]) * SEQ, SEQ + 1).gather(src.dtype), want[[0, 1]])
    before = entries.damaged_counts()["packing"]
    with pytest.raises(Unavailable, match="found damaged before it was served"):
        table.locate(np.array([victim]) * SEQ, SEQ + 1)
    with pytest.raises(Unavailable):                                      # (and stays refused)
        table.boundaries(np.array([victim]) * SEQ, SEQ + 1)
    assert entries.damaged_counts()["packing"] == before + 1 and not where.exists()
    again = packed.packed(src, SEQ, ctx)                                  # the next plan builds it again
    assert again is not table and sidecar(cache, src, 701) == sound
    assert np.array_equal(again.locate(np.array([victim]) * SEQ, SEQ + 1).gather(src.dtype), want[[victim]])


def _retype(npy: Path, old: bytes, new: bytes) -> None:
    """One .npy header's dtype changed in place (the data's bytes, and so their checks, unchanged)."""
    data = npy.read_bytes()
    at = data.index(old)
    assert at < 128
    npy.write_bytes(data[:at] + new + data[at + len(old):])


@pytest.mark.parametrize("damage", ["start as float32", "length big-endian", "stats.json gone", "a file in its place",
                                    "an empty ptr.npy"])
def test_review_a_sidecar_whose_headers_lie_or_whose_figures_are_gone_is_built_again(corpus, cache, damage):
    """Found by the outside review of the first-use checks: the checks cover the arrays' bytes,
    not the .npy header that says how to read them, so a header whose dtype was changed served
    wrong bins, never counted; a sidecar without its stats.json failed every stream (the rebuild
    could not be renamed over it). Each is now damage: counted once, removed, built again."""
    from feeder.sources import cache as entries

    src = source(corpus)
    ctx = Context(str(cache), packing=PackingConfig(block_tokens=701))
    table = packed.packed(src, SEQ, ctx)
    want = table.locate(np.arange(table.n_samples) * SEQ, SEQ + 1).gather(src.dtype)
    sound = sidecar(cache, src, 701)
    where = packed.directory(str(cache)) / packed.identity(src.fingerprint, SEQ, 701)
    if damage == "start as float32":
        _retype(where / "start.npy", b"'<u4'", b"'<f4'")
    elif damage == "length big-endian":
        _retype(where / "length.npy", b"'<u4'", b"'>u4'")
    elif damage == "stats.json gone":
        (where / "stats.json").unlink()
    elif damage == "an empty ptr.npy":   # (np.load: EOFError, which failed every stream of the dataset)
        (where / "ptr.npy").write_bytes(b"")
    else:
        import shutil

        shutil.rmtree(where)
        where.write_text("not a sidecar")
    packed._tables.clear()
    before = entries.damaged_counts()["packing"]
    again = packed.packed(src, SEQ, ctx)
    assert entries.damaged_counts()["packing"] == before + 1
    assert np.array_equal(again.locate(np.arange(again.n_samples) * SEQ, SEQ + 1).gather(src.dtype), want)
    assert sidecar(cache, src, 701) == sound


def test_review_a_block_whose_header_lies_is_built_again_not_sealed_into_the_sidecar(corpus, cache, monkeypatch):
    """The same blind spot in the blocks a build leaves when it is stopped: a block whose
    start.npy header was changed was joined as it read, its values then sealed by the sidecar's
    fresh checks. The join now checks each block's header too, and builds that block again."""
    src = source(corpus)
    ctx = Context(str(cache), packing=PackingConfig(block_tokens=503, workers=1))
    clean = packed.packed(src, SEQ, Context(str(cache.parent / "clean"), packing=ctx.packing))
    want = clean.locate(np.arange(clean.n_samples) * SEQ, SEQ + 1).gather(src.dtype)
    packed._tables.clear()
    real, built = pack_blocks.pack_block, []

    def stop_after_three(*a, **k):
        if len(built) == 3:
            ctx.stopping.set()
        built.append(a[1])
        return real(*a, **k)

    monkeypatch.setattr(pack_blocks, "pack_block", stop_after_three)
    with pytest.raises(Unavailable):
        packed.packed(src, SEQ, ctx)
    parts = Path(f"{packed.directory(str(cache)) / packed.identity(src.fingerprint, SEQ, 503)}.blocks")
    _retype(parts / "0000000" / "start.npy", b"'<u4'", b"'<f4'")
    again = []
    monkeypatch.setattr(pack_blocks, "pack_block", lambda *a, **k: again.append(a[1]) or real(*a, **k))
    table = packed.packed(src, SEQ, Context(str(cache), packing=ctx.packing))
    assert 0 in again and not {1, 2, 3} & set(again)     # block 0 built again, the sound ones kept
    assert np.array_equal(table.locate(np.arange(table.n_samples) * SEQ, SEQ + 1).gather(src.dtype), want)


def _blocks_only(src, cache: Path, block: int, monkeypatch) -> Path:
    """Every block of a build, built and left as a stopped build leaves them (no join): their directory."""
    where = packed.directory(str(cache)) / packed.identity(src.fingerprint, SEQ, block)
    with monkeypatch.context() as m:
        m.setattr(pack_blocks._Build, "_join", lambda self: None)
        pack_blocks.build(src, SEQ, where, PackingConfig(block_tokens=block, workers=2), lambda *a: None,
                          packed._publish, threading.Event())
    assert not where.exists()
    return Path(f"{where}.blocks")


@pytest.mark.parametrize("damage", ["an empty start.npy", "three blocks flipped", "figures without counts"])
def test_review35_damaged_blocks_at_the_join_are_built_again_in_one_build(corpus, cache, monkeypatch, damage):
    """Found by the outside review of the divided join: an empty array file (what a host crash
    leaves) failed every build with EOFError; three damaged blocks failed the build that rebuilt
    them (three tries of the join in all); figures.json that parses but lacks a count failed it
    with KeyError. Now each damaged block is built again, once, in the one build, and the sidecar
    is a clean build's."""
    src = source(corpus)
    clean = packed.packed(src, SEQ, Context(str(cache.parent / "clean"), packing=PackingConfig(block_tokens=211)))
    sound = sidecar(cache.parent / "clean", src, 211)
    packed._tables.clear()
    parts = _blocks_only(src, cache, 211, monkeypatch)
    hurt = {"an empty start.npy": [11], "three blocks flipped": [3, 20, 30], "figures without counts": [7]}[damage]
    for b in hurt:
        if damage == "an empty start.npy":
            (parts / f"{b:07d}" / "start.npy").write_bytes(b"")
        elif damage == "three blocks flipped":
            f = parts / f"{b:07d}" / "start.npy"
            data = bytearray(f.read_bytes())
            data[-1] ^= 0xFF
            f.write_bytes(bytes(data))
        else:
            (parts / f"{b:07d}" / "figures.json").write_text('{"check": [1, 2, 3]}')
    from feeder.sources import cache as entries

    real, built = pack_blocks.pack_block, []
    monkeypatch.setattr(pack_blocks, "pack_block", lambda *a, **k: built.append(a[1]) or real(*a, **k))
    before = entries.damaged_counts()["packing"]
    table = packed.packed(src, SEQ, Context(str(cache), packing=PackingConfig(block_tokens=211)))
    assert sorted(built) == hurt and table.n_samples == clean.n_samples
    assert entries.damaged_counts()["packing"] == before + len(hurt)   # each counted once
    assert sidecar(cache, src, 211) == sound and not parts.exists()


def test_review35_blocks_left_beside_a_published_sidecar_are_removed_when_it_is_opened(corpus, cache):
    """A joiner killed after the sidecar was put in place but before it removed the blocks left them
    for good (13 GB at 10^9 documents): the next feeder to open the sidecar removes them."""
    src = source(corpus)
    ctx = Context(str(cache), packing=PackingConfig(block_tokens=211))
    packed.packed(src, SEQ, ctx)
    where = packed.directory(str(cache)) / packed.identity(src.fingerprint, SEQ, 211)
    left = Path(f"{where}.blocks") / "0000000"
    left.mkdir(parents=True)
    (left / "start.npy").write_bytes(b"x" * 100)
    packed._tables.clear()
    packed.packed(src, SEQ, ctx)
    assert not Path(f"{where}.blocks").exists() and (where / "stats.json").is_file()

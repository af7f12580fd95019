"""The join of a packing's blocks into its sidecar (feeder.sources.pack_blocks): the parts are
copied by the kernel where the file system can (copy_file_range), written from the bytes the
joiner read and checked where it cannot; either way the same bytes and the same digest. A block
that ends early under the copy is built again; a disk that fills up is said as such."""
from __future__ import annotations

import errno
import hashlib
import json
import os
from pathlib import Path

import numpy as np
import pytest

from feeder.core.config import PackingConfig
from feeder.sources import Context, cache, pack_blocks, packed
from feeder_bench.scale import megatron_corpus
from tests.test_pack_blocks import SEQ, sidecar, source

B = 701   # tokens a block: ~40 blocks of the 3,000-document corpus
ARRAYS = ("ptr", "start", "length")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """test_pack_blocks's corpus: 3,000 Megatron documents, a real index."""
    return megatron_corpus(tmp_path_factory.mktemp("mega35"), 3000, seed=35, median=12)


def build(src, cache_dir) -> dict[str, bytes]:
    try:
        packed.packed(src, SEQ, Context(str(cache_dir), packing=PackingConfig(block_tokens=B, workers=2)))
    finally:
        packed._tables.clear()
    return sidecar(cache_dir, src, B)


def digest_of(cache_dir, src) -> tuple[str, str]:
    """(the digest the sidecar's figures give, sha256 of its joined arrays' bytes)"""
    where = cache_dir / "packing" / packed.identity(src.fingerprint, SEQ, B)
    want = hashlib.sha256(b"".join(np.load(where / f"{k}.npy").tobytes() for k in ARRAYS)).hexdigest()
    return json.loads((where / "stats.json").read_text())["digest"], want


@pytest.mark.parametrize("how", ["refused", "absent"])
def test_the_join_copied_by_the_kernel_or_written_from_what_it_checked_is_the_same_bytes(
        corpus, tmp_path, monkeypatch, how):
    """The kernel's copy (used: counted) against a file system that refuses it (EXDEV, as across
    mounts) and a platform without it: the same three arrays, byte for byte, and the digest each
    sidecar's figures give is its arrays' sha256 (what packed cursors are bound to)."""
    src = source(corpus)
    real, copied = cache.copy_range, []

    def counting(*a):
        copied.append(real(*a))
        return copied[-1]

    monkeypatch.setattr(cache, "copy_range", counting)
    kernel = build(src, tmp_path / "kernel")
    assert copied and all(copied), "the kernel copied no part"
    if how == "refused":
        def refuse(*a):
            raise OSError(errno.EXDEV, "Invalid cross-device link")
        monkeypatch.setattr(os, "copy_file_range", refuse)
    else:
        monkeypatch.delattr(os, "copy_file_range")
    copied.clear()
    other = build(src, tmp_path / how)
    assert copied and not any(copied)
    assert kernel == other
    for name in ("kernel", how):
        got, want = digest_of(tmp_path / name, src)
        assert got == want, name


def test_copy_range_copies_where_asked_and_says_when_the_source_ends_early(tmp_path):
    (tmp_path / "src").write_bytes(bytes(range(256)) * 64)
    with open(tmp_path / "src", "rb") as s, open(tmp_path / "dst", "w+b") as d:
        d.truncate(100)
        assert cache.copy_range(s.fileno(), 1000, d.fileno(), 10, 5000)   # (Linux: what we serve from)
        d.seek(0)
        got = d.read()
        assert got[:10] == bytes(10) and got[10:] == (bytes(range(256)) * 64)[1000:6000]
        with pytest.raises(EOFError, match="ends 2,000 bytes before"):
            cache.copy_range(s.fileno(), 16384 - 3000, d.fileno(), 0, 5000)


@pytest.mark.parametrize("how", ["cut short before the copy", "cut short under the copy",
                                 "a byte flipped under the copy"])
def test_a_block_damaged_after_its_builder_wrote_it_never_reaches_the_sidecar(corpus, tmp_path, monkeypatch, how):
    """Block 5's `start` is damaged on disk at the join (a disk's fault), before the kernel copies
    it or under the copy (after its header was read): the part is checked as it lies in the
    sidecar, so the block is counted damaged and built again, and the sidecar is what a clean
    build gives, its digest its arrays' (review 37: a byte flipped under the copy went into the
    sidecar, its digest that of the bytes checked before)."""
    src = source(corpus)
    clean = build(src, tmp_path / "clean")
    hit = []

    def damage(path):
        if how.startswith("cut"):
            os.truncate(path, os.path.getsize(path) - 16)
        else:
            with open(path, "r+b") as f:
                f.seek(-9, os.SEEK_END)
                byte = f.read(1)[0]
                f.seek(-9, os.SEEK_END)
                f.write(bytes([byte ^ 0x10]))
        hit.append(path.parent.name)

    if how.endswith("before the copy"):
        real = pack_blocks._Build._copy_part

        def copy_part(self, b, k, fd, at, figures):
            if b == 5 and k == "start" and not hit:
                damage(self.block_dir(b) / "start.npy")
            return real(self, b, k, fd, at, figures)

        monkeypatch.setattr(pack_blocks._Build, "_copy_part", copy_part)
    else:
        real = cache.copy_range

        def copy_range(src_fd, src_at, dst, dst_at, n):
            path = Path(os.readlink(f"/proc/self/fd/{src_fd}"))
            if path.parent.name == "0000005" and path.name == "start.npy" and not hit:
                damage(path)
            return real(src_fd, src_at, dst, dst_at, n)

        monkeypatch.setattr(cache, "copy_range", copy_range)
    before = cache.damaged_counts()["packing"]
    assert build(src, tmp_path / "damaged") == clean
    assert hit == ["0000005"]
    assert cache.damaged_counts()["packing"] == before + 1
    got, want = digest_of(tmp_path / "damaged", src)
    assert got == want


def test_a_disk_that_fills_up_under_the_join_is_said_as_such_not_taken_for_a_torn_block(
        corpus, tmp_path, monkeypatch):
    src = source(corpus)

    def full(*a):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "copy_file_range", full)
    before = cache.damaged_counts()["packing"]
    with pytest.raises(OSError) as e:
        build(src, tmp_path / "full")
    assert e.value.errno == errno.ENOSPC
    assert f"joining the packing {packed.identity(src.fingerprint, SEQ, B)} in " in str(e.value)
    assert cache.damaged_counts()["packing"] == before
    where = tmp_path / "full" / "packing"
    assert not (where / packed.identity(src.fingerprint, SEQ, B) / "stats.json").exists()
    assert not list(where.glob(".*")), "the joiner left a half-written sidecar"

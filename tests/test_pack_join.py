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


@pytest.mark.parametrize("when", ["before the copy", "under the copy"])
def test_a_block_cut_short_after_its_check_never_reaches_the_sidecar(corpus, tmp_path, monkeypatch, when):
    """Block 5's `start` is cut short after the joiner read and checked it (a disk's fault).
    Found before the copy (the file is not np.save's layout any more): the checked bytes are
    written instead, nothing is damaged. Under the copy (the file ends early): the block is
    counted damaged and built again. Either way the sidecar is what a clean build gives."""
    src = source(corpus)
    clean = build(src, tmp_path / "clean")
    cut = []

    def cut_short(path):
        os.truncate(path, os.path.getsize(path) - 16)
        cut.append(path.parent.name)

    if when == "before the copy":
        real = pack_blocks._Build._copy_part

        def copy_part(self, b, k, fd, at, n):
            if b == 5 and k == "start" and not cut:
                cut_short(self.block_dir(b) / "start.npy")
            return real(self, b, k, fd, at, n)

        monkeypatch.setattr(pack_blocks._Build, "_copy_part", copy_part)
    else:
        real = cache.copy_range

        def copy_range(src_fd, src_at, dst, dst_at, n):
            path = Path(os.readlink(f"/proc/self/fd/{src_fd}"))
            if path.parent.name == "0000005" and path.name == "start.npy" and not cut:
                cut_short(path)
            return real(src_fd, src_at, dst, dst_at, n)

        monkeypatch.setattr(cache, "copy_range", copy_range)
    before = cache.damaged_counts()["packing"]
    assert build(src, tmp_path / "cut") == clean
    assert cut == ["0000005"]
    assert cache.damaged_counts()["packing"] == before + (when == "under the copy")
    got, want = digest_of(tmp_path / "cut", src)
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
    assert cache.damaged_counts()["packing"] == before
    where = tmp_path / "full" / "packing"
    assert not (where / packed.identity(src.fingerprint, SEQ, B) / "stats.json").exists()
    assert not list(where.glob(".*")), "the joiner left a half-written sidecar"

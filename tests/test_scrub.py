"""The background scrub (issue 28): a byte flipped on disk in a chunk a running feeder has
already verified and serves from its memory map is found, and never served: DATA_LOSS from then
on, counted in status and metrics. A real feeder over sockets, a real file changed in place."""
from __future__ import annotations

import time
import urllib.request

import numpy as np
import pytest

from feeder.core.config import ServeConfig
from feeder.core.errors import Code
from feeder.service.server import ServerThread
from feeder.ops.status import fetch
from feeder_client import FeederDataset
from tests.helpers import byte_stream, check_batches, make_docs, prep_docs, served_until_error

SEQ, MB = 16, 4


def flip_a_byte_of(src, k: int) -> None:
    """Change chunk k's tokens in its shard file, in place (the feeder's map sees it)."""
    tokens = src.chunk(k).tobytes()
    path = src.root / src.manifest.shards[src._where[k][0]].path
    data = path.read_bytes()
    at = data.find(tokens)
    assert at >= 0 and data.find(tokens, at + 1) < 0
    with open(path, "r+b") as f:
        f.seek(at + 1)
        f.write(bytes([data[at + 1] ^ 0x40]))


def test_a_chunk_changed_after_its_first_read_is_data_loss_from_then_on(tmp_path):
    docs = make_docs(120, seed=7)
    stream = byte_stream(docs)
    data = prep_docs(tmp_path, docs, shard_tokens=3000, chunk_tokens=700)
    srv = ServerThread(ServeConfig(source=str(data), listen="127.0.0.1:0", message_bytes=4096,
                                   metrics_listen="127.0.0.1:0", scrub_mb_s=50))
    try:
        kw = dict(rank=0, world_size=1, seq_len=SEQ, micro_batch=MB, shuffle=False, num_epochs=1, read_ahead=2,
                  retry_for_s=3)
        first = list(FeederDataset([srv.address], job="before", **kw))   # every chunk read, verified, mapped
        check_batches(first, stream, SEQ, list(range(sum(len(b.sample_ids) for b in first))))
        (src,) = srv.engine.sources.values()
        k = 1
        flip_a_byte_of(src, k)
        deadline = time.monotonic() + 10
        while fetch(srv.address).chunks_changed == 0:
            assert time.monotonic() < deadline, "the scrub did not find the changed chunk"
            time.sleep(0.1)
        # A new job is served the samples before the changed chunk, then DATA_LOSS: not one wrong sample.
        served, err = served_until_error(FeederDataset([srv.address], job="after", **kw))
        assert err.code == Code.DATA_LOSS and "scrub" in str(err) and "chunk" in str(err)
        got = [i for b in served for i in b.sample_ids.tolist()]
        check_batches(served, stream, SEQ, got)
        assert got == list(range(len(got)))
        assert len(got) * SEQ <= src.chunk_starts[k + 1]   # it stopped at the changed chunk, not later
        status = fetch(srv.address)
        assert status.chunks_changed == 1 and status.scrubbed_bytes > 0
        with urllib.request.urlopen(f"http://{srv.server.metrics_address}/metrics", timeout=10) as r:
            text = r.read().decode()
        assert f'feeder_chunks_changed_total{{dataset="{src.name}"}} 1.0' in text
    finally:
        srv.stop()


def test_scrub_rate_is_checked_and_zero_turns_it_off(dataset):
    from feeder.core.errors import InvalidArgument

    for bad in (-1, float("nan"), "fast"):
        with pytest.raises(InvalidArgument, match="scrub_mb_s must be a non-negative number"):
            ServeConfig(source=str(dataset), scrub_mb_s=bad)
    srv = ServerThread(ServeConfig(source=str(dataset), listen="127.0.0.1:0", scrub_mb_s=0))
    try:
        assert srv.engine.scrubber is None and fetch(srv.address).scrubbed_bytes == 0
    finally:
        srv.stop()
    assert np.isfinite(ServeConfig(source=str(dataset)).scrub_mb_s)


def test_a_region_file_sets_the_scrub_rate_and_the_flag_wins(tmp_path, dataset):
    from feeder.cli import build_parser
    from feeder.ops.cli_serve import serve_config

    region = tmp_path / "r.toml"
    region.write_text(f'source = "{dataset}"\nscrub_mb_s = 4.5\n')
    assert serve_config(build_parser().parse_args(["serve", "--config", str(region)])).scrub_mb_s == 4.5
    told = build_parser().parse_args(["serve", "--config", str(region), "--scrub-mb-s", "0"])
    assert serve_config(told).scrub_mb_s == 0

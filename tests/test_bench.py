"""`feeder bench --quick` runs end to end and reports every figure the performance issue asks
for, with a plot. Speed itself is judged from `make bench`'s numbers, never asserted here.
The bench is its own package (bench/, installed as feeder_bench); `feeder` reaches it through
the `feeder.commands` entry point that the installed token-feeder registers."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

FIELDS = ("raw_socket_mb_s", "raw_grpc_mb_s", "raw_grpc_shared_mb_s", "raw_grpc_h2_mb_s",
          "raw_grpc_shared_h2_mb_s", "feeder_h2_tokens_s", "feeder_h2_mb_s", "reader_cpu_s_per_gb", "scaling_h2", "feeder_tokens_s", "feeder_decoded_tokens_s", "feeder_mb_s",
          "feeder_zstd_tokens_s",
          "local_tokens_s", "client_cpu_s_per_mtok", "local_cpu_s_per_mtok", "ttfb_s", "resume_s",
          "wire_bytes_per_token", "feeder_rss_mb", "max_streams", "scaling", "scaling_decoding_clients", "curve", "ratios", "versions",
          "machine", "config", "message_bytes", "kafka_source_tokens_s", "kafka_bare_consume_tokens_s",
          "kafka_snapshot_tokens_s", "kafka_snapshot_ratio", "kafka_follow")


def test_bench_quick_writes_every_figure_and_a_plot(tmp_path, kafka_broker):
    from importlib.metadata import entry_points

    stale = "the installed token-feeder predates the bench package's entry point: run `make env`"
    eps = {e.name: e for e in entry_points(group="feeder.commands")}
    assert "bench" in eps, stale
    try:
        eps["bench"].load()
    except ImportError as e:
        pytest.fail(f"{stale} ({e})")
    out, png = tmp_path / "r.json", tmp_path / "p.png"
    r = subprocess.run([sys.executable, "-m", "feeder.cli", "bench", "--quick", "--seconds", "0.5", "--rounds", "2",
                        "--data", str(tmp_path / "data"), "--kafka", kafka_broker, "--json", str(out),
                        "--plot", str(png)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())
    missing = [f for f in FIELDS if f not in res]
    assert not missing, missing
    assert res["feeder_tokens_s"] > 0 and res["feeder_decoded_tokens_s"] > 0 and res["local_tokens_s"] > 0
    assert res["raw_grpc_mb_s"] > 0 and res["raw_grpc_shared_mb_s"] > 0 and not res["feeder_errors"]
    assert res["raw_grpc_h2_mb_s"] > 0 and res["raw_grpc_shared_h2_mb_s"] > 0 and res["feeder_h2_tokens_s"] > 0
    assert all(v > 0 for v in res["reader_cpu_s_per_gb"].values())
    # ceilings and feeder taken in interleaved rounds; each figure is the median of its rounds
    for k in ("raw_socket_mb_s", "raw_grpc_mb_s", "raw_grpc_h2_mb_s", "feeder_tokens_s", "feeder_h2_tokens_s"):
        assert len(res["rounds"][k]) == 2 and res[k] == pytest.approx(sum(res["rounds"][k]) / 2), k
    # The client/local CPU ratio is of medians of 3 interleaved windows each.
    runs = res["cpu_runs_s_per_mtok"]
    assert len(runs["client"]) == len(runs["local"]) == 3 and all(x > 0 for x in runs["client"] + runs["local"])
    assert res["client_cpu_s_per_mtok"] == sorted(runs["client"])[1]
    assert res["local_cpu_s_per_mtok"] == sorted(runs["local"])[1]
    assert res["max_streams"] == res["max_streams_tried"] == 64, res["max_streams_errors"]
    assert res["wire_bytes_per_token"] < 4.0        # BPE ids in uint16, compressed
    assert res["dataset"]["vocab_size"] < 65536
    assert [c["ranks"] for c in res["curve"]] == [1, 2, 4, 8]
    assert res["scaling"]["1"] > 0 and res["scaling"]["2"] > 0 and res["scaling_decoding_clients"]["2"] > 0
    assert res["scaling_h2"]["1"] > 0 and res["scaling_h2"]["2"] > 0
    assert res["scaling_discard"]["1"] > 0 and res["scaling_discard"]["2"] > 0
    assert all(x > 0 for x in res["scaling_discard"]["reader_cpu_s_per_gb"])
    # issue 19: the same corpus from each other tool's format, in the same run, and its target
    assert set(res["formats"]) == {"nanogpt", "llmc", "megatron", "hf", "mds"}, res["formats_skipped"]
    assert all(len(f["rounds"]) == 2 and f["tokens_s"] > 0 and f["ratio_to_shards"] > 0 for f in res["formats"].values())
    assert {f"format_{k}_vs_shards" for k in res["formats"]} <= set(res["ratios"])
    for n in "12":   # where the cores went while the feeders were read: adds up to the machine's
        m = res["scaling_discard"][f"machine_cores_{n}"]
        assert m["busy"] > m["feeders"] > 0 and m["readers"] > 0
        assert 0.5 * res["machine"]["cpus"] < m["busy"] + m["idle"] + m["steal"] < 1.5 * res["machine"]["cpus"]
    assert {"feeder_vs_grpc_tokens_h2", "feeder_mb_vs_socket_h2", "scaling_2_vs_1_h2",
            "scaling_2_vs_1_discard"} <= set(res["ratios"])
    # issue 26: follow mode's feeder CPU per served token at 1, 8 and 64 ranks; the snapshot build
    follow = res["kafka_follow"]["ranks"]
    assert set(follow) == {"1", "8", "64"} and all(f["tokens"] > 0 and f["feeder_cpu_s_per_mtok"] > 0
                                                     and f["file_feeder_cpu_s_per_mtok"] > 0 for f in follow.values())
    assert follow["1"]["file_vs_one_rank"] == 1
    assert {"kafka_follow_cpu_8_vs_1_rank", "kafka_follow_cpu_64_vs_1_rank",
            "kafka_snapshot_vs_bare_consume"} <= set(res["ratios"])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "feeder_vs_grpc_tokens" in r.stdout and "met" in r.stdout

"""What a run found: the targets met or not, the table `feeder bench` prints, the plot, and
the versions and machine the figures were taken with."""
from __future__ import annotations

import os
import platform
import resource
from pathlib import Path

import numpy as np

from feeder import __version__


def ratios(r: dict) -> dict:
    """Each target, taken with grpcio readers (as the issue's figures are) and, marked _h2,
    with the minimal HTTP/2 reader on both sides of the ratio."""
    grpc_tokens_s = r["raw_grpc_mb_s"] * 1e6 / 2      # uint16 tokens the bare stream's bytes would carry
    out = {
        "feeder_vs_grpc_tokens": (r["feeder_tokens_s"] / grpc_tokens_s, 0.6),
        "feeder_vs_grpc_tokens_h2": (r["feeder_h2_tokens_s"] / (r["raw_grpc_h2_mb_s"] * 1e6 / 2), 0.6),
        "feeder_mb_vs_socket": (r["feeder_mb_s"] / r["raw_socket_mb_s"], 0.35),
        "feeder_mb_vs_socket_h2": (r["feeder_h2_mb_s"] / r["raw_socket_mb_s"], 0.35),
        "client_cpu_vs_local": (r["client_cpu_s_per_mtok"] / r["local_cpu_s_per_mtok"], 1.0),
        "ttfb_s": (r["ttfb_s"], 0.2),
        "resume_s": (r["resume_s"], 1.0),
        "wire_bytes_per_token": (r["wire_bytes_per_token"], 1.6),
        "feeder_rss_mb_64_ranks": (r["feeder_rss_mb"], 400),
        "max_streams": (r["max_streams"], 256),
        "scaling_2_vs_1": (r["scaling"]["ratio"], 1.6),
        "scaling_2_vs_1_h2": (r["scaling_h2"]["ratio"], 1.6),
        "scaling_2_vs_1_discard": (r["scaling_discard"]["ratio"], 1.6),
    }
    if "kafka_ratio" in r:
        out["kafka_source_vs_bare_consume"] = (r["kafka_ratio"], 0.5)
    if "kafka_snapshot_ratio" in r:   # issue 26: a region builds an epoch once, at >= half a bare loop's rate
        out["kafka_snapshot_vs_bare_consume"] = (r["kafka_snapshot_ratio"], 0.5)
    for world, f in r.get("kafka_follow", {}).get("ranks", {}).items():   # issue 26: one read of the topic per feeder
        if world != "1":
            out[f"kafka_follow_cpu_{world}_vs_1_rank"] = (f["vs_one_rank"], 1.5)
    for name, f in r.get("formats", {}).items():   # issue 19: within 15 % of our shards, same run
        out[f"format_{name}_vs_shards"] = (f["ratio_to_shards"], 0.85)
    at_least = {f"format_{name}_vs_shards" for name in r.get("formats", {})} | {"feeder_vs_grpc_tokens", "feeder_vs_grpc_tokens_h2", "feeder_mb_vs_socket", "feeder_mb_vs_socket_h2",
                "max_streams", "scaling_2_vs_1", "scaling_2_vs_1_h2", "scaling_2_vs_1_discard",
                "kafka_source_vs_bare_consume", "kafka_snapshot_vs_bare_consume"}
    return {k: {"value": v, "target": t, "met": (v >= t) if k in at_least else (v <= t)}
            for k, (v, t) in out.items() if v is not None}


def table(r: dict) -> str:
    """The figures and the targets as the text table `feeder bench` prints."""
    def of_rounds(key: str, scale: float = 1.0) -> str:
        return f"median of {', '.join(f'{x / scale:,.0f}' for x in r['rounds'][key])}"

    if r["config"].get("only") == "formats":
        return "\n".join(f"{k:<30} {v}" for k, v in _format_rows(r))
    if r["config"].get("only") == "mixture":
        return "\n".join(f"{k:<30} {v}" for k, v in _mixture_rows(r))
    if r["config"].get("only") == "kafka":
        return "\n".join(f"{k:<30} {v}" for k, v in _kafka_rows(r))
    if r["config"].get("only") == "packing":
        return "\n".join(f"{k:<34} {v}" for k, v in _packing_rows(r))
    if r["config"].get("only") == "members":
        return "\n".join(f"{k:<34} {v}" for k, v in _members_rows(r))

    rows = [
        ("raw_socket_mb_s", f"{r['raw_socket_mb_s']:,.0f} MB/s ({of_rounds('raw_socket_mb_s')})"),
        ("raw_grpc_mb_s", f"{r['raw_grpc_mb_s']:,.0f} MB/s ({of_rounds('raw_grpc_mb_s')})"),
        ("raw_grpc_shared_mb_s", f"{r.get('raw_grpc_shared_mb_s', 0):,.0f} MB/s ({r['config']['ranks']} counting streams, "
                                 "as the feeder's)"),
        ("raw_grpc_h2_mb_s", f"{r['raw_grpc_h2_mb_s']:,.0f} MB/s ({of_rounds('raw_grpc_h2_mb_s')}); "
                             f"{r['raw_grpc_shared_h2_mb_s']:,.0f} MB/s shared (read by the minimal HTTP/2 reader)"),
        ("feeder_tokens_s", f"{r['feeder_tokens_s'] / 1e6:,.1f} M tok/s ({r['config']['ranks']} ranks, none, served; "
                            f"{of_rounds('feeder_tokens_s', 1e6)})"),
        ("feeder_decoded_tokens_s", f"{r['feeder_decoded_tokens_s'] / 1e6:,.1f} M tok/s (ranks decode into tensors)"),
        ("feeder_mb_s", f"{r['feeder_mb_s']:,.0f} MB/s"),
        ("feeder_h2_tokens_s", f"{r['feeder_h2_tokens_s'] / 1e6:,.1f} M tok/s = {r['feeder_h2_mb_s']:,.0f} MB/s "
                               f"(HTTP/2 readers; {of_rounds('feeder_h2_tokens_s', 1e6)})"),
        ("reader CPU s per GB", f"grpcio {r['reader_cpu_s_per_gb']['grpcio'] or 0:.2f}, "
                                f"HTTP/2 reader {r['reader_cpu_s_per_gb']['h2'] or 0:.2f}"),
        ("feeder_zstd_tokens_s", f"{r['feeder_zstd_tokens_s'] / 1e6:,.1f} M tok/s"),
        ("local_tokens_s", f"{r['local_tokens_s'] / 1e6:,.1f} M tok/s (1 rank)"),
        ("client_cpu_s_per_mtok", f"{r['client_cpu_s_per_mtok']:.4f} s (zstd; median of "
                                  f"{', '.join(f'{x:.4f}' for x in r['cpu_runs_s_per_mtok']['client'])})"),
        ("local_cpu_s_per_mtok", f"{r['local_cpu_s_per_mtok']:.4f} s (median of "
                                 f"{', '.join(f'{x:.4f}' for x in r['cpu_runs_s_per_mtok']['local'])}, interleaved)"),
        ("ttfb_s / resume_s", f"{r['ttfb_s']:.3f} s / {r['resume_s']:.3f} s"),
        ("wire_bytes_per_token", f"{r['wire_bytes_per_token']:.3f}"),
        ("feeder_rss_mb (64 ranks)", f"{r['feeder_rss_mb']:.0f} MB"),
        ("max_streams", f"{r['max_streams']} of {r['max_streams_tried']}"),
        *[row for key in ("scaling", "scaling_h2", "scaling_discard") for row in _scaling_rows(r[key])],
        *_mixture_rows(r),
        ("  with decoding clients", f"{r['scaling_decoding_clients']['1'] / 1e6:,.1f} -> "
                                    f"{r['scaling_decoding_clients']['2'] / 1e6:,.1f} M tok/s"),
    ]
    rows += _kafka_rows(r)
    rows += _format_rows(r)
    lines = [f"{k:<30} {v}" for k, v in rows]
    lines.append("")
    lines.append(f"{'target':<30} {'value':>10} {'goal':>8}  met")
    for k, v in r["ratios"].items():
        lines.append(f"{k:<30} {v['value']:>10.3f} {v['target']:>8}  {'yes' if v['met'] else 'NO'}")
    return "\n".join(lines)


def _kafka_rows(r: dict) -> list[tuple[str, str]]:
    """The Kafka source against a bare consume() loop, and follow mode's feeder CPU per token."""
    if "kafka_ratio" not in r:
        return [("kafka", r.get("kafka_error", "not measured"))]
    rows = [("kafka source / bare consume", f"{r['kafka_source_tokens_s'] / 1e6:,.1f} / "
                                            f"{r['kafka_bare_consume_tokens_s'] / 1e6:,.1f} M tok/s")]
    if "kafka_snapshot_tokens_s" in r:
        rows.append(("kafka bounded snapshot build", f"{r['kafka_snapshot_tokens_s'] / 1e6:,.1f} M tok/s = "
                                                     f"{r['kafka_snapshot_gb_s']:.3f} GB/s = "
                                                     f"{r['kafka_snapshot_ratio']:.2f} x bare consume"))
    for world, f in r.get("kafka_follow", {}).get("ranks", {}).items():
        rows.append((f"  follow, {world} ranks", f"{f['tokens_s'] / 1e6:,.2f} M tok/s, feeder "
                                                 f"{f['feeder_cpu_s_per_mtok']:.3f} CPU-s per M tokens = "
                                                 f"{f['vs_one_rank']:.2f} x one rank's (a file corpus, the same "
                                                 f"ranks and batches: {f['file_vs_one_rank']:.2f} x)"))
    return rows


def _format_rows(r: dict) -> list[tuple[str, str]]:
    """Tokens/s from each other tool's format, and its ratio to our shards in the same rounds."""
    if "formats" not in r:
        return []
    rows = [("our shards (formats rounds)", f"{r['formats_shards_tokens_s'] / 1e6:,.1f} M tok/s (median of "
                                            f"{', '.join(f'{x / 1e6:,.1f}' for x in r['formats_shards_rounds'])})")]
    for name, f in r["formats"].items():
        rows.append((f"  {name}", f"{f['tokens_s'] / 1e6:,.1f} M tok/s = {f['ratio_to_shards']:.2f} x our shards "
                                  f"(median of {', '.join(f'{x / 1e6:,.1f}' for x in f['rounds'])})"))
    rows += [(f"  {name}", f"left out: {why}") for name, why in r["formats_skipped"].items()]
    return rows


def _scaling_rows(sc: dict) -> list[tuple[str, str]]:
    return [("scaling 1 -> 2 processes", f"{sc['1'] / 1e6:,.1f} -> {sc['2'] / 1e6:,.1f} M tok/s ({sc['clients']})"),
            ("  per feeder CPU-second", f"{sc['tokens_per_feeder_cpu_s_1'] / 1e6:,.1f} -> "
                                        f"{sc['tokens_per_feeder_cpu_s_2'] / 1e6:,.1f} M tok "
                                        f"(feeders used {sum(sc['feeder_cores_1']):.2f} -> "
                                        f"{sum(sc['feeder_cores_2']):.2f} cores; readers "
                                        f"{sc['reader_cpu_s_per_gb'][0]:.2f} core-s/GB)"),
            ("  the machine's cores, 2 procs", "busy {busy:.2f} (feeders {feeders:.2f}, readers {readers:.2f}, rest "
                                              "{rest:.2f}), idle {idle:.2f}, steal {steal:.2f}".format(
                                                  **sc["machine_cores_2"]))]


def plot(r: dict, path: str) -> None:
    """Throughput against ranks, and the data-wait share, as a PNG at `path`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ks = [c["ranks"] for c in r["curve"]]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    a.plot(ks, [c["tokens_s"] / 1e6 for c in r["curve"]], "o-", label="feeder (aggregate)")
    a.axhline(r["raw_grpc_mb_s"] / 2, color="grey", ls="--", label="bare gRPC stream (uint16 tokens)")
    a.axhline(r["local_tokens_s"] / 1e6, color="tab:orange", ls=":", label="local DataLoader, 1 rank")
    a.set_xlabel("ranks")
    a.set_ylabel("M tokens/s")
    a.set_xticks(ks)
    a.set_title("Throughput against ranks (loopback)")
    a.legend(fontsize=8)
    b.bar([str(k) for k in ks], [100 * c["data_wait_share"] for c in r["curve"]])
    b.set_xlabel("ranks")
    b.set_ylabel("% of time waiting for data")
    b.set_title("Data-wait share, 50 ms train step per batch")
    fig.suptitle(f"feeder {r['versions']['feeder']} on {r['machine']['cpus']} CPUs; "
                 f"seq_len {r['config']['seq_len']}, micro_batch {r['config']['micro_batch']}", fontsize=9)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def versions() -> dict:
    """Versions of what the figures depend on."""
    import grpc
    import pyarrow

    out = {"feeder": __version__, "python": platform.python_version(), "grpcio": grpc.__version__,
           "pyarrow": pyarrow.__version__, "numpy": np.__version__}
    try:
        import confluent_kafka

        out["confluent_kafka"] = confluent_kafka.version()[0]
    except ImportError:
        pass
    return out


def machine() -> dict:
    """The machine the figures were taken on."""
    return {"platform": platform.platform(), "cpus": os.cpu_count(), "processor": platform.processor(),
            "mem_gb": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
            "maxrss_mb_bench": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def _mixture_rows(r: dict) -> list[tuple[str, str]]:
    """Issue 18's figure: a mixture of 3 sources against one source, same feeder and rounds."""
    if "mixture" not in r:
        return []
    m = r["mixture"]
    return [("mixture_tokens_s", f"{m['mixture_tokens_s'] / 1e6:,.1f} M tok/s, {m['sources']} sources, "
                                 f"{m['ratio']:.2f}x one source's {m['single_tokens_s'] / 1e6:,.1f} (same feeder, "
                                 f"interleaved rounds: {', '.join(f'{x / 1e6:,.0f}' for x in m['rounds']['mixture'])} vs "
                                 f"{', '.join(f'{x / 1e6:,.0f}' for x in m['rounds']['single'])})")]


def _packing_rows(r: dict) -> list[tuple[str, str]]:
    """Boundaries' and best-fit packing's costs (bench/packing.py)."""
    p = r["packing"]
    med, c, w = p["tokens_s"], p["corpus"], p["web_10M"]
    return [("tokens/s, concat windows", f"{med['concat']:,.0f}"),
            ("tokens/s, with boundaries", f"{med['boundaries']:,.0f} ({100 * (p['boundaries_ratio'] - 1):+.1f} %, "
                                          "target >= -3 %)"),
            ("tokens/s, best-fit bins", f"{med['best_fit']:,.0f} ({100 * (p['best_fit_ratio'] - 1):+.1f} %)"),
            ("boundaries on the wire", f"{100 * p['boundaries_wire_share']:.2f} % of the tokens' bytes"),
            ("bench corpus packed", f"{c['documents']:,} documents in {c['bins']:,} bins, "
                                    f"{100 * c['padding_fraction']:.2f} % padding, {c['truncated']:,} truncated, "
                                    f"{c['pack_s']:.2f} s (+{c['read_doc_starts_s']:.2f} s reading document starts)"),
            ("10^7 web-like documents packed", f"{w['pack_s']:.1f} s (target <= 60 s), {w['bins']:,} bins, "
                                               f"{100 * w['padding_fraction']:.3f} % padding (target <= 3 %)")]


def _members_rows(r: dict):
    """`--only members`: feeder CPU per token, members against ranks; wire bytes per CP member."""
    m = r["feeder_cpu_s_per_mtok"]
    yield f"feeder CPU, {r['members']} members of 1 rank", f"{m['members']:.3f} s per M tokens delivered"
    yield f"feeder CPU, {r['members']} ranks", f"{m['ranks']:.3f} s per M tokens delivered"
    yield "members / ranks", f"{r['members_vs_ranks']:.2f}x (target <= {r['target_members_vs_ranks']}x)"
    for k, v in r["wire"].items():
        yield f"wire per batch, {k}", f"{v['bytes_per_batch']:,} B = {v['of_C1']:.3f} of C=1 (target <= {v['target']})"

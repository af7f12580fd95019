"""One bench run: the ceilings and the feeder in interleaved rounds, then the figures taken on
one feeder, many streams at once, and 1 against 2 feeder processes on one port; the Kafka
figures when a broker answers. Each phase adds its figures to one result dict."""
from __future__ import annotations

import json
import statistics
import time
from dataclasses import asdict
from pathlib import Path

from feeder.core.malloc import keep_freed_memory
from feeder.core.net import free_port

from .ceilings import raw_grpc_h2_mb_s, raw_grpc_mb_s, raw_grpc_shared_mb_s, raw_socket_mb_s
from .clients import READERS, Clients, Feeder, _client_cpu, _local, machine_cpu_s
from .config import BenchConfig, say
from .dataset import dataset
from .figures import streams, ttfb, wire_bytes_per_token
from .formats import format_figures
from .kafka_figures import kafka_figures
from .report import machine, plot, ratios, versions


def run(cfg: BenchConfig, json_path: str = "", plot_path: str = "") -> dict:
    """Every figure, as one dict (written to json_path and drawn to plot_path when given)."""
    t_start = time.monotonic()
    keep_freed_memory()   # for the bare gRPC reader in this process, as in every client process
    data = dataset(cfg)
    res: dict = {"config": asdict(cfg), "dataset": data, "versions": versions(), "machine": machine(),
                 "tokens_per_batch": cfg.micro_batch * (cfg.seq_len + 1), "message_bytes": cfg.message_bytes}
    clients = Clients()
    feeders: list[Feeder] = []   # stopped whatever happens
    if cfg.only:
        try:
            if cfg.only == "formats":
                res.update(format_figures(cfg, data, clients))
            elif cfg.only == "scale":
                from .scale import scale_figures

                res.update(scale_figures(cfg))
            elif cfg.only == "kafka":
                _kafka(cfg, data, res)
            elif cfg.only == "packing":
                from .packing import packing_figures

                res.update(packing_figures(cfg, data, clients))
            elif cfg.only == "elastic":
                from .elastic import elastic_figures

                res.update(elastic_figures(cfg, data))
            elif cfg.only == "gray":
                from .gray import gray_figures

                res.update(gray_figures(cfg, data))
            elif cfg.only == "schedule":
                from .schedule import schedule_figures

                res.update(schedule_figures(cfg))
            elif cfg.only == "members":
                from .members import members_figures

                res.update(members_figures(cfg, data, clients))
            else:
                _mixture(cfg, data, clients, feeders, res)
        finally:
            for f in feeders:
                f.stop()
            clients.close()
        return _finish(res, t_start, json_path, "")
    try:
        f = Feeder(data["shards"], message_bytes=cfg.message_bytes)
        feeders.append(f)
        _rounds(cfg, clients, f, res)
        _one_feeder(cfg, data, clients, f, res)
        f.stop()
        feeders.remove(f)
        _many_streams(cfg, data, clients, feeders, res)
        _scaling(cfg, data, clients, feeders, res)
        _mixture(cfg, data, clients, feeders, res)
        say("the same corpus in other tools' formats against our shards")
        res.update(format_figures(cfg, data, clients))
    finally:
        for f in feeders:
            f.stop()
        clients.close()
    _kafka(cfg, data, res)
    res["ratios"] = ratios(res)
    return _finish(res, t_start, json_path, plot_path)


def _kafka(cfg: BenchConfig, data: dict, res: dict) -> None:
    if cfg.kafka:
        say(f"Kafka source vs bare consume() at {cfg.kafka}")
        try:
            res.update(kafka_figures(cfg, data))
        except Exception as e:  # no broker: the rest of the figures still stand
            res["kafka_error"] = f"{e.__class__.__name__}: {e}"


def _finish(res: dict, t_start: float, json_path: str, plot_path: str) -> dict:
    res["elapsed_s"] = time.monotonic() - t_start
    if json_path:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(json.dumps(res, indent=2) + "\n")
    if plot_path:
        plot(res, plot_path)
    return res


def _rounds(cfg: BenchConfig, clients: Clients, f: Feeder, res: dict) -> None:
    """The ceilings and what the feeder serves, in rounds, and the median of each: this
    shared machine's speed drifts (the socket alone read 1.5 to 3.0 GB/s across one
    afternoon's runs), so a ceiling taken minutes before the feeder can skew their ratio.
    The feeder is taken by clients that count what arrives, as the ceilings' clients do,
    so each ratio compares like with like; ranks that decode into tensors follow later.
    With the minimal HTTP/2 reader too: what it serves when its readers take a third to a
    quarter of the cores grpcio's do (ranks run elsewhere in production)."""
    N, secs = cfg.ranks, cfg.seconds
    rounds: dict[str, list[float]] = {k: [] for k in (
        "raw_socket_mb_s", "raw_grpc_mb_s", "raw_grpc_h2_mb_s", "feeder_tokens_s", "feeder_h2_tokens_s",
        "reader_grpcio_cpu_s_per_gb", "reader_h2_cpu_s_per_gb")}
    for i in range(cfg.rounds):
        say(f"round {i + 1} of {cfg.rounds}: the socket, bare grpc.aio ({cfg.message_bytes >> 20} MiB messages) "
            f"and the feeder ({N} ranks, compression off)")
        rounds["raw_socket_mb_s"].append(raw_socket_mb_s(secs, cfg.message_bytes))
        rounds["raw_grpc_mb_s"].append(raw_grpc_mb_s(secs, cfg.message_bytes))
        rounds["raw_grpc_h2_mb_s"].append(raw_grpc_h2_mb_s(secs, cfg.message_bytes))
        for reader in ("grpcio", "h2"):
            got = clients.count([f.address], f"agg-count-{reader}-{i}", N, seq_len=cfg.seq_len, mb=cfg.micro_batch,
                                seconds=secs, reader=reader)
            rounds["feeder_tokens_s" if reader == "grpcio" else "feeder_h2_tokens_s"].append(got["tokens_s"])
            rounds[f"reader_{reader}_cpu_s_per_gb"].append(got["reader_cpu_s_per_gb"])
    med = {k: statistics.median(v) for k, v in rounds.items()}
    res["rounds"] = rounds
    for k in ("raw_socket_mb_s", "raw_grpc_mb_s", "raw_grpc_h2_mb_s", "feeder_tokens_s", "feeder_h2_tokens_s"):
        res[k] = med[k]
    res["feeder_mb_s"] = res["feeder_tokens_s"] * 2 / 1e6   # uint16 payload; see feeder_wire_mb_s for the envelope
    res["feeder_h2_mb_s"] = res["feeder_h2_tokens_s"] * 2 / 1e6
    res["reader_cpu_s_per_gb"] = {"grpcio": med["reader_grpcio_cpu_s_per_gb"], "h2": med["reader_h2_cpu_s_per_gb"]}


def _one_feeder(cfg: BenchConfig, data: dict, clients: Clients, f: Feeder, res: dict) -> None:
    """On the rounds' feeder: the bare stream shared as the feeder is, ranks that decode,
    zstd, per-rank CPU against the local DataLoader, first batch, wire bytes, the ranks curve."""
    L, mb, N, secs = cfg.seq_len, cfg.micro_batch, cfg.ranks, cfg.seconds
    say(f"the bare grpc.aio stream again, taken by {N} counting streams in {clients.n} client processes")
    res["raw_grpc_shared_mb_s"] = raw_grpc_shared_mb_s(clients, secs, cfg.message_bytes, N)
    res["raw_grpc_shared_h2_mb_s"] = raw_grpc_shared_mb_s(clients, secs, cfg.message_bytes, N, reader="h2")
    say(f"feeder: {N} ranks decoding into tensors, compression off")
    r = clients.run([f.address], "agg-none", N, seq_len=L, mb=mb, compression="none", seconds=secs)
    res["feeder_decoded_tokens_s"] = r["tokens_s"]
    res["feeder_errors"] = r["errors"]
    st = {j.job: j for j in f.status().jobs}["agg-none"]
    res["feeder_wire_mb_s_lifetime"] = sum(x.bytes_sent for x in st.ranks) / 1e6
    say(f"feeder: {N} ranks, zstd")
    r = clients.run([f.address], "agg-zstd", N, seq_len=L, mb=mb, compression="zstd", seconds=secs)
    res["feeder_zstd_tokens_s"] = r["tokens_s"]
    _cpu_per_token(cfg, data, clients, f, res)
    say("time to first batch, new and resumed")
    res["ttfb_s"], res["resume_s"] = ttfb(f.address, L, mb)
    res["wire_bytes_per_token"] = wire_bytes_per_token(f.address, L, mb)
    say("ranks 1, 2, 4, 8: throughput, and data-wait for a loop that trains 50 ms per batch")
    curve = []
    for k in (1, 2, 4, 8):
        t = clients.run([f.address], f"curve-{k}", k, seq_len=L, mb=mb, compression="none", seconds=secs / 2)
        w = clients.run([f.address], f"wait-{k}", k, seq_len=L, mb=mb, compression="zstd",
                        seconds=secs / 2, step_s=0.05)
        curve.append({"ranks": k, "tokens_s": t["tokens_s"], "data_wait_share": w["wait_share"]})
    res["curve"] = curve


def _cpu_per_token(cfg: BenchConfig, data: dict, clients: Clients, f: Feeder, res: dict) -> None:
    """Per-rank CPU: feeder client vs local DataLoader. Interleaved, three of each, and the
    medians: a burst of the machine's other load during one of two back-to-back windows moved
    this ratio by a third."""
    L, mb, N, secs = cfg.seq_len, cfg.micro_batch, cfg.ranks, cfg.seconds
    say("per-rank CPU: feeder client vs local DataLoader")
    runs: dict[str, list[dict]] = {"client": [], "local": []}
    for _ in range(3):
        runs["client"] += clients.pool.map(_client_cpu, [(f.address, L, mb, "zstd", secs / 2)])
        runs["local"] += clients.pool.map(_local, [(data["packed"], L, mb, N, secs / 2)])
    res["client"], res["local"] = (sorted(runs[k], key=lambda x: x["cpu_s_per_mtok"])[1] for k in ("client", "local"))
    res["cpu_runs_s_per_mtok"] = {k: [x["cpu_s_per_mtok"] for x in v] for k, v in runs.items()}
    res["client_none"] = clients.pool.map(_client_cpu, [(f.address, L, mb, "none", secs)])[0]
    res["client_cpu_s_per_mtok"] = res["client"]["cpu_s_per_mtok"]
    res["local_tokens_s"] = res["local"]["tokens_s"]
    res["local_cpu_s_per_mtok"] = res["local"]["cpu_s_per_mtok"]


def _many_streams(cfg: BenchConfig, data: dict, clients: Clients, feeders: list[Feeder], res: dict) -> None:
    """64 ranks at once (the feeder's RSS), then as many streams as the run allows."""
    L, mb, secs = cfg.seq_len, cfg.micro_batch, cfg.seconds
    f = Feeder(data["shards"], message_bytes=min(cfg.message_bytes, 1 << 20), extra=["--prefetch-messages", "2"])
    feeders.append(f)
    say("64 ranks at once: the feeder's RSS")
    many = streams(clients, f, 64, seq_len=L, mb=mb, seconds=secs)
    res["feeder_rss_mb"] = many["rss_max_mb"]
    res["streams_64"] = many
    n_max = 64 if cfg.quick else 256
    say(f"{n_max} streams at once")
    big = streams(clients, f, n_max, seq_len=256, mb=2, seconds=secs / 2)
    res["max_streams"] = big["ok"]
    res["max_streams_tried"] = n_max
    res["max_streams_errors"] = big["errors"]
    res["feeder_rss_mb_max_streams"] = big["rss_max_mb"]
    f.stop()
    feeders.remove(f)


def _scaling(cfg: BenchConfig, data: dict, clients: Clients, feeders: list[Feeder], res: dict) -> None:
    """1 and 2 feeder processes on one port (SO_REUSEPORT). What the feeders serve (counting
    clients, as for the ceilings), and what ranks that decode into tensors on the same 2 cores
    take (the cores then run out first). Each feeder's CPU over the counting run too: tokens
    per feeder CPU-second shows whether a second process costs the first anything, apart from
    the cores the machine has. And where the machine's cores went meanwhile: busy, idle,
    taken by other guests (steal)."""
    L, mb, N, secs = cfg.seq_len, cfg.micro_batch, cfg.ranks, cfg.seconds
    say("scaling: 1 and 2 feeder processes on one port (SO_REUSEPORT)")
    port = free_port()
    one = Feeder(data["shards"], port, message_bytes=cfg.message_bytes, extra=["--reuse-port"])
    feeders.append(one)
    scaled = [one]

    def counted(job, reader):
        cpu0, m0, t0 = [f.cpu_s() for f in scaled], machine_cpu_s(), time.monotonic()
        got = clients.count([one.address], job, N, seq_len=L, mb=mb, seconds=secs, reader=reader)
        dt = time.monotonic() - t0
        cores = [(f.cpu_s() - c) / dt for f, c in zip(scaled, cpu0)]
        used = {k: (v - m0[k]) / dt for k, v in machine_cpu_s().items()}
        used["feeders"], used["readers"] = sum(cores), got["reader_cpu_s"] / dt
        used["rest"] = used["busy"] - used["feeders"] - used["readers"]
        return got["tokens_s"], cores, got["reader_cpu_s_per_gb"], {k: round(v, 3) for k, v in used.items()}

    one_proc = {reader: counted(f"scale-1c-{reader}", reader) for reader in READERS}
    s1 = clients.run([one.address], "scale-1", N, seq_len=L, mb=mb, compression="none", seconds=secs)
    scaled.append(Feeder(data["shards"], port, message_bytes=cfg.message_bytes, extra=["--reuse-port"]))  # same port
    feeders.append(scaled[-1])
    two_proc = {reader: counted(f"scale-2c-{reader}", reader) for reader in READERS}
    s2 = clients.run([one.address], "scale-2", N, seq_len=L, mb=mb, compression="none", seconds=secs)
    for key, reader in (("scaling", "grpcio"), ("scaling_h2", "h2"), ("scaling_discard", "h2-discard")):
        (t1, cores1, rd1, m1), (t2, cores2, rd2, m2) = one_proc[reader], two_proc[reader]
        res[key] = {"1": t1, "2": t2, "ratio": t2 / t1, "clients": f"counting ({reader} readers)",
                    "feeder_cores_1": cores1, "feeder_cores_2": cores2, "reader_cpu_s_per_gb": [rd1, rd2],
                    "machine_cores_1": m1, "machine_cores_2": m2,
                    "tokens_per_feeder_cpu_s_1": t1 / sum(cores1), "tokens_per_feeder_cpu_s_2": t2 / sum(cores2)}
    res["scaling_decoding_clients"] = {"1": s1["tokens_s"], "2": s2["tokens_s"],
                                       "ratio": s2["tokens_s"] / s1["tokens_s"]}


MIXTURE = (("web", 0.5), ("code", 0.3), ("news", 0.2))


def mixture_figure(cfg: BenchConfig, data: dict, clients: Clients, feeders: list[Feeder]) -> dict:
    """A mixture of 3 sources against one source, on one feeder, in interleaved rounds (the
    medians): what blending, the per-source draws and locating rows in three sources cost.
    The three names serve the bench's one set of shards: the same bytes per sample, so the
    ratio is the mixture's own cost, not the sources' differences."""
    N, secs = cfg.ranks, cfg.seconds
    sh = data["shards"]
    f = Feeder(f"{MIXTURE[0][0]}={sh}", message_bytes=cfg.message_bytes,
               extra=[a for name, _ in MIXTURE[1:] for a in ("--source", f"{name}={sh}")])
    feeders.append(f)
    one, mixed = [], []
    for i in range(cfg.rounds):
        say(f"mixture round {i + 1} of {cfg.rounds}: {N} ranks on one source, then on a mixture of "
            f"{len(MIXTURE)} (counting clients)")
        one.append(clients.count([f.address], f"mix-one-{i}", N, seq_len=cfg.seq_len, mb=cfg.micro_batch,
                                 seconds=secs)["tokens_s"])
        mixed.append(clients.count([f.address], f"mix-{i}", N, seq_len=cfg.seq_len, mb=cfg.micro_batch,
                                   seconds=secs, mixture=MIXTURE)["tokens_s"])
    f.stop()
    feeders.remove(f)
    a, b = statistics.median(one), statistics.median(mixed)
    return {"single_tokens_s": a, "mixture_tokens_s": b, "ratio": b / a, "ranks": N, "sources": len(MIXTURE),
            "rounds": {"single": one, "mixture": mixed}}


def _mixture(cfg: BenchConfig, data: dict, clients: Clients, feeders: list[Feeder], res: dict) -> None:
    res["mixture"] = mixture_figure(cfg, data, clients, feeders)

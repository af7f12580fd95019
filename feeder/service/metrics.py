"""Prometheus metrics, read from the engine's own state at scrape time.

Nothing is counted twice: the per-rank figures `feeder status` shows (RankState) are the
same numbers exported here, so the data path pays nothing per batch for metrics. A scrape
runs on prometheus_client's HTTP thread; it takes a snapshot on the event loop (the only
thread that mutates jobs), so it never sees a dict changing under it.
"""
from __future__ import annotations

import asyncio
import logging
import os
from dataclasses import dataclass

from feeder.sources import cache, preparing
from feeder.core.errors import Unavailable
from feeder.domain.engine import member_status
from feeder.pipeline.jobs import READ_BUCKETS

log = logging.getLogger("feeder.metrics")

RANK = ("job", "rank")

# name -> (kind, help, labels). The one list of what the feeder exports: the Grafana
# dashboard test checks its queries against it.
FAMILIES: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "feeder_batches_sent_total": ("counter", "Batches handed to gRPC", RANK),
    "feeder_sent_bytes_total": ("counter", "Bytes of batch messages sent (after compression)", RANK),
    "feeder_raw_bytes_total": ("counter", "Token bytes sent before compression", RANK),
    "feeder_tokens_sent_total": ("counter", "Tokens sent", RANK),
    "feeder_tokens_per_second": ("gauge", "Tokens/s the rank's loop takes (reported), else tokens/s sent", RANK),
    "feeder_compression_ratio": ("gauge", "Token bytes before / after compression so far (1 when uncompressed)", RANK),
    "feeder_prefetch_queue_messages": ("gauge", "Messages built and waiting in the rank's prefetch queue", RANK),
    "feeder_data_wait_seconds_total": ("counter", "Time the rank's training loop waited for data (reported)",
                                       RANK),
    "feeder_step_seconds_total": ("counter", "Wall time covered by the rank's reports", RANK),
    "feeder_stream_restarts_total": ("counter", "Streams opened for a rank after the first of each of its slots "
                                     "(worker, member, context-parallel rank) on this feeder",
                                     RANK),
    "feeder_failovers_total": ("counter", "Streams a client opened here because its previous stream broke",
                               RANK),
    "feeder_rank_connected": ("gauge", "1 while the rank has an open stream here", RANK),
    "feeder_stuck_reads": ("gauge", "Source reads of this process that have not returned for --stuck-after-s "
                           "(a hung filesystem); their streams were ended and new ones of their sources are refused",
                           ()),
    "feeder_load": ("gauge", "This process's load: 0 idle, 1 at capacity (its CPU against the cores it may use, or "
                    "its batch threads all busy)", ()),
    "feeder_rank_moves_total": ("counter", "Times the rank's client moved to another feeder: after an error, off a "
                                "slow or stuck one, or back after a failback (reported)", RANK),
    "feeder_hedged_bytes_total": ("counter", "Bytes of hedged copies the rank's client received and dropped "
                                  "(reported)", RANK),
    "feeder_epoch": ("gauge", "Epoch the rank's training loop is in (reported; else the epoch being sent)", RANK),
    "feeder_epoch_progress_ratio": ("gauge", "Share of the epoch the rank's loop has taken (reported; 0 before "
                                    "its first report)", RANK),
    "feeder_epoch_sent_ratio": ("gauge", "Share of the epoch being sent that was sent (runs ahead of what was "
                                "taken)", RANK),
    "feeder_source_read_seconds": ("histogram", "Time to read one batch's tokens from the source", RANK),
    "feeder_source_samples_total": ("counter", "Samples sent from each source of the rank's mixture",
                                    ("job", "rank", "source")),
    "feeder_mixture_schedule_version": ("gauge", "A scheduled mixture's schedule version: 0 as the job started, n "
                                        "after its n-th live change (feeder mix)", ("job",)),
    "feeder_mixture_share": ("gauge", "Each source's share of a scheduled mixture's progress planned so far: "
                             "scheduled (the schedule's integral) and actual (samples drawn)",
                             ("job", "source", "kind")),
    "feeder_bad_records_total": ("counter", "Kafka records skipped under bad_records=skip", RANK),
    "feeder_rank_members": ("gauge", "Open members of a model-parallel rank (docs/model-parallel.md)", RANK),
    "feeder_member_messages_total": ("counter", "A model-parallel rank's messages: built once into its window "
                                     "(built), sent from it to a member (shared), built by a member on its own "
                                     "(alone: behind the window, or resumed elsewhere)", ("job", "rank", "how")),
    "feeder_member_behind_batches": ("gauge", "Batches the rank's slowest member is behind its fastest", RANK),
    "feeder_kafka_lag_records": ("gauge", "Records between the rank's reader and the partition's end (follow)",
                                 ("job", "rank", "partition")),
    "feeder_preparing_done_ratio": ("gauge", "Share done of what streams wait for before their first batch "
                                             "(a Kafka epoch's snapshot being built: key is its offset ranges)",
                                    ("key",)),
    "feeder_streams_open": ("gauge", "Streams open in this process", ()),
    "feeder_jobs": ("gauge", "Jobs known to this process", ()),
    "feeder_resident_memory_bytes": ("gauge", "Resident set size of this process", ()),
    "feeder_memory_budget_bytes": ("gauge", "Bytes the streams of this process may hold built ahead of their "
                                            "peers (--memory-budget-mb)", ()),
    "feeder_memory_budget_used_bytes": ("gauge", "Bytes the streams of this process hold built ahead of their "
                                                 "peers now", ()),
    "feeder_memory_budget_refused_total": ("counter", "Streams refused (RESOURCE_EXHAUSTED) because the open streams "
                                                      "held the whole memory budget", ()),
    "feeder_scrubbed_bytes_total": ("counter", "Bytes of verified chunks re-hashed by the background scrub",
                                    ("dataset",)),
    "feeder_chunks_changed_total": ("counter", "Chunks the scrub found changed on disk (DATA_LOSS since)",
                                    ("dataset",)),
    "feeder_order_build_ratio": ("gauge", "How far each epoch order under way here is built (0..1)", ("order",)),
    "feeder_orders_built_total": ("counter", "Epoch orders this process built", ()),
    "feeder_order_build_seconds_total": ("counter", "Seconds this process spent building epoch orders", ()),
    "feeder_order_verify_seconds_total": ("counter", "Seconds this process spent verifying epoch order files "
                                                     "before mapping them", ()),
    "feeder_cache_damaged_total": ("counter", "Cache entries (order, snapshot, packing) this process found damaged, "
                                              "removed and rebuilt (none of them served)", ("kind",)),
    "feeder_cache_unusable": ("gauge", "1 while this process cannot keep epoch orders in its cache directory "
                                       "(read-only, full, not this user's) and draws them in memory instead", ()),
    "feeder_info": ("gauge", "Constant 1, labelled with the feeder's version and region", ("version", "region")),
}


@dataclass(frozen=True)
class _RankRow:
    job: str
    rank: str
    st: object  # a copy of RankState


class EngineCollector:
    def __init__(self, engine, loop: asyncio.AbstractEventLoop):
        self.engine, self.loop = engine, loop

    def _snapshot(self) -> list[_RankRow]:
        import copy

        rows = []
        for j in list(self.engine.jobs.jobs.values()):
            for r in list(j.ranks.values()):
                row = copy.copy(r)
                row.member_status = member_status(r)   # (read on the loop: members move there)
                rows.append(_RankRow(j.job, str(r.rank), row))
        return rows

    async def _on_loop(self):
        return self._snapshot()

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

        try:
            rows = asyncio.run_coroutine_threadsafe(self._on_loop(), self.loop).result(5)
        except Exception as e:  # loop stopped or wedged: still export process-level figures
            log.warning("metrics: no snapshot from the event loop (%s)", e)
            rows = []
        fam = {}
        for name, (kind, doc, labels) in FAMILIES.items():
            base = name[:-len("_total")] if kind == "counter" else name
            cls = {"counter": CounterMetricFamily, "gauge": GaugeMetricFamily,
                   "histogram": HistogramMetricFamily}[kind]
            fam[name] = cls(base, doc, labels=list(labels))
        for row in rows:
            st, lab = row.st, [row.job, row.rank]
            fam["feeder_batches_sent_total"].add_metric(lab, st.batches_sent)
            fam["feeder_sent_bytes_total"].add_metric(lab, st.bytes_sent)
            fam["feeder_raw_bytes_total"].add_metric(lab, st.raw_bytes_sent)
            fam["feeder_tokens_sent_total"].add_metric(lab, st.tokens_sent)
            fam["feeder_tokens_per_second"].add_metric(lab, st.tokens_per_s)
            fam["feeder_compression_ratio"].add_metric(lab, st.raw_bytes_sent / st.payload_bytes_sent if st.payload_bytes_sent else 1.0)
            fam["feeder_prefetch_queue_messages"].add_metric(lab, st.queue_depth if st.connected else 0)
            fam["feeder_data_wait_seconds_total"].add_metric(lab, st.wait_s)
            fam["feeder_step_seconds_total"].add_metric(lab, st.step_s)
            fam["feeder_stream_restarts_total"].add_metric(lab, st.restarts)
            fam["feeder_failovers_total"].add_metric(lab, st.failovers)
            fam["feeder_rank_moves_total"].add_metric(lab, st.feed.get("moves", 0))
            fam["feeder_hedged_bytes_total"].add_metric(lab, st.feed.get("hedged_bytes", 0))
            fam["feeder_rank_connected"].add_metric(lab, 1.0 if st.connected else 0.0)
            epoch, done = st.position
            fam["feeder_epoch"].add_metric(lab, epoch)
            fam["feeder_epoch_progress_ratio"].add_metric(lab, done / st.samples_in_epoch if st.samples_in_epoch else 0.0)
            fam["feeder_epoch_sent_ratio"].add_metric(lab, st.samples_done / st.samples_in_epoch
                                                      if st.samples_in_epoch else 0.0)
            cum, buckets = 0, []
            for bound, n in zip((*READ_BUCKETS, float("inf")), st.read_buckets):
                cum += n
                buckets.append(("+Inf" if bound == float("inf") else repr(bound), cum))
            fam["feeder_source_read_seconds"].add_metric(lab, buckets, st.read_s)
            fam["feeder_bad_records_total"].add_metric(lab, st.bad_records)
            if st.window_builds or st.member_solo or st.members:
                fam["feeder_rank_members"].add_metric(lab, len(st.members))
                for how, n in (("built", st.window_builds), ("shared", st.member_shared), ("alone", st.member_solo)):
                    fam["feeder_member_messages_total"].add_metric([*lab, how], n)
                fam["feeder_member_behind_batches"].add_metric(lab, max((m.behind for m in st.member_status), default=0))
            for name, n in sorted(st.source_samples.items()):
                fam["feeder_source_samples_total"].add_metric([*lab, name], n)
            for part, lag in sorted(st.lag.items()):
                fam["feeder_kafka_lag_records"].add_metric([*lab, str(part)], lag)
        e = self.engine
        _schedules(fam, e.schedules)
        for key, note in sorted(preparing.current().items()):
            if note["done"] is not None:
                fam["feeder_preparing_done_ratio"].add_metric([key], note["done"])
        fam["feeder_streams_open"].add_metric([], e.jobs.streams_open)
        fam["feeder_jobs"].add_metric([], len(e.jobs.jobs))
        fam["feeder_resident_memory_bytes"].add_metric([], e.rss_mb() * 2**20)
        fam["feeder_memory_budget_bytes"].add_metric([], e.budget.limit)
        fam["feeder_stuck_reads"].add_metric([], len(e.stuck))
        fam["feeder_load"].add_metric([], e.load)
        fam["feeder_memory_budget_used_bytes"].add_metric([], e.budget.used)
        fam["feeder_memory_budget_refused_total"].add_metric([], e.budget.refused)
        fam["feeder_info"].add_metric([e.version, e.cfg.region], 1.0)
        if e.scrubber is not None:
            for name in e.scrubber.sources:
                fam["feeder_scrubbed_bytes_total"].add_metric([name], e.scrubber.scrubbed_bytes[name])
                fam["feeder_chunks_changed_total"].add_metric([name], e.scrubber.changed[name])
        for b in e.orders.builds():
            fam["feeder_order_build_ratio"].add_metric([b.name], b.fraction)
        fam["feeder_orders_built_total"].add_metric([], e.orders.built)
        fam["feeder_cache_unusable"].add_metric([], 1.0 if e.orders.unusable else 0.0)
        fam["feeder_order_build_seconds_total"].add_metric([], e.orders.build_seconds)
        fam["feeder_order_verify_seconds_total"].add_metric([], e.orders.verify_seconds)
        for kind, count in cache.damaged_counts().items():
            fam["feeder_cache_damaged_total"].add_metric([kind], count)
        yield from fam.values()


def _schedules(fam: dict, schedules) -> None:
    """Each scheduled mixture's version, and its sources' scheduled and actual shares so far."""
    for job, book in sorted(schedules.jobs().items()):
        st = book.status()
        fam["feeder_mixture_schedule_version"].add_metric([job], st["version"])
        for name, a, w in zip(st["names"], st["actual"], st["scheduled"]):
            fam["feeder_mixture_share"].add_metric([job, name, "scheduled"], w)
            fam["feeder_mixture_share"].add_metric([job, name, "actual"], a)


def requiring_token(app, tokens):
    """The WSGI app behind a bearer token with `metrics = true` in the tokens file: /metrics
    lists every job's progress and rates, which Status shows only to a token of that job."""
    from feeder.service.security import bearer

    def refuse(start_response, status: str, why: str):
        start_response(status, [("Content-Type", "text/plain; charset=utf-8"),
                                ("WWW-Authenticate", 'Bearer realm="feeder metrics"')])
        return [why.encode() + b"\n"]

    def guarded(environ, start_response):
        token = bearer([("authorization", environ.get("HTTP_AUTHORIZATION", ""))])
        if not token:
            return refuse(start_response, "401 Unauthorized", "/metrics needs a bearer token with metrics = true "
                          "(Prometheus: authorization: credentials_file: ...)")
        grant = tokens.lookup(token)
        if grant is None:
            return refuse(start_response, "401 Unauthorized", "the bearer token is not valid for this feeder")
        if not grant.metrics:
            return refuse(start_response, "403 Forbidden", f"token {grant.name!r} has no metrics scope "
                          "(metrics = true in the tokens file)")
        return app(environ, start_response)
    return guarded


def start_metrics(engine, loop: asyncio.AbstractEventLoop, listen: str,
                  tls: tuple[str, str, str] | None = None, tokens=None) -> tuple[object, str]:
    """Serve /metrics on HOST:PORT (port 0: any free port); returns (server, 'HOST:PORT').
    With tls=(cert, key, client_ca) it is HTTPS with the feeder's own certificate (and
    client certificates required when client_ca is set), re-read when the files change, as
    the gRPC port's are: each new connection gets the certificate as it is then.
    With `tokens` (a TokenStore) and no client certificates required, a scrape needs a bearer
    token with the metrics scope; a client certificate from the deployment's CA is enough."""
    import socket
    import threading
    from wsgiref.simple_server import WSGIRequestHandler, make_server

    from prometheus_client import CollectorRegistry, make_wsgi_app
    from prometheus_client.exposition import ThreadingWSGIServer

    from feeder.service.security import ReloadingSSLContext

    host, _, port = listen.rpartition(":")
    host = host.strip("[]") or "0.0.0.0"
    contexts = ReloadingSSLContext(*tls) if tls else None

    class Quiet(WSGIRequestHandler):
        def log_message(self, *args):   # a scrape every few seconds is not news
            pass

    class Server(ThreadingWSGIServer):
        address_family = socket.AF_INET6 if ":" in host else socket.AF_INET

        def get_request(self):
            conn, addr = super().get_request()
            if contexts is not None:
                # The handshake happens on the connection's own thread, at its first read: a
                # peer that stalls it holds only that thread (for 10 s), never the accept loop.
                conn.settimeout(10)
                conn = contexts.current().wrap_socket(conn, server_side=True, do_handshake_on_connect=False)
            return conn, addr

        def handle_error(self, request, client_address):   # a failed handshake: the peer's problem
            log.debug("metrics: connection from %s failed", client_address, exc_info=True)

    registry = CollectorRegistry(auto_describe=False)
    registry.register(EngineCollector(engine, loop))
    app = make_wsgi_app(registry)
    if tokens is not None and not (tls and tls[2]):
        app = requiring_token(app, tokens)
    try:
        server = make_server(host, int(port), app, Server, handler_class=Quiet)
    except OSError as e:
        raise Unavailable(f"cannot serve metrics on {host}:{port}: {e.strerror or e}; every feeder process on a "
                          "host needs a metrics port of its own (--metrics-port)") from None
    threading.Thread(target=server.serve_forever, name="metrics", daemon=True).start()
    real = server.server_port
    log.info("metrics on %s:%d (pid %d)", host, real, os.getpid())
    return server, f"{host}:{real}"

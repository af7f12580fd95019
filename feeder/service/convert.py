"""The one seam between gRPC and the domain: protobuf <-> domain values, FeederError <-> status code.

Nothing here decides anything (the compression a rank gets is Engine.compression, the status
is Engine.status): it translates. The client builds its StreamRequest here too (stream_request),
so the request and its parsing are written once."""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import grpc
from google.protobuf.message import DecodeError

from feeder.core import scope
from feeder.core.config import StreamSpec
from feeder.core.errors import ELSEWHERE, Code, FeederError, InvalidArgument
from feeder.domain.process_status import ProcessStatus
from feeder.pipeline.jobs import unknown_job
from feeder.v1 import feeder_pb2 as pb

if TYPE_CHECKING:
    from feeder.domain.engine import Engine
    from feeder.sources import Source

# A rank's client's view of its feed: the same fields in ReportRequest and RankStatus (30-35).
FEED = ("target", "moved", "moves", "delivered_per_s", "consumed_per_s", "hedged_bytes")

SERVICE = pb.DESCRIPTOR.services_by_name["Feeder"].full_name   # "feeder.v1.Feeder"

STATUS = {
    Code.INVALID_ARGUMENT: grpc.StatusCode.INVALID_ARGUMENT,
    Code.FAILED_PRECONDITION: grpc.StatusCode.FAILED_PRECONDITION,
    Code.NOT_FOUND: grpc.StatusCode.NOT_FOUND,
    Code.DATA_LOSS: grpc.StatusCode.DATA_LOSS,
    Code.UNAUTHENTICATED: grpc.StatusCode.UNAUTHENTICATED,
    Code.PERMISSION_DENIED: grpc.StatusCode.PERMISSION_DENIED,
    Code.RESOURCE_EXHAUSTED: grpc.StatusCode.RESOURCE_EXHAUSTED,
    Code.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
    Code.INTERNAL: grpc.StatusCode.INTERNAL,
}
CODES = {s: c for c, s in STATUS.items()}   # the way back, for the client
COMPRESSION_NAME = {pb.COMPRESSION_NONE: "none", pb.COMPRESSION_ZSTD: "zstd"}
COMPRESSION_ENUM = {"": pb.COMPRESSION_UNSPECIFIED, "none": pb.COMPRESSION_NONE, "zstd": pb.COMPRESSION_ZSTD}
DTYPE_ENUM = {"uint16": pb.DTYPE_UINT16, "uint32": pb.DTYPE_UINT32}

# gRPC sends a status message as a percent-encoded header, and a peer drops headers past its
# metadata limit (8 KiB soft, 16 KiB hard by default): the caller then sees RESOURCE_EXHAUSTED
# instead of the refusal. Every message is cut to this many bytes as sent.
MAX_STATUS_MESSAGE = 2048


def capped(message: str, limit: int = MAX_STATUS_MESSAGE) -> str:
    """message, cut so that its percent-encoded form (grpc-message) fits in `limit` bytes."""
    def sent(ch: str) -> int:  # bytes on the wire: printable ASCII but % as is, the rest %XX per UTF-8 byte
        return 1 if " " <= ch <= "~" and ch != "%" else 3 * len(ch.encode("utf-8", "surrogatepass"))

    if len(message) <= limit and sum(map(sent, message)) <= limit:
        return message
    tail = f"... ({len(message):,} characters in all)"
    budget, used, cut = limit - len(tail), 0, 0
    for cut, ch in enumerate(message):
        used += sent(ch)
        if used > budget:
            break
    return message[:cut] + tail


async def abort(context: grpc.aio.ServicerContext, err: Exception, log) -> None:
    """End the call with err's status: a FeederError's own code (and `feeder-elsewhere` when
    another feeder may serve the request), anything else INTERNAL (logged: it is our bug)."""
    if isinstance(err, FeederError):
        await context.abort(STATUS[err.code], capped(err.message),
                            trailing_metadata=((ELSEWHERE, "1"),) if err.elsewhere else ())
    log.exception("internal error", exc_info=err)
    await context.abort(grpc.StatusCode.INTERNAL, capped(f"internal error: {err.__class__.__name__}: {err}"))


def parser(message_type):
    """A request deserializer that never raises. gRPC answers UNKNOWN when a deserializer
    raises, and a caller that sent bytes which are not the request deserves INVALID_ARGUMENT;
    so a malformed request arrives at the handler as the InvalidArgument to answer with (the
    AuthInterceptor lets it through to here once the token is checked: it names no job)."""
    name = message_type.DESCRIPTOR.full_name

    def parse(data: bytes):
        try:
            return message_type.FromString(data)
        except DecodeError as e:
            return InvalidArgument(f"the request is not a valid {name}: its {len(data)} bytes do not parse "
                                   f"as that protobuf message ({str(e).rpartition(': ')[2]})")
    return parse


def spec_from_request(r: pb.StreamRequest, engine: Engine) -> StreamSpec:
    """The StreamSpec of a request (InvalidArgument when it is not one); the engine picks the
    compression where the request leaves it open."""
    if r.compression not in (pb.COMPRESSION_UNSPECIFIED, *COMPRESSION_NAME):
        raise FeederError(f"compression must be NONE or ZSTD, got enum value {r.compression}",
                          code=Code.INVALID_ARGUMENT)
    compression, level = engine.compression(COMPRESSION_NAME.get(r.compression, ""), r.compression_level, r.rtt_us)
    return StreamSpec(job=r.job, rank=r.rank, world_size=r.world_size, seq_len=r.seq_len,
                      micro_batch=r.micro_batch, seed=r.seed, shuffle=r.shuffle, drop_last=r.drop_last,
                      epoch=r.epoch, num_epochs=r.num_epochs, compression=compression, compression_level=level,
                      worker_index=r.worker_index, num_workers=max(1, r.num_workers),
                      worker_phase=r.worker_phase, reshard=r.reshard,
                      expected_fingerprint=r.expected_fingerprint, dataset=r.dataset, bad_records=r.bad_records,
                      client_started_ns=r.client_started_ns, continued=r.continued, hedge=r.hedge,
                      mixture=tuple((m.source, m.weight) for m in r.mixture), epoch_samples=r.epoch_samples,
                      remix=r.remix, permutation=r.permutation, packing=r.packing or "concat",
                      boundaries=r.boundaries, member=r.member, members=max(1, r.members), cp_rank=r.cp_rank,
                      cp_size=max(1, r.cp_size), cp_layout=r.cp_layout or "zigzag", global_batch=r.global_batch,
                      accumulation=max(1, r.accumulation), start_replicas=r.start_replicas, first_step=r.first_step,
                      mixture_schedule=r.mixture_schedule)


def stream_request(spec: StreamSpec, cursor: bytes | None = None, *, worker_phase: int | None = None,
                   reshard: bool | None = None, failover: bool = False, rtt_s: float = 0.0,
                   client_started_ns: int | None = None, continued: bool | None = None,
                   permutation: str | None = None, hedge: bool | None = None) -> pb.StreamRequest:
    """The StreamRequest of a spec: the inverse of spec_from_request (which also fills in the
    feeder's choices). worker_phase, reshard, client_started_ns and continued default to the spec's; rtt_s
    (inf: unknown) lets the feeder tell a remote rank; `permutation` names the client's torch
    release's kind where the spec says "torch"."""
    s = spec
    return pb.StreamRequest(
        job=s.job, rank=s.rank, world_size=s.world_size, seq_len=s.seq_len, micro_batch=s.micro_batch,
        seed=s.seed, shuffle=s.shuffle, drop_last=s.drop_last, epoch=s.epoch, num_epochs=s.num_epochs,
        cursor=cursor or b"", compression=COMPRESSION_ENUM[s.compression],
        compression_level=s.compression_level, worker_index=s.worker_index, num_workers=s.num_workers,
        worker_phase=s.worker_phase if worker_phase is None else worker_phase,
        reshard=s.reshard if reshard is None else reshard, expected_fingerprint=s.expected_fingerprint,
        dataset=s.dataset, failover=failover, bad_records=s.bad_records,
        rtt_us=min(int(rtt_s * 1e6), 2**32 - 1) if rtt_s != float("inf") else 0,
        client_started_ns=s.client_started_ns if client_started_ns is None else client_started_ns,
        continued=s.continued if continued is None else continued, hedge=s.hedge if hedge is None else hedge,
        mixture=[pb.MixtureSource(source=n, weight=w) for n, w in s.mixture], epoch_samples=s.epoch_samples,
        remix=s.remix, permutation=s.permutation if permutation is None else permutation,
        packing="" if s.packing == "concat" else s.packing, boundaries=s.boundaries, member=s.member,
        members=s.members, cp_rank=s.cp_rank, cp_size=s.cp_size, cp_layout=s.cp_layout, global_batch=s.global_batch,
        accumulation=s.accumulation, start_replicas=s.start_replicas, first_step=s.first_step,
        mixture_schedule=s.mixture_schedule)


def waiting_reply(region: str, waiting: str) -> bytes:
    """A Stream reply without batches: the stream is being prepared, or its next batches wait on
    something being built (`waiting` says what)."""
    return pb.StreamReply(region=region, waiting=capped(waiting)).SerializeToString()


def status_reply(status: ProcessStatus) -> pb.StatusReply:
    """The StatusReply of a ProcessStatus (Engine.status)."""
    reply = pb.StatusReply(region=status.region, uptime_s=status.uptime_s, streams_open=status.streams_open,
                           rss_mb=status.rss_mb, tasks=status.tasks, threads=status.threads,
                           processes=status.processes, chunks_changed=status.chunks_changed,
                           scrubbed_bytes=status.scrubbed_bytes, building=status.building, preparing=status.preparing,
                           packings=status.packings, cache_damaged=status.cache_damaged,
                           cache_problems=status.cache_problems, stuck=status.stuck, load=status.load)
    for j in status.jobs:
        js = reply.jobs.add(job=j.job, dataset=j.dataset, world_size=j.world_size, elastic=j.elastic,
                            streams_open=j.streams_open, mixture=j.mixture)
        for r in j.ranks:
            rs = js.ranks.add(**{f.name: getattr(r, f.name) for f in dataclasses.fields(r) if f.name != "members"})
            for m in r.members:
                rs.members.add(**{f.name: getattr(m, f.name) for f in dataclasses.fields(m)})
    return reply


# StatusReply's figures of the whole process (all processes of the port): a caller scoped to
# some jobs is told none of them (its own jobs' streams_open instead of everyone's).
PROCESS_WIDE = ("rss_mb", "tasks", "threads", "chunks_changed", "scrubbed_bytes", "cache_damaged")


def scoped_status(reply: pb.StatusReply, job: str = "") -> pb.StatusReply:
    """A StatusReply (this process's, or all processes' of the port merged) cut to one job
    (NOT_FOUND naming only the jobs the caller may see) and to the caller's scope: its jobs, the
    packings of its datasets, and streams_open counting its jobs' streams only. What describes
    the whole process (memory, tasks, threads, the scrub's and the cache's counts, what is being
    built or prepared: every team's streams make them, issue 44.6) only to a caller who may see
    everything; to the others those fields are 0 or empty."""
    sc = scope.current()
    keep = [j for j in reply.jobs if (not job or j.job == job) and sc.job(j.job, j.dataset)]
    if job and not keep:
        raise unknown_job(job, (j.job for j in reply.jobs if sc.job(j.job, j.dataset)))
    if len(keep) != len(reply.jobs):
        del reply.jobs[:]
        reply.jobs.extend(keep)
    if not sc.everything:
        packings = [p for p in reply.packings if sc.dataset(p.split(" seq_len ", 1)[0])]   # (packed.describe)
        del reply.packings[:]
        reply.packings.extend(packings)
        del reply.building[:]
        del reply.preparing[:]
        del reply.cache_problems[:]   # (the process's directory: the operator's)
        stuck = [x for x in reply.stuck if sc.dataset(x.partition(":")[0].split("+")[0])]   # (its datasets')
        del reply.stuck[:]
        reply.stuck.extend(stuck)
        reply.streams_open = sum(j.streams_open for j in keep)
        for name in PROCESS_WIDE:
            reply.ClearField(name)
    return reply


def info_reply(engine: Engine, src: Source, fingerprint: str) -> pb.InfoReply:
    """The InfoReply of a dataset served by this engine (naming the datasets the caller may read)."""
    return pb.InfoReply(fingerprint=fingerprint, n_tokens=src.n_tokens, n_documents=src.n_documents,
                        vocab_size=src.vocab_size, eos_id=src.eos_id, dtype=DTYPE_ENUM[src.dtype.name],
                        region=engine.cfg.region, version=engine.version,
                        datasets=scope.current().names(engine.sources, "dataset"),
                        peers=dict(engine.cfg.peers), load=engine.load,
                        # (the caller's datasets' only: another team's are not named)
                        stuck=[s for s in engine.stuck if scope.current().names(s.partition(":")[0].split("+"), "dataset")])

"""Thin servicer: proto -> StreamSpec, domain -> proto, FeederError -> status code."""
from __future__ import annotations

import asyncio
import functools
import logging
import threading
import time

import google_crc32c
import grpc

from feeder.config import StreamSpec
from feeder.engine import Engine
from feeder.errors import COMPLETE, ELSEWHERE, END, Code, FeederError
from feeder.pipeline.batcher import Block
from feeder.pipeline.stream import unknown_job
from feeder.siblings import merge
from feeder.v1 import feeder_pb2 as pb
from feeder.v1 import feeder_pb2_grpc as pb_grpc

log = logging.getLogger("feeder.service")
SERVICE = pb.DESCRIPTOR.services_by_name["Feeder"].full_name

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
COMPRESSION_NAME = {pb.COMPRESSION_NONE: "none", pb.COMPRESSION_ZSTD: "zstd"}
COMPRESSION_ENUM = {"none": pb.COMPRESSION_NONE, "zstd": pb.COMPRESSION_ZSTD}
DTYPE_ENUM = {"uint16": pb.DTYPE_UINT16, "uint32": pb.DTYPE_UINT32}


async def _abort(context: grpc.aio.ServicerContext, err: Exception):
    if isinstance(err, FeederError):
        await context.abort(STATUS[err.code], err.message,
                            trailing_metadata=((ELSEWHERE, "1"),) if err.elsewhere else ())
    log.exception("internal error", exc_info=err)
    await context.abort(grpc.StatusCode.INTERNAL, f"internal error: {err.__class__.__name__}: {err}")


def unary(fn):
    @functools.wraps(fn)
    async def wrapper(self, request, context):
        try:
            return await fn(self, request, context)
        except (FeederError, ValueError, TypeError) as e:
            await _abort(context, e)
    return wrapper


def spec_from_request(r: pb.StreamRequest, engine: Engine) -> StreamSpec:
    cfg = engine.cfg
    if r.compression not in (pb.COMPRESSION_UNSPECIFIED, *COMPRESSION_NAME):
        raise FeederError(f"compression must be NONE or ZSTD, got enum value {r.compression}",
                          code=Code.INVALID_ARGUMENT)
    # A rank that leaves compression to us gets the feeder's default, except that a remote
    # one (its measured RTT at least remote_rtt_ms) always gets zstd: over a long link bytes
    # cost more than the CPU to shrink them.
    remote = r.rtt_us > 0 and r.rtt_us >= cfg.remote_rtt_ms * 1000
    compression = COMPRESSION_NAME.get(r.compression, "zstd" if remote else cfg.default_compression)
    level = r.compression_level if r.compression_level else cfg.default_level
    return StreamSpec(job=r.job, rank=r.rank, world_size=r.world_size, seq_len=r.seq_len,
                      micro_batch=r.micro_batch, seed=r.seed, shuffle=r.shuffle, drop_last=r.drop_last,
                      epoch=r.epoch, num_epochs=r.num_epochs, compression=compression, compression_level=level,
                      worker_index=r.worker_index, num_workers=max(1, r.num_workers),
                      worker_phase=r.worker_phase, reshard=r.reshard,
                      expected_fingerprint=r.expected_fingerprint, dataset=r.dataset, bad_records=r.bad_records)


def to_proto(block: Block, region: str) -> pb.StreamReply:
    """The protobuf object of a reply (the stream itself sends wire.encode_reply's bytes)."""
    bounds, tokens, out = block.bounds(), block.token_array(), []
    for j in range(len(block)):
        a, b = bounds[j], bounds[j + 1]
        raw = tokens[a:b].tobytes()
        out.append(pb.Batch(epoch=int(block.epochs[j]), step=int(block.steps[j]), n=b - a, sample_len=block.sample_len,
                            dtype=DTYPE_ENUM[block.dtype], compression=COMPRESSION_ENUM[block.compression],
                            tokens=raw if block.payloads is None else block.payloads[j],
                            sample_ids=block.ids[a:b].astype("<i8").tobytes(), cursor=block.cursors[j],
                            raw_size=len(raw), crc32c=google_crc32c.value(raw)))
    return pb.StreamReply(batches=out, region=region)


def status_reply(e: Engine, job: str = "") -> pb.StatusReply:
    """This process's jobs and ranks: one job (NOT_FOUND if unknown), or all."""
    jobs = [e.jobs.get(job)] if job else list(e.jobs.jobs.values())
    reply = pb.StatusReply(region=e.cfg.region, uptime_s=time.monotonic() - e.started,
                           streams_open=e.jobs.streams_open, rss_mb=e.rss_mb(),
                           tasks=len(asyncio.all_tasks()), threads=threading.active_count(), processes=1)
    for j in jobs:
        js = reply.jobs.add(job=j.job, dataset=j.dataset or e.default, world_size=j.world_size)
        for r in sorted(j.ranks.values(), key=lambda r: r.rank):
            epoch, done = r.position
            js.ranks.add(rank=r.rank, connected=r.connected, epoch=epoch, samples_done=done,
                         samples_in_epoch=r.samples_in_epoch, batches_sent=r.batches_sent,
                         bytes_sent=r.bytes_sent, tokens_per_s=r.tokens_per_s,
                         queue_depth=r.queue_depth,
                         data_wait_fraction=r.data_wait_fraction, last_error=r.last_error, peer=r.peer,
                         restarts=max(0, r.streams_opened - 1), failovers=r.failovers,
                         tokens_sent=r.tokens_sent, bad_records=r.bad_records, region=e.cfg.region,
                         state=r.state)
    return reply


def add_to_server(servicer: "FeederServicer", server) -> None:
    """Like the generated add_FeederServicer_to_server, except that Stream's replies arrive
    already serialized (bytes, built off the event loop) and go to gRPC as they are."""
    handlers = {
        "Stream": grpc.unary_stream_rpc_method_handler(
            servicer.Stream, request_deserializer=pb.StreamRequest.FromString, response_serializer=None),
        "Info": grpc.unary_unary_rpc_method_handler(
            servicer.Info, request_deserializer=pb.InfoRequest.FromString,
            response_serializer=pb.InfoReply.SerializeToString),
        "Status": grpc.unary_unary_rpc_method_handler(
            servicer.Status, request_deserializer=pb.StatusRequest.FromString,
            response_serializer=pb.StatusReply.SerializeToString),
        "Report": grpc.unary_unary_rpc_method_handler(
            servicer.Report, request_deserializer=pb.ReportRequest.FromString,
            response_serializer=pb.ReportReply.SerializeToString),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    if hasattr(server, "add_registered_method_handlers"):
        server.add_registered_method_handlers(SERVICE, handlers)


class FeederServicer(pb_grpc.FeederServicer):
    def __init__(self, engine: Engine):
        self.engine = engine

    async def Stream(self, request, context):
        engine = self.engine
        try:
            spec = spec_from_request(request, engine)
            stream = await engine.open_stream(spec, request.cursor, peer=context.peer(), failover=request.failover)
        except FeederError as e:
            await _abort(context, e)
        reason = "cancelled by client"
        try:
            async for msg, reply in stream.messages():
                yield reply
                stream.state.sent(msg, len(reply))
                engine.delivered(stream, msg)
            # Only a stream that ran to its plan's end says so: any other end (a feeder going
            # away, a proxy closing the call) is a break the client resumes from its cursor.
            context.set_trailing_metadata(((END, COMPLETE),))
            reason = "finished"
        except FeederError as e:
            reason = f"{e.code.name}: {e.message}"
            await _abort(context, e)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            reason = f"INTERNAL: {e}"
            await _abort(context, e)
        finally:
            engine.close_stream(stream, reason)

    @unary
    async def Info(self, request, context):
        e = self.engine
        src = e.source(request.dataset)
        fingerprint = await asyncio.to_thread(lambda: src.fingerprint)  # Kafka asks the broker
        return pb.InfoReply(fingerprint=fingerprint, n_tokens=src.n_tokens, n_documents=src.n_documents,
                            vocab_size=src.vocab_size, eos_id=src.eos_id, dtype=DTYPE_ENUM[src.dtype.name],
                            region=e.cfg.region, version=e.version, datasets=sorted(e.sources),
                            peers=dict(e.cfg.peers))

    @unary
    async def Status(self, request, context):
        e = self.engine
        e.jobs.evict_idle()
        if e.siblings is None:
            return status_reply(e, request.job)
        # One process of several on this port: the others' status too, so any one answers for all.
        reply = merge(status_reply(e), await asyncio.to_thread(e.siblings.others))
        if request.job:
            keep = [j for j in reply.jobs if j.job == request.job]
            if not keep:
                raise unknown_job(request.job, (j.job for j in reply.jobs))
            del reply.jobs[:]
            reply.jobs.extend(keep)
        return reply

    @unary
    async def Report(self, request, context):
        self.engine.report(request.job, request.rank, request.wait_s, request.step_s,
                           (request.epoch, request.step) if request.has_position else None, request.batches)
        return pb.ReportReply()

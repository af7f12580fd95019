"""Thin servicer: each handler converts the request (feeder.service.convert), asks the Engine,
and converts the answer back; a FeederError becomes its status code in convert.abort."""
from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time

import grpc

from feeder.core import scope
from feeder.domain.engine import Engine
from feeder.sources import preparing
from feeder.core.errors import COMPLETE, END, FeederError, Unavailable
from feeder.service import convert
from feeder.service.convert import FEED, SERVICE, spec_from_request
from feeder.service.convert import STATUS  # noqa: F401  (server.py hands it to the AuthInterceptor from here)
from feeder.domain.siblings import merge
from feeder.v1 import feeder_pb2 as pb
from feeder.v1 import feeder_pb2_grpc as pb_grpc

log = logging.getLogger("feeder.service")


def status_reply(e: Engine, job: str = "") -> pb.StatusReply:
    """This process's jobs and ranks as a StatusReply: one job (NOT_FOUND if unknown), or all."""
    return convert.status_reply(e.status(job))


async def _abort(context: grpc.aio.ServicerContext, err: Exception):
    await convert.abort(context, err, log)


def unary(fn):
    @functools.wraps(fn)
    async def wrapper(self, request, context):
        try:
            return await fn(self, request, context)
        except (FeederError, ValueError, TypeError) as e:
            await _abort(context, e)
    return wrapper


# What grpc.aio raises when a message cannot go out because the call is gone (the peer reset it):
# a client killed mid-stream. Left to gRPC (replies yielded), it is logged as an ERROR with a
# traceback for every such client; written here, it ends the call quietly. (gRPC has no public
# name for it; without it, nothing is caught and gRPC logs as before.)
try:
    from grpc._cython.cygrpc import ExecuteBatchError as _CALL_GONE
except ImportError:
    _CALL_GONE = ()


def _refusing_malformed(behavior, streaming: bool):
    if streaming:
        async def stream(request, context):
            if isinstance(request, FeederError):
                await _abort(context, request)
            # aclosing: when the call ends early, the handler's own cleanup runs now, not at GC.
            async with contextlib.aclosing(behavior(request, context)) as replies:
                async for reply in replies:
                    try:
                        await context.write(reply)
                    except _CALL_GONE:   # (the handler's cleanup closes the stream: "cancelled by client")
                        return
        return stream

    async def unary_behavior(request, context):
        if isinstance(request, FeederError):
            await _abort(context, request)
        return await behavior(request, context)
    return unary_behavior


def add_to_server(servicer: "FeederServicer", server) -> None:
    """Like the generated add_FeederServicer_to_server, except that Stream's replies arrive
    already serialized (bytes, built off the event loop) and go to gRPC as they are, and that
    a request which does not parse is refused with INVALID_ARGUMENT (see convert.parser)."""
    def handler(kind, name: str, request, reply):
        return kind(_refusing_malformed(getattr(servicer, name), streaming=reply is None),
                    request_deserializer=convert.parser(request),
                    response_serializer=None if reply is None else reply.SerializeToString)

    handlers = {
        "Stream": handler(grpc.unary_stream_rpc_method_handler, "Stream", pb.StreamRequest, None),
        "Info": handler(grpc.unary_unary_rpc_method_handler, "Info", pb.InfoRequest, pb.InfoReply),
        "Status": handler(grpc.unary_unary_rpc_method_handler, "Status", pb.StatusRequest, pb.StatusReply),
        "Report": handler(grpc.unary_unary_rpc_method_handler, "Report", pb.ReportRequest, pb.ReportReply),
        "Mix": handler(grpc.unary_unary_rpc_method_handler, "Mix", pb.MixRequest, pb.MixReply),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    if hasattr(server, "add_registered_method_handlers"):
        server.add_registered_method_handlers(SERVICE, handlers)


WAITING_NOTE_S = 1.0   # well inside a client's idle timeout (30 s by default; a loaded host's beats lag)


def _drop_opened(engine: Engine, opening: asyncio.Future) -> None:
    """A stream that opened after its client left: close it at once (its plan lets go)."""
    if opening.cancelled() or opening.exception() is not None:
        return
    stream = opening.result()
    stream.end(Unavailable("the client left before its stream opened"))
    engine.close_stream(stream, "cancelled by client")


class FeederServicer(pb_grpc.FeederServicer):
    def __init__(self, engine: Engine):
        self.engine = engine

    async def Stream(self, request, context):
        engine = self.engine
        try:
            spec = spec_from_request(request, engine)
            left: list[bool] = []
            opening = asyncio.ensure_future(engine.open_stream(spec, request.cursor, peer=context.peer(),
                                                               failover=request.failover, left=lambda: bool(left)))
            # Opening may take long (a Kafka epoch's snapshot is built first): say so every few
            # seconds, so the rank waits instead of taking the silence for a dead feeder.
            try:
                while not (await asyncio.wait({opening}, timeout=WAITING_NOTE_S))[0]:
                    yield convert.waiting_reply(engine.cfg.region, preparing.summary())
            except BaseException:   # the client left while it waited: the stream is not attached, or dropped once open
                left.append(True)
                opening.add_done_callback(functools.partial(_drop_opened, engine))
                raise
            stream = opening.result()
        except FeederError as e:
            await _abort(context, e)
        reason = "cancelled by client"
        try:
            async for msg, reply in stream.messages():
                if msg is None:   # nothing to send yet: the rank is told why (`reply` says)
                    yield convert.waiting_reply(engine.cfg.region, reply)
                    continue
                # Into the ledger before gRPC has it: a feeder killed right after the send
                # must not leave a batch the rank received out of the ledger. A batch logged
                # but never received is sent again by the next feeder, which the audit counts
                # once (same world, rank, step and ids).
                engine.delivered(stream, msg)
                yield reply
                stream.state.sent(msg, len(reply))
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
        src = self.engine.source(request.dataset)
        fingerprint = await asyncio.to_thread(lambda: src.fingerprint)  # Kafka asks the broker
        return convert.info_reply(self.engine, src, fingerprint)

    @unary
    async def Status(self, request, context):
        e = self.engine
        e.jobs.evict_idle()
        reply = status_reply(e)
        if e.siblings is not None:   # one process of several on this port: any one answers for all
            reply = await self._all_processes(reply, request.job)
        return convert.scoped_status(reply, request.job)

    async def _all_processes(self, own: pb.StatusReply, job: str) -> pb.StatusReply:
        """This process's status merged with the other processes'. A job asked for may have run
        on another process a moment ago, its status still to be written there (each process
        writes through on a change, but at most once per COALESCE_S): the others are read again
        until each wrote one taken after this call came, for a little more than COALESCE_S
        where the view shows the job, and where it does not (NOT_FOUND otherwise) until the
        once-a-second write is overdue (a hung process)."""
        from feeder.domain import siblings

        e, came, start = self.engine, time.time(), time.monotonic()
        while True:
            others, fresh = await asyncio.to_thread(e.siblings.read, came)
            reply = merge(own, others)
            sc = scope.current()
            # (a job the caller may not see waits as an unknown one does: no answer is quicker)
            shown = any(j.job == job and sc.job(j.job, j.dataset) for j in reply.jobs)
            patience = siblings.COALESCE_S + 0.15 if shown else siblings.EVERY_S + 0.5
            if not job or fresh or time.monotonic() - start >= patience:
                return reply
            await asyncio.sleep(0.02)
            own = status_reply(e)

    @unary
    async def Mix(self, request, context):
        at, schedule, known = await asyncio.to_thread(self.engine.mix, request.job, request.phase, request.schedule,
                                                      request.at)
        if request.phase == 2:
            self.engine.record_mix(request.job, at, schedule)
        return pb.MixReply(known=known, at=at, schedule=schedule)

    @unary
    async def Report(self, request, context):
        if request.has_commit:   # an elastic job's step ended (off the trainer's critical path)
            self.engine.commit(request.job, request.rank, request.committed_step, request.committed,
                               request.replicas, request.step_cursor)
            return pb.ReportReply()
        feed = None
        if request.target:   # a client that says how it is fed (issue 45)
            feed = {k: getattr(request, k) for k in FEED}
        self.engine.report(request.job, request.rank, request.wait_s, request.step_s,
                           (request.epoch, request.step) if request.has_position else None, request.batches, feed)
        return pb.ReportReply()

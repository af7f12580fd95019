"""`feeder mix`: change a running job's mixture schedule live (docs/mixtures.md, "Live changes").

Two phases over every feeder that serves the job (feeder.domain.schedules): prepare (each stops
planning the job's samples past the next block boundary and says where that is), then commit of
the whole new schedule from the largest of those, P. Every rank switches at P, past everything
any feeder had planned, so nothing already sent changes.
"""
from __future__ import annotations

import grpc

from feeder.core import schedule as sc
from feeder.core.config import load_toml
from feeder.core.errors import Code, FeederError, NotFound, Unavailable
from feeder.service.security import ClientSecurity, explain

PREPARE, COMMIT, ABORT = 1, 2, 3


def _call(target: str, security: ClientSecurity, request, timeout: float):
    from feeder.v1 import feeder_pb2_grpc as pb_grpc

    with security.channel(target) as ch:
        try:
            return pb_grpc.FeederStub(ch).Mix(request, timeout=timeout, metadata=security.metadata())
        except grpc.RpcError as e:
            code = e.code()
            if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                raise Unavailable(f"cannot reach feeder at {explain(e, target, security)}") from None
            if code == grpc.StatusCode.UNIMPLEMENTED:
                raise FeederError(f"{target} runs a feeder release without live mixture changes (Mix); upgrade it "
                                  "first", code=Code.FAILED_PRECONDITION) from None
            raise FeederError(f"{target}: {e.details()}", code=getattr(Code, code.name, Code.INTERNAL)) from None


def abort(targets: list[str], job: str, *, security: ClientSecurity = ClientSecurity(), timeout: float = 10.0,
          out=print) -> None:
    """End a prepared change on every feeder named."""
    from feeder.v1 import feeder_pb2 as pb

    for t in targets:
        _call(t, security, pb.MixRequest(job=job, phase=ABORT), timeout)
    out(f"job {job}: any mixture change prepared on {len(targets)} feeder(s) was let go")


def _abort_all(targets: list[str], job: str, security: ClientSecurity, timeout: float) -> None:
    """Let go of a prepared hold wherever it can (one that cannot be reached keeps it until
    feeder mix or feeder mix --abort reaches it)."""
    from feeder.v1 import feeder_pb2 as pb

    for t in targets:
        try:
            _call(t, security, pb.MixRequest(job=job, phase=ABORT), timeout)
        except FeederError:
            pass


def mix(targets: list[str], job: str, path: str, *, relative: bool = False, seq_len: int = 0,
        security: ClientSecurity = ClientSecurity(), timeout: float = 10.0, out=print) -> sc.Schedule:
    """Change `job`'s schedule to the one in TOML file `path` (boundaries in the job's progress,
    or, with `relative`, counted from where the change takes effect). Returns the schedule in force."""
    from feeder.v1 import feeder_pb2 as pb

    change = sc.parse(load_toml(path), seq_len=seq_len)
    prepared = []
    try:   # every prepared feeder lets its hold go if anything fails before the commit, or its streams would wait
        for t in targets:
            prepared.append((t, _call(t, security, pb.MixRequest(job=job, phase=PREPARE), timeout)))
        known = [(t, r) for t, r in prepared if r.known]
        if not known:
            raise NotFound(f"no feeder of {', '.join(targets)} serves job {job!r} with a mixture schedule (a job "
                           "started with mixture_schedule, whose ranks have opened a stream)")
        current = max((sc.Schedule.from_canonical(r.schedule) for _, r in known), key=lambda s: s.version)
        at = max(r.at for _, r in known)
        if relative:
            change = sc.shifted(change, at)
        new = sc.spliced(current, change, at)
    except Exception:
        _abort_all([t for t, _ in prepared], job, security, timeout)
        raise
    failed, refused = [], 0
    for t in targets:
        try:
            _call(t, security, pb.MixRequest(job=job, phase=COMMIT, schedule=new.canonical(), at=at), timeout)
        except FeederError as e:
            failed.append(f"{t}: {e}")
            refused += e.code in (Code.INVALID_ARGUMENT, Code.FAILED_PRECONDITION)
    # Refused by every feeder (not lost on the way: a commit whose answer was lost may have been
    # taken): nothing changed, and no rank need wait for it.
    if refused == len(targets):
        _abort_all(targets, job, security, timeout)
        raise FeederError(f"job {job!r}: no feeder took schedule version {new.version} (nothing changed; each let "
                          "go of its hold): " + "; ".join(failed), code=Code.FAILED_PRECONDITION)
    if failed:
        raise FeederError(f"job {job!r}: schedule version {new.version} from progress {at:,} was taken by "
                          f"{len(targets) - len(failed)} of {len(targets)} feeders; not by " + "; ".join(failed)
                          + ". Their ranks wait at the change point until it is committed there: run feeder mix again "
                          "once they are reachable (or feeder mix --abort)", code=Code.UNAVAILABLE)
    out(f"job {job}: mixture schedule version {new.version} from progress {at:,} on {len(targets)} feeder(s): "
        f"{new.shown()}")
    return new

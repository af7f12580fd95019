"""Domain errors. Knows nothing of gRPC: the servicer maps Code to a status in one place."""
from __future__ import annotations

import enum


class Code(enum.Enum):
    INVALID_ARGUMENT = "invalid_argument"      # the caller sent something malformed
    FAILED_PRECONDITION = "failed_precondition"  # valid, but not for this dataset/job/state
    NOT_FOUND = "not_found"
    DATA_LOSS = "data_loss"                    # stored data is corrupt; never served
    UNAUTHENTICATED = "unauthenticated"
    PERMISSION_DENIED = "permission_denied"
    RESOURCE_EXHAUSTED = "resource_exhausted"
    UNAVAILABLE = "unavailable"                # try again, maybe elsewhere
    INTERNAL = "internal"                      # our bug, never the caller's mistake


# Trailing metadata key on refusals with FeederError.elsewhere set.
ELSEWHERE = "feeder-elsewhere"
# Trailing metadata of a stream that ran to its end (END: COMPLETE); an OK status without it
# is not an end.
END, COMPLETE = "feeder-end", "complete"


_BY_CODE: dict[Code, type] = {}


class FeederError(Exception):
    """The root of the feeder's errors. `FeederError(message, code=C)` is an instance of the
    subclass for C (InvalidArgument, FailedPrecondition, ...), so an error rebuilt from its
    type and message alone keeps its code: pickled, or re-raised by torch's DataLoader from a
    worker (which calls `type(e)(message)`)."""

    code: Code = Code.INTERNAL
    # True when the refusal is about this feeder's data, not the request: another region's
    # replica may serve it, so clients move on to their next target (sent as trailing metadata).
    elsewhere: bool = False

    def __new__(cls, message: str = "", *, code: Code | None = None, elsewhere: bool | None = None):
        if cls is FeederError and code is not None:
            cls = _BY_CODE.get(code, FeederError)
        return super().__new__(cls, message)

    def __init_subclass__(cls, **kw):
        super().__init_subclass__(**kw)
        if "code" in cls.__dict__:
            _BY_CODE.setdefault(cls.code, cls)   # the first class of a code is its plain one

    def __init__(self, message: str, *, code: Code | None = None, elsewhere: bool | None = None):
        super().__init__(message)
        if code is not None:
            self.code = code
        if elsewhere is not None:
            self.elsewhere = elsewhere

    @property
    def message(self) -> str:
        return str(self)


class InvalidArgument(FeederError):
    code = Code.INVALID_ARGUMENT


class FailedPrecondition(FeederError):
    code = Code.FAILED_PRECONDITION


class NotFound(FeederError):
    code = Code.NOT_FOUND


class WrongReplica(FailedPrecondition):
    """This feeder's data is not what the job reads (another fingerprint, topic or epoch)."""

    elsewhere = True


class DataLoss(FeederError):
    """This feeder's copy of the data is corrupt: another replica of the same fingerprint may
    be sound, so the client moves on to its next target before it gives up."""

    code = Code.DATA_LOSS
    elsewhere = True


class Unavailable(FeederError):
    code = Code.UNAVAILABLE


class ResourceExhausted(FeederError):
    code = Code.RESOURCE_EXHAUSTED


class InputError(FeederError):
    """A user's input file is unusable (missing, malformed): `feeder prep`/`publish` exit 2."""

    code = Code.INVALID_ARGUMENT


class Unauthenticated(FeederError):
    code = Code.UNAUTHENTICATED


class PermissionDenied(FeederError):
    code = Code.PERMISSION_DENIED


class Internal(FeederError):
    code = Code.INTERNAL

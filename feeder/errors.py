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


class FeederError(Exception):
    code: Code = Code.INTERNAL

    def __init__(self, message: str, *, code: Code | None = None):
        super().__init__(message)
        if code is not None:
            self.code = code

    @property
    def message(self) -> str:
        return str(self)


class InvalidArgument(FeederError):
    code = Code.INVALID_ARGUMENT


class FailedPrecondition(FeederError):
    code = Code.FAILED_PRECONDITION


class NotFound(FeederError):
    code = Code.NOT_FOUND


class DataLoss(FeederError):
    code = Code.DATA_LOSS


class Unavailable(FeederError):
    code = Code.UNAVAILABLE


class ResourceExhausted(FeederError):
    code = Code.RESOURCE_EXHAUSTED


class InputError(FeederError):
    """A user's input file is unusable (missing, malformed): `feeder prep`/`publish` exit 2."""

    code = Code.INVALID_ARGUMENT

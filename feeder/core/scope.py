"""What the caller of the request being answered may see: its token's jobs and datasets.

Every answer names only what is in its caller's scope (issue 34: a token of job `a-run` read
another team's job names in NOT_FOUND's "known: [...]", and its datasets and figures in Status's
process-wide fields). The service layer sets the scope once per call, from the bearer token
(feeder.service.security); whatever builds a message or a reply below it reads `current()`
instead of having it passed down through every layer. A context variable: each call's task (and
asyncio.to_thread) has its own; a call made without tokens sees everything.
"""
from __future__ import annotations

import contextvars
from dataclasses import dataclass


@dataclass(frozen=True, slots=True, kw_only=True)
class Scope:
    jobs: frozenset[str] | None = None       # None: every job
    datasets: frozenset[str] | None = None   # None: every dataset

    @property
    def everything(self) -> bool:
        return self.jobs is None and self.datasets is None

    def job(self, name: str, dataset: str = "") -> bool:
        """A job may be named to this caller: its name is granted, and so is its dataset (when known)."""
        return (self.jobs is None or name in self.jobs) and (not dataset or self.dataset(dataset))

    def dataset(self, name: str) -> bool:
        return self.datasets is None or name in self.datasets

    def names(self, names, kind: str = "job") -> list[str]:
        """The names of `kind` ("job" or "dataset") this caller may be told of, sorted."""
        keep = self.job if kind == "job" else self.dataset
        return sorted(n for n in names if keep(n))


EVERYTHING = Scope()
_current: contextvars.ContextVar[Scope] = contextvars.ContextVar("feeder_scope", default=EVERYTHING)


def current() -> Scope:
    return _current.get()


def enter(scope: Scope) -> None:
    """The scope of the call this task answers (set by the service before its handler runs)."""
    _current.set(scope)

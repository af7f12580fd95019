"""The fence that keeps a replaced trainer off its replacement's rank (pipeline.jobs.fence),
as a table of who opens what, without a server. tests/test_regressions.py and the harness's
seed 200307 check it end to end; the cases here are the outside review's (pool reuse, a
feeder that lost its state, DataLoader workers with their own start times)."""
from __future__ import annotations

import pytest

from feeder.core.config import StreamSpec
from feeder.core.errors import FailedPrecondition
from feeder.pipeline.jobs import Jobs


class _Stream:
    superseded = False

    def supersede(self):
        self.superseded = True


def _open(jobs: Jobs, started: int, continued: bool, rank: int = 0, worker: int = 0, workers: int = 1):
    spec = StreamSpec(job="j", rank=rank, world_size=2, seq_len=8, micro_batch=2, worker_index=worker,
                      num_workers=workers, client_started_ns=started, continued=continued)
    s = _Stream()
    s.spec = spec
    jobs.attach(spec, s)
    return s


A, B = 100, 200   # two trainer processes' start times: B started later


def test_a_replaced_process_reconnecting_is_refused_and_the_replacement_keeps_the_rank():
    jobs = Jobs()
    a = _open(jobs, A, False)
    _open(jobs, B, False)                       # the restarted trainer takes the rank over
    assert a.superseded
    with pytest.raises(FailedPrecondition, match="no longer holds this rank: it was replaced here"):
        _open(jobs, A, True)                    # A's stream had broken: it reconnects
    _open(jobs, B, True)                        # B's own reconnects go on


def test_an_older_process_that_opens_afresh_takes_the_rank_and_holds_it():
    """A pool of processes reusing a job name: the older process B' opens the rank afresh
    after the newer A had it; A's reconnect is then refused although A is the newer process."""
    jobs = Jobs()
    _open(jobs, B, False)
    _open(jobs, A, False)                       # older, but a first stream: never refused for its age
    _open(jobs, A, True)                        # its own reconnect keeps its hold
    with pytest.raises(FailedPrecondition):
        _open(jobs, B, True)


def test_after_a_feeder_restart_the_younger_of_two_reconnecting_processes_wins_in_either_order():
    for order in ((A, B), (B, A)):
        jobs = Jobs()                           # a restarted feeder knows nobody
        first, second = order
        _open(jobs, first, True)
        if second > first:
            _open(jobs, second, True)           # the replacement displaces a replaced process that came first
        else:
            with pytest.raises(FailedPrecondition, match="started 0.000000100 s later holds it"):
                _open(jobs, second, True)
        with pytest.raises(FailedPrecondition):
            _open(jobs, A, True)                # and the replaced one stays out
        _open(jobs, B, True)


def test_workers_are_fenced_slot_by_slot():
    """FeederClients made in forked DataLoader workers each take their own start time; each
    worker's slot has its own holder, so they never fence each other."""
    jobs = Jobs()
    _open(jobs, A, False, worker=0, workers=2)
    _open(jobs, A + 1, False, worker=1, workers=2)
    _open(jobs, A, True, worker=0, workers=2)
    _open(jobs, A + 1, True, worker=1, workers=2)


def test_clients_that_send_no_start_time_are_neither_fenced_nor_fence():
    jobs = Jobs()
    _open(jobs, 0, False)
    _open(jobs, 0, True)
    _open(jobs, A, True)
    _open(jobs, 0, True)


def test_a_younger_replacement_first_seen_reconnecting_takes_the_slot_from_an_older_holder():
    """Soak seed 600390, `serve --processes 2`: the replacement's first stream went to the other
    process, so this one still had the replaced process as holder when the replacement's
    reconnect arrived. The younger process, not seen here before, takes over; the older one is
    then refused."""
    jobs = Jobs()
    a = _open(jobs, A, False)
    _open(jobs, B, True)                        # B's first stream was elsewhere
    assert a.superseded
    with pytest.raises(FailedPrecondition, match="replaced here"):
        _open(jobs, A, True)


def test_regression_torchft_a_replica_index_is_not_a_process_so_elastic_streams_are_not_fenced():
    """CI, tests/test_elastic_torchft.py: group A held replica 1 on feeder Y, group B then took
    replica 1 there (the quorum changed), A got replica 1 back on feeder X, and when X was
    killed A's continued stream reached Y, which counted A as replaced and refused it: A crashed.
    An elastic job's replica index is handed round by the quorum; it names no process."""
    def elastic(started, continued):
        spec = StreamSpec(job="e", rank=1, world_size=3, seq_len=8, micro_batch=2, global_batch="constant",
                          accumulation=2, start_replicas=3, client_started_ns=started, continued=continued)
        s = _Stream()
        s.spec = spec
        jobs.attach(spec, s)
        return s

    jobs = Jobs()
    elastic(A, False)
    elastic(B, False)                           # another group is replica 1 now
    elastic(A, True)                            # A's failover from the feeder it had replica 1 on again
    elastic(B, True)                            # and an older process's continued stream too

"""feeder_client.policy without a server: what a rank does next after each kind of stream end.

Each test drives Policy with the events FeederClient's reader feeds it (a batch, a complete
end, a break, an error status with or without `feeder-elsewhere`, a failback probe) and a
clock of its own, and checks the action: which target, how long to wait, which error."""
from __future__ import annotations

import pytest

from feeder_client.policy import RETRYABLE, Finish, GiveUp, Policy, Retry, code_of, order_targets, rtt_step
from feeder.core.errors import Code, FeederError

A, B, C = "a:1", "b:1", "c:1"


def policy(targets=(A, B, C), retry_for_s=300.0, failback_s=0.0, now=0.0) -> Policy:
    return Policy(list(targets), retry_for_s, failback_s, now, rank=3)


def test_a_break_moves_to_the_next_target_at_once_and_counts_a_failover():
    p = policy()
    assert p.target == A and not p.after_break
    act = p.broke("a:1: connection reset", now=10.0)
    assert act == Retry(B, 0.0)
    assert p.failovers == 1 and p.after_break   # the next request says failover=true


def test_an_incomplete_end_and_an_idle_timeout_are_breaks_like_any_other():
    p = policy()
    assert p.broke("a:1: the stream ended without its end marker", 0.0) == Retry(B)
    assert p.error("CANCELLED", "feeder a:1: cancelled", "b:1: silent past the idle timeout", 1.0) == Retry(C)
    assert p.failovers == 2


def test_a_complete_end_finishes():
    assert isinstance(policy().stream_complete(), Finish)


def test_backoff_only_after_a_whole_round_then_doubling_up_to_2s():
    p = policy()
    waits = [p.broke("x", now=float(i)).wait_s for i in range(12)]
    # three targets: the first two breaks go straight on, the third ends a round
    assert waits[:2] == [0.0, 0.0]
    assert waits[2:9] == [0.05, 0.1, 0.2, 0.4, 0.8, 1.6, 2.0]
    assert waits[9:] == [2.0, 2.0, 2.0]


def test_a_batch_forgets_the_failures_before_it():
    p = policy(retry_for_s=10.0)
    for i in range(3):
        p.broke("x", now=float(i))
    p.batch_received()
    assert not p.after_break and p.attempt == 0
    # the retry_for_s clock starts again at the next break, and so does the round
    assert p.broke("x", now=100.0).wait_s == 0.0
    assert isinstance(p.broke("x", now=109.0), Retry)


def test_gives_up_after_retry_for_s_without_a_batch_naming_each_target_and_its_last_error():
    p = policy(retry_for_s=5.0)
    assert isinstance(p.broke("a:1: first", now=100.0), Retry)
    assert isinstance(p.broke("b:1: second", now=105.0), Retry)   # 5 s is not past 5 s
    act = p.broke("c:1: connection refused", now=105.5)
    assert isinstance(act, GiveUp) and act.error.code == Code.UNAVAILABLE
    assert str(act.error) == ("no feeder could serve rank 3 for 5s: a:1: first; b:1: second; c:1: connection refused")


@pytest.mark.parametrize("status", sorted(RETRYABLE))
def test_retryable_statuses_are_breaks(status):
    assert policy().error(status, f"feeder a:1: {status}", "a:1: why", 0.0) == Retry(B)


@pytest.mark.parametrize("status,code", [("INVALID_ARGUMENT", Code.INVALID_ARGUMENT),
                                         ("FAILED_PRECONDITION", Code.FAILED_PRECONDITION),
                                         ("DATA_LOSS", Code.DATA_LOSS), ("NOT_FOUND", Code.NOT_FOUND),
                                         ("PERMISSION_DENIED", Code.PERMISSION_DENIED),
                                         ("OUT_OF_RANGE", Code.INTERNAL)])
def test_other_statuses_give_up_with_their_code(status, code):
    act = policy().error(status, "feeder a:1: no", "a:1: no", 0.0)
    assert isinstance(act, GiveUp) and act.error.code == code and str(act.error) == "feeder a:1: no"


def test_a_refusal_elsewhere_skips_that_target_for_good_and_is_raised_only_when_all_refuse():
    p = policy()
    act = p.error("DATA_LOSS", "feeder a:1: corrupt shard", "", 0.0, elsewhere=True)
    assert act == Retry(B, 0.0) and p.failovers == 0   # not a break: no failover, no backoff
    # B breaks: C next; C breaks: the round wraps past the refused A to B
    assert p.broke("b:1: reset", 1.0) == Retry(C)
    assert p.broke("c:1: reset", 2.0).target == B
    assert p.error("NOT_FOUND", "feeder b:1: dataset not here", "", 3.0, elsewhere=True) == Retry(C)
    act = p.error("FAILED_PRECONDITION", "feeder c:1: fingerprint mismatch", "", 4.0, elsewhere=True)
    assert isinstance(act, GiveUp)
    # one line naming each target and why, with the first refusal's code (issue 34)
    assert act.error.code == Code.DATA_LOSS and str(act.error) == (
        "no target can serve rank 3: a:1: corrupt shard; b:1: dataset not here; c:1: fingerprint mismatch")


def test_a_target_listed_twice_refuses_once():
    p = policy(targets=(A, A, B))
    assert p.error("NOT_FOUND", "feeder a:1: no", "", 0.0, elsewhere=True) == Retry(B)
    assert isinstance(p.error("NOT_FOUND", "feeder b:1: no", "", 0.0, elsewhere=True), GiveUp)


def test_a_corrupt_batch_is_a_break_but_other_decode_errors_give_up():
    p = policy()
    assert p.corrupt(FeederError("crc", code=Code.DATA_LOSS), "a:1: crc", 0.0) == Retry(B)
    err = FeederError("odd", code=Code.INVALID_ARGUMENT)
    assert p.corrupt(err, "b:1: odd", 0.0) == GiveUp(err)


def test_failback_probes_the_nearer_targets_every_failback_s_and_moves_back():
    p = policy(failback_s=60.0, now=0.0)
    assert p.failback_due(100.0) == []          # on the most preferred target: nothing to probe
    p.broke("a:1: reset", 1.0)
    p.broke("b:1: reset", 2.0)                   # now on C
    assert p.failback_due(59.0) == []            # not yet failback_s since the last probe
    assert p.failback_due(61.0) == [0, 1]        # nearest first
    assert p.failback_due(62.0) == []            # probed at 61: next at 121
    assert p.failback_probe_answered(1, current=2)
    assert p.failback_due(500.0) == []           # one move pending at a time
    # the reader's stream ends cancelled (by us): move back to B, no failover, no wait
    act = p.error("CANCELLED", "feeder c:1: cancelled", "c:1: cancelled", 130.0)
    assert act == Retry(B, 0.0) and p.failbacks == 1 and p.failovers == 2 and p.failback is None


def test_failback_is_dropped_when_the_rank_moved_meanwhile_and_skips_refused_targets():
    p = policy(failback_s=1.0)
    p.error("NOT_FOUND", "feeder a:1: no", "", 0.0, elsewhere=True)   # A refused: on B
    p.broke("b:1: reset", 0.5)                                         # on C
    assert p.failback_due(5.0) == [1]            # A refused the rank: never probed
    p.broke("c:1: reset", 5.5)                   # moved on to B while the probe ran
    assert not p.failback_probe_answered(1, current=2) and p.failback is None


def test_failback_off_when_failback_s_is_0():
    p = policy(failback_s=0.0)
    p.broke("a:1: reset", 1.0)
    assert p.failback_due(10_000.0) == []


def test_targets_nearest_first_in_steps_keeping_the_given_order_among_equals():
    inf = float("inf")
    rtt = {A: 0.0105, B: 0.0011, C: 0.0110, "d": inf, "e": 0.0019}
    # B and e are both under 2 ms (one step), A and C within 1.5x of each other
    assert order_targets([A, "d", B, C, "e"], rtt, "rtt") == [B, "e", A, C, "d"]
    assert order_targets([A, "d", B], rtt, "order") == [A, "d", B]
    assert rtt_step(inf) == inf and rtt_step(0.0) == rtt_step(0.002) == 0 < rtt_step(0.0031)


def test_status_names_map_to_codes():
    assert code_of("UNAVAILABLE") == Code.UNAVAILABLE and code_of("UNKNOWN") == Code.INTERNAL


def test_while_no_target_ever_answered_it_gives_up_after_connect_timeout_naming_every_target():
    p = Policy([A, B], 300.0, 0.0, 100.0, rank=3, connect_timeout_s=30.0)
    t = 100.0
    while isinstance(act := p.broke(f"{p.target}: UNAVAILABLE: connection refused", t), Retry):
        t += max(act.wait_s, 0.05)
    assert isinstance(act, GiveUp) and act.error.code == Code.UNAVAILABLE
    assert 130.0 <= t <= 130.1     # at connect_timeout_s (the last backoff ends there), not retry_for_s
    assert "connect_timeout_s=30" in str(act.error) and "rank 3" in str(act.error)
    assert f"{A}: UNAVAILABLE: connection refused" in str(act.error) and f"{B}: UNAVAILABLE" in str(act.error)


def test_once_a_target_answered_retry_for_s_keeps_its_meaning():
    for answered in (Policy.batch_received, Policy.reached):
        p = Policy([A], 300.0, 0.0, 0.0, rank=3, connect_timeout_s=30.0)
        answered(p)
        assert isinstance(p.broke("a:1: socket closed", 10.0), Retry)
        assert isinstance(p.broke("a:1: connection refused", 250.0), Retry)   # past connect_timeout_s
        assert isinstance(p.broke("a:1: connection refused", 311.0), GiveUp)


def test_a_failure_is_worth_a_log_line_once_per_target_until_it_changes_or_a_batch_arrives():
    p = policy()
    assert p.worth_logging(A, "refused") and not p.worth_logging(A, "refused")
    assert p.worth_logging(B, "refused") and p.worth_logging(A, "reset") and not p.worth_logging(A, "reset")
    p.batch_received()
    assert p.worth_logging(A, "reset")


def test_among_targets_as_near_an_overloaded_or_stuck_one_goes_after_the_others():
    rtt = {A: 0.001, B: 0.0012, C: 0.2}
    assert order_targets([A, B, C], rtt, "rtt", avoid=frozenset({A})) == [B, A, C]
    assert order_targets([A, B, C], rtt, "rtt", avoid=frozenset({A, B})) == [A, B, C]
    assert order_targets([C, A, B], rtt, "rtt", avoid=frozenset({B})) == [A, B, C], "nearer first, whatever its load"
    assert order_targets([A, B], rtt, "order", avoid=frozenset({A})) == [A, B]

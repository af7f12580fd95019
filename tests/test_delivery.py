"""client.delivery without a server: when a feeder counts as slow or stuck, and the holds that keep
a rank from flapping (issue 45). tests/test_slow.py checks the same through real Toxiproxy links."""
from __future__ import annotations

import pytest

from feeder_client.delivery import Delivery
from feeder_client.policy import Policy


def feed(d: Delivery, t0: float, t1: float, *, step: float, wait: float, net: float, arrive: int = 1) -> float:
    """A loop taking a batch every `step` s of which it waited `wait`, its reader waiting on the
    network `net` of every step, from t0 to t1; returns t1."""
    t = t0
    while t + step <= t1:
        d.net_began(t)
        d.net_ended(t + net)
        if arrive:
            d.arrived(t + net, arrive)
        d.wait_began(t + step - wait)
        d.took(t + step)
        t += step
    return t


def test_a_feeder_that_leaves_the_loop_waiting_while_the_reader_waits_on_it_is_slow():
    d = Delivery(window_s=3, slow_wait=0.05)
    d.opened(0.0)
    t = feed(d, 0.0, 5.0, step=0.08, wait=0.06, net=0.07)
    assert d.verdict(t) == "slow"
    f = d.figures(t)
    assert f["data_wait"] == pytest.approx(0.75, abs=0.05) and f["network_wait"] > 0.8
    assert f["demand_per_s"] == pytest.approx(50, rel=0.1)   # 1 / 20 ms of its own time


def test_no_verdict_while_this_process_is_the_bottleneck_or_the_loop_is_fed():
    d = Delivery(window_s=3, slow_wait=0.05)
    d.opened(0.0)
    # the loop waits, but the reader was not waiting on the network: decoding here is slow
    t = feed(d, 0.0, 5.0, step=0.08, wait=0.06, net=0.01)
    assert d.verdict(t) == ""
    # fed: the loop never waits, whatever the reader does
    t = feed(d, t, t + 5.0, step=0.02, wait=0.0, net=0.019)
    assert d.verdict(t) == ""


def test_no_verdict_within_a_window_of_a_reopen_or_of_the_feeder_saying_it_prepares():
    d = Delivery(window_s=3, slow_wait=0.05)
    d.opened(0.0)
    t = feed(d, 0.0, 5.0, step=0.08, wait=0.06, net=0.07)
    d.opened(t)
    assert d.verdict(t + 1) == ""
    d.preparing(t + 2)
    t = feed(d, t, t + 6.0, step=0.08, wait=0.06, net=0.07)
    assert d.verdict(t) == "", "an epoch's order being built is no slowness"
    t = feed(d, t, t + 3.0, step=0.08, wait=0.06, net=0.07)
    assert d.verdict(t) == "slow"


def test_nothing_delivered_while_the_loop_waits_is_stuck_and_slow_wait_0_never_moves():
    d = Delivery(window_s=3, slow_wait=0.05)
    d.opened(0.0)
    t = feed(d, 0.0, 2.0, step=0.02, wait=0.0, net=0.019)
    d.net_began(t)
    d.wait_began(t)     # the loop waits, the reader waits on a feeder that sends nothing
    assert d.verdict(t + 4) == "stuck"
    off = Delivery(window_s=3, slow_wait=0)
    off.opened(0.0)
    t = feed(off, 0.0, 5.0, step=0.08, wait=0.06, net=0.07)
    assert off.verdict(t) == ""


def test_holds_double_on_a_relapse_and_a_probe_failure_up_to_the_cap():
    d = Delivery(window_s=3, slow_wait=0.05, hold_s=15, max_hold_s=40)
    assert d.leave("a", 0.0) == 15
    assert d.held("a", 10.0) and not d.due_probe("a", 10.0)
    assert d.due_probe("a", 15.0)
    assert d.probe_failed("a", 15.0) == 30
    assert not d.due_probe("a", 40.0) and d.due_probe("a", 45.0)
    d.came_back("a", 46.0)
    assert not d.due_probe("a", 100.0), "in use again: nothing to probe"
    assert d.leave("a", 60.0) == 40, "a relapse soon after coming back: doubled, capped"
    d.came_back("a", 101.0)
    assert d.leave("a", 500.0) == 15, "long after coming back: a new hold"


@pytest.mark.parametrize("rate,demand,ok", [(75, 50, True), (74, 50, False), (12, 50, False), (1, 0, True)])
def test_a_probe_passes_with_half_again_the_loops_demand(rate, demand, ok):
    assert Delivery.probe_passes(rate, demand) is ok


def test_the_policy_counts_moves_apart_from_failovers_and_failbacks():
    p = Policy(["a", "b", "c"], retry_for_s=60)
    assert p.move(2, "slow")
    assert not p.move(1, "slow"), "one move at a time"
    r = p.error("CANCELLED", "cancelled", "a: cancelled", 1.0)   # the stream the move ended
    assert r.target == "c" and (p.moves, p.failovers, p.failbacks, p.last_move) == (1, 0, 0, "slow")
    p.broke("c: reset", 2.0)
    assert p.last_move == "error" and p.failovers == 1


def test_regression_soak_4500031_a_target_that_answered_as_a_feeder_is_not_taken_for_http1_on_a_break():
    garbled = "feeder a: Trying to connect an http1.x server"
    p = Policy(["a"], retry_for_s=60)
    assert p.error("UNAVAILABLE", garbled, "a: garbled", 1.0, answered=True).target == "a"   # a break: again
    fresh = Policy(["a"], retry_for_s=60)
    gave_up = fresh.error("UNAVAILABLE", garbled, "a: garbled", 1.0)
    assert "speaks HTTP/1" in str(gave_up.error), "never answered: a start-up mistake, said at once"

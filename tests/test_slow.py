"""Slow, not dead (issue 45, docs/guarantees.md): a rank moves off, or hedges around, a feeder
that still answers but delivers less than the rank consumes, through real Toxiproxy links
(bandwidth and latency toxics) to real `feeder serve` processes; its ids stay exact against
torch's DistributedSampler throughout."""
from __future__ import annotations

import threading
import time

import pytest

from tests.helpers import FeederProc, byte_stream
# the WAN tests' corpus (2,500 documents) and proxy server, as fixtures of this module too
from tests.test_wan import FEEDER_FLAGS, check_prefix, proxies, wan_dataset, wan_docs  # noqa: F401

pytestmark = pytest.mark.fault

STEP_S = 0.02     # the loop "trains" this long on each batch
SEQ, MB = 2048, 8


class Loop:
    """A training loop on its own thread: takes a batch, trains STEP_S, records (time taken,
    time waited, region); stop() ends it."""

    def __init__(self, ds, step_s: float = STEP_S):
        self.ds, self.got, self.log, self.step_s = ds, [], [], step_s
        self.t0 = time.monotonic()
        self._stop = threading.Event()
        self.error = None
        self.paused = False   # the loop takes nothing while set (a checkpoint, an evaluation)
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        try:
            it = iter(self.ds)
            while not self._stop.is_set():
                if self.paused:
                    time.sleep(0.01)
                    continue
                a = time.monotonic()
                b = next(it)
                now = time.monotonic()
                self.got.append(b)
                self.log.append((now - self.t0, now - a, b.region))
                time.sleep(self.step_s)
        except BaseException as e:   # surfaces in the test
            self.error = e

    def stop(self):
        self._stop.set()
        self.thread.join(30)
        assert self.error is None, repr(self.error)

    def wait_fraction(self, since_s: float, until_s: float = float("inf")) -> float:
        rows = [(t, w) for t, w, _ in self.log if since_s <= t < until_s]
        if len(rows) < 2:
            return 1.0
        return sum(w for _, w in rows) / (rows[-1][0] - rows[0][0] + STEP_S)

    def region_now(self) -> str:
        return self.log[-1][2] if self.log else ""


def wait_until(cond, limit_s: float, what: str):
    deadline = time.monotonic() + limit_s
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def test_a_rank_moves_off_a_feeder_at_a_quarter_of_its_demand_and_back_when_it_heals(wan_dataset, wan_docs,
                                                                                        proxies):
    from feeder_client import FeederDataset

    stream = byte_stream(wan_docs)
    feeders = [FeederProc(wan_dataset, extra=[*FEEDER_FLAGS, "--compression", "none", "--region", r])
               for r in ("a", "b")]
    links = [proxies.proxy(f.address) for f in feeders]
    try:
        ds = FeederDataset({"a": links[0].listen, "b": links[1].listen}, job="slow-move", rank=1, world_size=2,
                           seq_len=SEQ, micro_batch=MB, seed=11, num_epochs=0, prefer="order", compression="none",
                           slow_hold_s=6)   # (15 s by default: back 15-45 s after a target heals)
        per_batch = MB * (SEQ + 1) * 2          # uint16 tokens
        demand = per_batch / STEP_S             # bytes per second the loop takes
        links[0].bandwidth(int(demand / 4 / 1024))   # a quarter of it
        loop = Loop(ds)
        wait_until(lambda: loop.region_now() == "b", 20, "the rank never left the slow feeder")
        left_at = loop.log[-1][0]
        time.sleep(2)
        links[0].clear()                        # the link heals
        healed_at = time.monotonic() - loop.t0
        client = ds.client
        # (batches of the probe's side stream reach the loop before the move: wait for the move itself)
        wait_until(lambda: client.policy.last_move == "failback" and client.target == links[0].listen, 60,
                   "the rank did not come back within a minute")
        back_at = time.monotonic() - loop.t0
        time.sleep(0.5)
        assert loop.region_now() == "a"
        # two healthy feeders of different round trips: the rank stays where it is
        links[0].latency(30)
        moves_before = client.policy.moves + client.failovers + client.failbacks
        time.sleep(6)
        moves_after = client.policy.moves + client.failovers + client.failbacks
        # the feeder serving the rank shows how the client says it is fed (its reports, every 5 s)
        from feeder.ops.status import fetch, render
        (r,) = [r for j in fetch(feeders[0].address, job="slow-move").jobs for r in j.ranks if r.rank == 1]
        from rich.console import Console
        con = Console(width=250)
        with con.capture() as cap:
            con.print(render(fetch(feeders[0].address), feeders[0].address))
        loop.stop()
        wait_after = loop.wait_fraction(left_at + 0.5)
        print(f"left the slow feeder at {left_at:.1f} s, healed at {healed_at:.1f} s, back at {back_at:.1f} s; "
              f"data-wait before leaving {100 * loop.wait_fraction(0, left_at):.0f}%, after "
              f"{100 * wait_after:.2f}%, whole run {100 * loop.wait_fraction(0):.1f}%; "
              f"{len(loop.got)} batches, moves {client.policy.moves}, hedged {client.gray.hedged_bytes} bytes")
        assert left_at < 8, "the rank took too long to leave a feeder at a quarter of its demand"
        assert wait_after <= 0.02
        assert back_at - healed_at < 60
        assert moves_after == moves_before, "a rank moved between two healthy feeders"
        assert client.policy.last_move == "failback"
        assert (r.target, r.moved, r.moves) == (links[0].listen, "failback", 2) and r.consumed_per_s > 30, r
        assert 0 < r.hedged_bytes == client.gray.hedged_bytes   # (the probe's copies)
        assert f"via {links[0].listen}, moved 2 (last: failback)" in cap.get(), cap.get()   # `feeder status`
        check_prefix(loop.got, stream, SEQ, 1, 2, 11)
    finally:
        for f in feeders:
            f.stop()


def test_hedged_reads_keep_8_ranks_fed_past_a_slow_feeder_and_no_sample_is_delivered_twice(wan_dataset, wan_docs,
                                                                                          proxies, tmp_path):
    from feeder.ops.audit import audit
    from feeder_client import FeederDataset

    stream = byte_stream(wan_docs)
    world, seed = 8, 12
    EPOCHS = 30     # of ~10 batches per rank: some 6 s of training
    ledgers = [tmp_path / f"ledger-{r}.jsonl" for r in ("a", "b")]
    feeders = [FeederProc(wan_dataset, extra=[*FEEDER_FLAGS, "--compression", "none", "--region", r,
                                               "--ledger", str(led)]) for r, led in zip(("a", "b"), ledgers)]
    links = [proxies.proxy(f.address) for f in feeders]
    per_batch = MB * (SEQ + 1) * 2
    links[0].bandwidth(int(per_batch / STEP_S / 4 / 1024))   # a quarter of one rank's demand, for all 8
    try:
        dss = [FeederDataset({"a": links[0].listen, "b": links[1].listen}, job="slow-hedge", rank=r,
                             world_size=world, seq_len=SEQ, micro_batch=MB, seed=seed, num_epochs=EPOCHS,
                             prefer="order", compression="none", hedge=True, report_every_s=1)
               for r in range(world)]
        loops = [Loop(ds) for ds in dss]
        for lp in loops:
            lp.thread.join(120)
            assert not lp.thread.is_alive(), "a rank did not finish its epoch"
        errors = [lp.error for lp in loops if lp.error is not None and not isinstance(lp.error, StopIteration)]
        assert not errors, errors
        # after the first 2 s: the streams' start (8 ranks opening on the slow feeder, then their
        # hedges on the other, on 2 cores) costs some 0.2 s once
        waits = [lp.wait_fraction(2.0) for lp in loops]
        hedged = [ds.client.gray.hedged_bytes for ds in dss]
        print(f"8 ranks, hedge=True, one feeder at a quarter of one rank's demand: data-wait after 2 s per rank "
              f"{', '.join(f'{100 * w:.2f}%' for w in waits)}; hedged bytes {sum(hedged)} "
              f"({sum(hedged) / max(1, sum(per_batch * len(lp.got) for lp in loops)):.1%} of the bytes used); "
              f"hedges {[ds.client.gray.hedges for ds in dss]}, moves {[ds.client.policy.moves for ds in dss]}")
        for r, lp in enumerate(loops):
            check_prefix(lp.got, stream, SEQ, r, world, seed)
        assert max(waits) <= 0.01, waits
        assert sum(hedged) > 0
        # the feeders' ledgers: every sample of the epoch once, the hedged copies counted apart
        verdict = audit([str(p) for p in ledgers], job="slow-hedge")
        assert verdict and all(v["exactly_once"] for v in verdict), verdict
    finally:
        for f in feeders:
            f.stop()


def test_a_feeder_stuck_while_its_grpc_answers_loses_the_rank_within_the_window(wan_dataset, wan_docs):
    """The feeder's event loop thread stopped by ptrace (tests/chaos/freeze.py): its gRPC C
    threads keep the connection and answer HTTP/2 pings, so neither the keepalive (10 + 5 s)
    nor the idle timeout (30 s) fires soon; the client's own judgement ("stuck": nothing
    delivered while the loop waits) moves the rank once what was in flight (its read-ahead, the
    HTTP/2 window and the sockets' buffers) is used up, within slow_window_s (3 s) of the loop's
    first wait."""
    from feeder_client import FeederDataset
    from tests.chaos.freeze import freeze, thaw

    stream = byte_stream(wan_docs)
    feeders = [FeederProc(wan_dataset, extra=["--region", r]) for r in ("a", "b")]
    try:
        ds = FeederDataset({"a": feeders[0].address, "b": feeders[1].address}, job="slow-stuck", rank=0,
                           world_size=2, seq_len=SEQ, micro_batch=MB, seed=13, num_epochs=0, prefer="order")
        loop = Loop(ds, step_s=0.002)   # (a quick loop: what was in flight, megabytes, is used up in seconds)
        wait_until(lambda: len(loop.log) > 50, 30, "the rank did not start")
        pid = feeders[0].proc.pid
        assert freeze(pid)
        try:
            frozen_at = time.monotonic() - loop.t0
            wait_until(lambda: loop.region_now() == "b", 30, "the rank stayed on a stuck feeder")
            moved_at = loop.log[-1][0]
            starved_at = next(t - w for t, w, _ in loop.log if t >= frozen_at and w > 0.05)
        finally:
            thaw(pid)
        time.sleep(1)
        loop.stop()
        print(f"stuck at {frozen_at:.1f} s, what was in flight used up at {starved_at:.1f} s, the rank on the other "
              f"feeder at {moved_at:.1f} s; last move {ds.client.policy.last_move}")
        assert moved_at - starved_at < 3 + 1.5, "not within slow_window_s (3 s) of the loop's first wait"
        assert ds.client.policy.last_move in ("stuck", "slow")   # (stuck: nothing at all in the window)
        check_prefix(loop.got, stream, SEQ, 0, 2, 13)
    finally:
        for f in feeders:
            f.stop()


def test_a_side_stream_of_a_rank_takes_no_slot_and_the_audit_counts_its_copies_apart(wan_dataset, tmp_path):
    """A hedged read (StreamRequest.hedge) of a rank whose own stream is open on the same feeder,
    from the same cursor: neither replaces the other, both run to their end with the same
    batches, status counts the rank's own stream only, and `feeder audit` says exactly once with
    the copies counted as hedged."""
    import grpc

    from feeder.core.config import StreamSpec
    from feeder.ops.audit import audit
    from feeder.ops.status import fetch
    from feeder.service.convert import stream_request
    from feeder.v1 import feeder_pb2_grpc as pb_grpc

    ledger = tmp_path / "ledger.jsonl"
    feeder = FeederProc(wan_dataset, extra=["--ledger", str(ledger)])
    try:
        spec = StreamSpec(job="side", rank=0, world_size=4, seq_len=256, micro_batch=4, seed=3, num_epochs=1,
                          client_started_ns=time.time_ns())
        with grpc.insecure_channel(feeder.address) as ch:
            stub = pb_grpc.FeederStub(ch)
            own = stub.Stream(stream_request(spec))
            first = next(own)                               # the rank's stream is open ...
            side = stub.Stream(stream_request(spec, hedge=True, continued=True))   # ... and its copy
            copy = [b for r in side for b in r.batches]
            mine = list(first.batches) + [b for r in own for b in r.batches]
            ranks = fetch(feeder.address, job="side").jobs[0].ranks
        assert [b.cursor for b in copy] == [b.cursor for b in mine] and len(mine) > 5
        assert [r.rank for r in ranks] == [0] and ranks[0].batches_sent == len(mine), ranks   # its own, once
        (v,) = audit([str(ledger)], job="side")
        assert v["exactly_once"] is False and v["n_missing"] > 0   # (one rank of four: the others are missing)
        assert v["n_duplicate_deliveries"] == 0 and v["hedged_batches"] == len(copy) and v["resent_batches"] == 0
    finally:
        feeder.stop()

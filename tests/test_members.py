"""Model parallelism (issue 33): the members of a data-parallel rank (its tensor-parallel ranks,
its pipeline stages) each receive the rank's whole stream, bit for bit, built once; context-
parallel members receive their positions of each sample. Real servers and clients throughout;
the reference is torch's DistributedSampler over the data-parallel ranks only."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from feeder.core.config import ServeConfig, StreamSpec
from feeder.core.errors import Code, FeederError, InvalidArgument
from feeder.service.server import ServerThread
from feeder_client import FeederDataset
from feeder_client.stream import ClientConfig, FeederClient
from tests.helpers import FeederProc, check_batches, expected_ids

SEQ, MB, WORLD = 16, 3, 2


def _spec(job: str, rank: int = 0, **kw) -> StreamSpec:
    return StreamSpec(**{**dict(job=job, rank=rank, world_size=WORLD, seq_len=SEQ, micro_batch=MB, seed=5), **kw})


def _batch(b) -> tuple:
    """Everything a member receives of a batch."""
    return (b.epoch, b.step, b.sample_ids.tolist(), b.tokens.numpy().tobytes(), b.cursor,
            b.boundary_bytes, None if b.sources is None else b.sources.tolist())


def _read(address: str, spec: StreamSpec, out: dict, key, *, delay_s: float = 0.0, cursor=None, targets=None):
    c = FeederClient(ClientConfig(targets=targets or (address,), spec=spec, cursor=cursor, retry_for_s=30))
    got = []
    try:
        for b in c:
            got.append(b)
            if delay_s:
                time.sleep(delay_s)
    except FeederError as e:
        out["error", key] = e
    finally:
        c.close()
    out[key] = got


def _together(address: str, specs: dict, options: dict | None = None) -> dict:
    out: dict = {}
    threads = [threading.Thread(target=_read, args=(address, spec, out, key), kwargs=(options or {}).get(key, {}))
               for key, spec in specs.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    errors = {k: v for k, v in out.items() if isinstance(k, tuple) and k[0] == "error"}
    assert not errors, errors
    return out


def test_every_member_of_a_rank_receives_the_same_batches_built_once(dataset, stream):
    """Four members of rank 1 (a tensor-parallel group) and rank 0 alone: each member gets the
    rank's DistributedSampler ids, the same bytes, cursors and all; the feeder built each
    message once and sent it four times."""
    srv = ServerThread(ServeConfig(source=str(dataset), listen="127.0.0.1:0", message_bytes=4096))
    try:
        specs = {m: _spec("tp", rank=1, member=m, members=4) for m in range(4)}
        specs["r0"] = _spec("tp", rank=0)
        out = _together(srv.address, specs)
        for m in range(4):
            assert [_batch(b) for b in out[m]] == [_batch(b) for b in out[0]]
        check_batches(out[0], stream, SEQ, expected_ids(stream, 1, WORLD, SEQ, 5))
        check_batches(out["r0"], stream, SEQ, expected_ids(stream, 0, WORLD, SEQ, 5))
        st = srv.server.engine.jobs.get("tp").ranks[1]
        assert st.window_builds > 10 and st.member_shared == 4 * st.window_builds and st.member_solo == 0
        assert not srv.server.engine.jobs.get("tp").windows   # gone with its members
    finally:
        srv.stop()


def test_a_member_ten_times_slower_reads_on_its_own_and_memory_stays_bounded(dataset, stream, tmp_path):
    """Four members, one ten times slower, a window of a few messages: every member receives the
    whole sequence; the window never holds more than its bound; the slow one fell behind and
    read on its own (nobody waited for it); the ledger counts each sample once."""
    ledger = tmp_path / "ledger.jsonl"
    cfg = ServeConfig(source=str(dataset), listen="127.0.0.1:0", message_bytes=2048, prefetch_messages=2,
                      prefetch_bytes=8192, member_window_bytes=8192, ledger=str(ledger))
    srv = ServerThread(cfg)
    peak = [0]
    stop = threading.Event()

    def watch():   # the feeder's windows, sampled while the members read
        while not stop.is_set():
            job = srv.server.engine.jobs.jobs.get("slow")
            for w in list(job.windows.values()) if job else ():
                peak[0] = max(peak[0], w.bytes)
            time.sleep(0.002)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        specs = {m: _spec("slow", rank=0, member=m, members=4) for m in range(4)}
        specs["r1"] = _spec("slow", rank=1)
        out = _together(srv.address, specs, {3: dict(delay_s=0.004), **{m: dict(delay_s=0.0004) for m in range(3)}})
    finally:
        stop.set()
        watcher.join()
        srv.stop()
    want = expected_ids(stream, 0, WORLD, SEQ, 5)
    for m in range(4):
        check_batches(out[m], stream, SEQ, want)
        assert [_batch(b) for b in out[m]] == [_batch(b) for b in out[0]]
    assert 0 < peak[0] <= cfg.window_bytes + 2 * cfg.message_bytes, peak[0]
    st = srv.server.engine.jobs.get("slow").ranks[0]
    assert st.member_solo > 0, "the slow member never fell out of the window"
    records = [json.loads(line) for line in ledger.read_text().splitlines()]
    batches = [r for r in records if "ids" in r and r["rank"] == 0]
    assert len(batches) == len(out[0])   # once per batch of the rank, not once per member
    r = subprocess.run([sys.executable, "-m", "feeder.cli", "audit", str(ledger), "--json"], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    (verdict,) = [json.loads(line) for line in r.stdout.splitlines()]
    assert verdict["exactly_once"] and verdict["batches"] == len(out[0]) + len(out["r1"])
    assert verdict["resent_batches"] == 0 and verdict["n_duplicate_deliveries"] <= verdict["padding_allowed"]


def test_any_members_cursor_resumes_any_member_and_a_restarted_member_replaces_only_itself(dataset, stream):
    srv = ServerThread(ServeConfig(source=str(dataset), listen="127.0.0.1:0", message_bytes=4096))
    try:
        want = expected_ids(stream, 1, WORLD, SEQ, 5)
        first = _together(srv.address, {0: _spec("re", rank=1, member=0, members=2, num_epochs=1)})[0]
        k = len(first) // 3
        # Member 1 resumes from member 0's cursor; member 0 from its own: the same stream on.
        out = {}
        a = threading.Thread(target=_read, args=(srv.address, _spec("re", rank=1, member=1, members=2), out, 1),
                             kwargs=dict(cursor=first[k].cursor))
        b = threading.Thread(target=_read, args=(srv.address, _spec("re", rank=1, member=0, members=2), out, 0),
                             kwargs=dict(cursor=first[k].cursor))
        a.start(), b.start(), a.join(60), b.join(60)
        assert [_batch(x) for x in out[1]] == [_batch(x) for x in first[k + 1:]]
        assert [_batch(x) for x in out[0]] == [_batch(x) for x in first[k + 1:]]
        check_batches(out[1], stream, SEQ, want[(k + 1) * MB:])

        # A member restarting (a new process on its slot) replaces only its own old stream.
        spec = _spec("re2", rank=1, member=0, members=2)
        c0 = FeederClient(ClientConfig(targets=(srv.address,), spec=spec, read_ahead=1, retry_for_s=10))
        c1 = FeederClient(ClientConfig(targets=(srv.address,), spec=_spec("re2", rank=1, member=1, members=2),
                                       read_ahead=1, retry_for_s=10))
        got0 = [next(c0) for _ in range(3)]
        got1 = [next(c1) for _ in range(3)]
        restarted = FeederClient(ClientConfig(targets=(srv.address,), cursor=got1[-1].cursor, read_ahead=1,
                                              spec=_spec("re2", rank=1, member=1, members=2,
                                                         client_started_ns=time.time_ns()), retry_for_s=10))
        rest1 = list(restarted)
        with pytest.raises(FeederError) as e:
            for _ in c1:
                pass
        assert e.value.code == Code.FAILED_PRECONDITION and "member 1 of rank 1" in str(e.value)
        rest0 = list(c0)   # member 0 goes on undisturbed
        check_batches(got0 + rest0, stream, SEQ, want)
        check_batches(got1 + rest1, stream, SEQ, want)
        for c in (c0, c1, restarted):
            c.close()
    finally:
        srv.stop()


def test_a_second_process_on_a_slot_held_with_members_1_is_told_what_to_pass(dataset):
    """Two pipeline stages of rank 0 opened as plain ranks: the one replaced is told about
    member= and members=, not only that it was replaced."""
    srv = ServerThread(ServeConfig(source=str(dataset), listen="127.0.0.1:0", message_bytes=4096))
    try:
        a = FeederClient(ClientConfig(targets=(srv.address,), spec=_spec("pp", client_started_ns=1), read_ahead=1,
                                      retry_for_s=10))
        next(a)
        b = FeederClient(ClientConfig(targets=(srv.address,), spec=_spec("pp", client_started_ns=2), read_ahead=1,
                                      retry_for_s=10))
        next(b)
        with pytest.raises(FeederError) as e:
            for _ in a:
                pass
        assert e.value.code == Code.FAILED_PRECONDITION
        assert "member=k and members=K" in str(e.value) and "pipeline stages" in str(e.value)
        a.close(), b.close()
    finally:
        srv.stop()


def test_members_continue_exactly_on_another_feeder_when_theirs_is_killed(dataset, stream):
    """Three members spread across the window (one slow), their feeder SIGKILLed: each continues
    on the other feeder from its own cursor, and every member's stream is the rank's exactly."""
    a, b = FeederProc(dataset), FeederProc(dataset)
    try:
        out = {}
        specs = {m: _spec("kill", rank=1, member=m, members=3) for m in range(3)}
        threads = [threading.Thread(target=_read, args=(a.address, specs[m], out, m),
                                    kwargs=dict(delay_s=(0.03 if m == 2 else 0.004), targets=(a.address, b.address)))
                   for m in range(3)]
        for t in threads:
            t.start()
        time.sleep(0.6)
        a.signal(signal.SIGKILL)
        for t in threads:
            t.join(120)
        assert not [k for k in out if isinstance(k, tuple) and k[0] == "error"], out
        want = expected_ids(stream, 1, WORLD, SEQ, 5)
        for m in range(3):
            check_batches(out[m], stream, SEQ, want)
            assert {x.region for x in out[m]} <= {"local"}
        assert [_batch(x) for x in out[2]] == [_batch(x) for x in out[0]]
    finally:
        a.stop(), b.stop()


def _zigzag_megatron(x: np.ndarray, cp_size: int, cp_rank: int) -> np.ndarray:
    """Megatron-LM's get_batch_on_this_cp_rank, written out independently: view the sequence as
    2·cp_size chunks and keep chunks cp_rank and 2·cp_size - cp_rank - 1."""
    n, s = x.shape
    v = x.reshape(n, 2 * cp_size, s // (2 * cp_size))
    return v[:, [cp_rank, 2 * cp_size - cp_rank - 1], :].reshape(n, -1)


@pytest.mark.parametrize("packing", ["concat", "best_fit"])
def test_context_parallel_slices_reassemble_to_the_whole_sample(dataset, packing):
    """C = 2 and 4, both layouts, with boundaries: each member's input_ids, labels, position_ids
    and loss_mask put back at its positions are the C = 1 stream's; zigzag is Megatron's split;
    ids and cursors are the whole sample's; the tokens each member gets are about 1/C."""
    srv = ServerThread(ServeConfig(source=str(dataset), listen="127.0.0.1:0", message_bytes=4096))
    try:
        job = f"cp-{packing}"

        def take(**kw):
            out = {}
            _read(srv.address, _spec(job, rank=1, packing=packing, boundaries=True, **kw), out, 0)
            assert 0 in out and ("error", 0) not in out, out
            return out[0]

        full = take()
        for size in (2, 4):
            for layout in ("zigzag", "contiguous"):
                parts = [take(cp_size=size, cp_rank=c, cp_layout=layout) for c in range(size)]
                for j, whole in enumerate(full):
                    n = len(whole.sample_ids)
                    got = {k: np.zeros((n, SEQ), np.float64) for k in ("inp", "lab", "pos", "mask")}
                    for c, part in enumerate(parts):
                        b = part[j]
                        assert b.cursor == whole.cursor and b.sample_ids.tolist() == whole.sample_ids.tolist()
                        assert b.input_ids.shape == (n, SEQ // size)
                        assert b.tokens.shape[1] == SEQ // size + (2 if layout == "zigzag" else 1)
                        at = _positions(size, c, layout)
                        got["inp"][:, at], got["lab"][:, at] = b.input_ids.numpy(), b.labels.numpy()
                        got["pos"][:, at], got["mask"][:, at] = b.position_ids.numpy(), b.loss_mask.numpy()
                        if layout == "zigzag":
                            np.testing.assert_array_equal(b.input_ids.numpy(),
                                                          _zigzag_megatron(whole.tokens.numpy()[:, :-1], size, c))
                            np.testing.assert_array_equal(b.labels.numpy(),
                                                          _zigzag_megatron(whole.tokens.numpy()[:, 1:], size, c))
                    np.testing.assert_array_equal(got["inp"], whole.tokens.numpy()[:, :-1])
                    np.testing.assert_array_equal(got["lab"], whole.tokens.numpy()[:, 1:])
                    np.testing.assert_array_equal(got["pos"], whole.position_ids.numpy())
                    np.testing.assert_array_equal(got["mask"], whole.loss_mask.numpy())
    finally:
        srv.stop()


def _positions(size: int, c: int, layout: str) -> np.ndarray:
    """Independent of feeder.core.context: the input positions member c holds."""
    if layout == "contiguous":
        w = SEQ // size
        return np.arange(c * w, (c + 1) * w)
    w = SEQ // (2 * size)
    return np.concatenate((np.arange(c * w, (c + 1) * w), np.arange((2 * size - 1 - c) * w, (2 * size - c) * w)))


def test_context_parallel_members_of_a_tensor_parallel_group_share_their_slice(dataset, stream):
    """cp_size 2 × members 2: the two members of each context-parallel rank get identical
    slices, built once."""
    srv = ServerThread(ServeConfig(source=str(dataset), listen="127.0.0.1:0", message_bytes=4096))
    try:
        specs = {(c, m): _spec("cptp", rank=0, cp_size=2, cp_rank=c, member=m, members=2)
                 for c in range(2) for m in range(2)}
        out = _together(srv.address, specs)
        for c in range(2):
            assert [_batch(b) for b in out[c, 1]] == [_batch(b) for b in out[c, 0]]
        ids = [i for b in out[0, 0] for i in b.sample_ids.tolist()]
        assert ids == expected_ids(stream, 0, WORLD, SEQ, 5)
        st = srv.server.engine.jobs.get("cptp").ranks[0]
        assert st.member_shared == 4 * st.window_builds // 2
    finally:
        srv.stop()


def test_a_seq_len_context_parallelism_cannot_split_is_refused_at_open():
    with pytest.raises(InvalidArgument, match="multiple of 8"):
        FeederDataset("127.0.0.1:1", job="j", rank=0, world_size=1, seq_len=20, micro_batch=1, cp_size=4)
    with pytest.raises(InvalidArgument, match="multiple of 3"):
        FeederDataset("127.0.0.1:1", job="j", rank=0, world_size=1, seq_len=20, micro_batch=1, cp_size=3,
                      cp_layout="contiguous")
    with pytest.raises(InvalidArgument, match=r"member must be in \[0, members=2\)"):
        FeederDataset("127.0.0.1:1", job="j", rank=0, world_size=1, seq_len=20, micro_batch=1, member=2, members=2)


def test_status_shows_a_ranks_members_and_which_lag(dataset):
    """`feeder status` (the Status RPC and its table) shows each member of a rank, where it is,
    and that the rank's messages were built once; which lags is each one's distance from the
    member furthest ahead in what was sent (sending runs ahead of what the loop took by the
    network's buffers, so on this small dataset each member's place is checked, not an order)."""
    from rich.console import Console

    from feeder.ops.status import fetch, render

    srv = ServerThread(ServeConfig(source=str(dataset), listen="127.0.0.1:0", message_bytes=1024))
    clients = [FeederClient(ClientConfig(targets=(srv.address,), spec=_spec("st", member=m, members=3),
                                         read_ahead=1, retry_for_s=10)) for m in range(3)]
    try:
        for m, c in enumerate(clients):
            for _ in range(3):
                next(c)
        deadline = time.monotonic() + 10
        while True:
            reply = fetch(srv.address, job="st")
            members = reply.jobs[0].ranks[0].members
            if len(members) == 3 or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert sorted(m.member for m in members) == [0, 1, 2], members
        furthest = max((m.epoch, m.step) for m in members)
        for m in members:
            assert m.behind == (furthest[1] - m.step if m.epoch == furthest[0] else 0) and m.step >= 2
        rank = reply.jobs[0].ranks[0]
        assert rank.window_builds > 0 and rank.member_shared >= rank.window_builds and rank.restarts == 0
        console = Console(width=220, record=True)
        console.print(render(reply, srv.address))
        assert "3 members" in console.export_text(), console.export_text()
    finally:
        for c in clients:
            c.close()
        srv.stop()


def test_the_status_of_members_says_how_far_behind_the_furthest_each_is():
    from types import SimpleNamespace as NS

    from feeder.domain.engine import member_status

    rank = NS(members={(0, 0): NS(position=(1, 40), joined=True), (0, 1): NS(position=(1, 12), joined=False),
                       (1, 0): NS(position=(0, 900), joined=True), (1, 1): NS(position=None, joined=True)})
    got = {(m.cp_rank, m.member): (m.epoch, m.step, m.behind, m.shared) for m in member_status(rank)}
    assert got == {(0, 0): (1, 40, 0, True), (0, 1): (1, 12, 28, False), (1, 0): (0, 900, 0, True),
                   (1, 1): (0, 0, 0, True)}


def test_regression_review_a_window_change_before_its_waiter_starts_is_not_missed():
    """Review of issue 33: Window.changed() read its event only when the waiting task first ran;
    the producer's end signalled in between was waited for on a fresh event, and every member
    sat out its idle timeout (30 s) at the stream's end in 5 of 18 runs. The awaitable now holds
    the event of the moment it is made."""
    import asyncio

    from feeder.pipeline.members import Window

    async def main():
        w = Window.__new__(Window)
        w._changed = asyncio.Event()
        waiter = asyncio.ensure_future(w.changed())   # made, not yet run
        w._notify()                                   # the producer ends meanwhile
        await asyncio.wait_for(waiter, 1.0)

    asyncio.run(main())


def test_members_of_a_rank_that_disagree_on_the_layout_are_refused_and_restarts_are_counted_per_slot(dataset):
    """Review of issue 33: context-parallel ranks of one rank split alike and members count
    themselves alike, or the stream is refused (a whole-sample stream beside them is fine);
    a stream per member, worker and context-parallel rank is no restart in status."""
    srv = ServerThread(ServeConfig(source=str(dataset), listen="127.0.0.1:0", message_bytes=1024))
    opened = []

    def open_(**kw):
        c = FeederClient(ClientConfig(targets=(srv.address,), spec=_spec("lay", **kw), read_ahead=1, retry_for_s=5))
        opened.append(c)
        return next(iter(c))

    try:
        open_(cp_size=2, cp_rank=0, cp_layout="zigzag", member=0, members=2)
        open_(cp_size=2, cp_rank=1, cp_layout="zigzag", member=1, members=2)
        open_()   # whole samples beside them: a logger, an evaluator
        with pytest.raises(FeederError, match="split for context parallelism with cp_size=2, cp_layout='zigzag'"):
            open_(cp_size=2, cp_rank=1, cp_layout="contiguous", member=0, members=2)
        with pytest.raises(FeederError, match="cp_size=2"):
            open_(cp_size=4, cp_rank=3)
        with pytest.raises(FeederError, match="members=K=2"):
            open_(cp_size=2, cp_rank=0, cp_layout="zigzag", member=1, members=3)
        from feeder.ops.status import fetch

        (rank,) = [r for r in fetch(srv.address, job="lay").jobs[0].ranks if r.rank == 0]
        assert rank.restarts == 0   # three slots, three streams
    finally:
        for c in opened:
            c.close()
        srv.stop()

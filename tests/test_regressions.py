"""Regressions of the outside audit (issue 16): each broke exactness where two features meet.
Real feeder processes, real gRPC; each test failed on the code before its fix."""
from __future__ import annotations

import asyncio
import multiprocessing as mp
import signal
import time

import grpc
import pytest
from torch.utils.data import DataLoader

from feeder_client import FeederDataset
from feeder.core.config import ServeConfig, StreamSpec
from feeder.core.errors import Code, FeederError, Unavailable
from feeder.core.sampler import n_samples
from feeder.service.server import ServerThread
from tests.helpers import FeederProc, byte_stream, check_batches, expected_ids, make_docs, prep_docs, reference_ids
from tests.test_stream import _corrupt_copy

pytestmark = pytest.mark.fault


def _flip_token_byte(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF   # inside the token values of a record batch
    path.write_bytes(bytes(data))


# -- 1. SIGTERM while the rest of a finite stream is already queued ------------------------

@pytest.fixture(scope="module")
def big(tmp_path_factory):
    """~12 M tokens: one rank's stream is far larger than what HTTP/2 flow control lets into the
    client's buffers, so most of it is still in the feeder's queue when the feeder is stopped."""
    docs = make_docs(48000, seed=5, max_words=90)
    return prep_docs(tmp_path_factory.mktemp("big"), docs), byte_stream(docs)


def test_sigterm_with_the_whole_rest_queued_fails_over_instead_of_ending(big):
    """Audit finding 1: the producer had built and queued the rank's whole stream, SIGTERM's
    `end()` dropped the queue, and the call ended OK: the rank saw a normal end after 2 079 of
    3 045 samples. Now the stream ends UNAVAILABLE and the rank resumes on the other feeder."""
    dataset, stream = big
    seq_len, mb, seed = 512, 8, 11
    # A queue deep enough for the whole rank: the producer finishes long before the rank reads.
    extra = ["--prefetch-messages", "100000", "--prefetch-bytes", str(1 << 30), "--message-bytes", str(1 << 16),
             "--compression", "none", "--grace", "30"]   # the rank reads on through the grace period
    a, b = FeederProc(dataset, extra=extra), FeederProc(dataset, extra=extra)
    try:
        want = expected_ids(stream, 0, 1, seq_len, seed)
        ds = FeederDataset([a.address, b.address], job="sigterm-queued", rank=0, world_size=1, seq_len=seq_len,
                           micro_batch=mb, seed=seed, read_ahead=1, prefer="order", retry_for_s=60, failback_s=0)
        got = []
        for k, batch in enumerate(ds):
            got.append(batch)
            if k == 5:
                time.sleep(1.5)    # the producer has long finished
                a.proc.send_signal(signal.SIGTERM)   # drains for up to its grace period
        check_batches(got, stream, seq_len, want)
        assert ds.client.failovers >= 1
    finally:
        a.stop()
        b.stop()


def test_end_after_the_producer_finished_still_ends_with_the_error(dataset):
    """The mechanism under finding 1 (and supersede, which takes the same path): `end(error)`
    on a stream whose producer has finished drops the queue, so the stream must raise."""
    from feeder.domain.engine import Engine
    from feeder.sources.open import load_sources
    from feeder.service.wire import encode_reply

    async def run():
        cfg = ServeConfig(source=str(dataset), prefetch_messages=100000, prefetch_bytes=1 << 30,
                          message_bytes=4096)
        engine = Engine(cfg, load_sources(cfg), lambda block: encode_reply(block, cfg.region))
        spec = StreamSpec(job="end-after-finish", rank=0, world_size=1, seq_len=16, micro_batch=4)
        stream = await engine.open_stream(spec, b"")
        it = stream.messages()
        await it.__anext__()
        while not stream._finished:          # let the producer build and queue everything
            await asyncio.sleep(0.01)
        assert stream._items, "the test needs messages still queued when the stream is ended"
        stream.end(Unavailable("shutting down"))
        with pytest.raises(Unavailable):
            async for _ in it:
                pass
        engine.close()

    asyncio.run(run())


def test_an_ok_end_without_the_end_marker_is_resumed_not_believed(dataset, stream):
    """The client side of finding 1: whatever ends a call with OK but without the feeder's end
    marker (a proxy, an older feeder, a bug), the rank resumes from its cursor instead of
    taking it for the end of its data."""
    from feeder.v1 import feeder_pb2 as pb
    from feeder.v1 import feeder_pb2_grpc as pb_grpc
    from feeder.core.net import free_port

    seq_len, mb, seed = 16, 4, 2
    with ServerThread(ServeConfig(source=str(dataset), listen="127.0.0.1:0", message_bytes=4096)) as good:
        # A relay that forwards the real feeder's first three replies, then ends the call OK.
        class Truncating(pb_grpc.FeederServicer):
            async def Stream(self, request, context):
                async with grpc.aio.insecure_channel(good.address) as ch:
                    call = pb_grpc.FeederStub(ch).Stream(request)
                    k = 0
                    async for reply in call:
                        yield reply
                        k += 1
                        if k == 3:
                            return

        async def serve(port, ready, stop):
            server = grpc.aio.server()
            pb_grpc.add_FeederServicer_to_server(Truncating(), server)
            server.add_insecure_port(f"127.0.0.1:{port}")
            await server.start()
            ready.set()
            while not stop.is_set():
                await asyncio.sleep(0.05)
            await server.stop(0)

        import threading

        port, ready, stop = free_port(), threading.Event(), threading.Event()
        t = threading.Thread(target=lambda: asyncio.run(serve(port, ready, stop)), daemon=True)
        t.start()
        ready.wait(10)
        try:
            ds = FeederDataset([f"127.0.0.1:{port}", good.address], job="no-marker", rank=0, world_size=1,
                               seq_len=seq_len, micro_batch=mb, seed=seed, prefer="order", read_ahead=1,
                               failback_s=0)
            got = list(ds)
        finally:
            stop.set()
            t.join(5)
    assert ds.client.failovers >= 1
    check_batches(got, stream, seq_len, expected_ids(stream, 0, 1, seq_len, seed))
    assert pb  # the relay speaks the real proto


# -- 2. DataLoader workers and any reconnect ------------------------------------------------

@pytest.mark.parametrize("persistent", [False, True])
def test_dataloader_workers_through_a_sigkill_failover_stay_exact(big, persistent):
    """Audit finding 2: DataLoader(num_workers=2), targets [A, B], A SIGKILLed after 41 batches:
    1 152 samples duplicated and 1 148 missing in epoch 0, epoch 1 wrong. A worker resumed from
    its own last batch's cursor, but the feeder restarted the round-robin count there. A
    persistent worker's second pass started from its own last cursor (steps 25, 25, 27, 27...)."""
    dataset, stream = big
    seq_len, mb, seed = 512, 4, 7
    extra = ["--compression", "none"]
    a, b = FeederProc(dataset, extra=extra), FeederProc(dataset, extra=extra)
    try:
        ds = FeederDataset([a.address, b.address], job=f"workers-kill-{persistent}", rank=0, world_size=2,
                           seq_len=seq_len, micro_batch=mb, seed=seed, num_epochs=2, prefer="order",
                           read_ahead=2, retry_for_s=60, failback_s=0)
        dl = DataLoader(ds, batch_size=None, num_workers=2, persistent_workers=persistent,
                        multiprocessing_context=mp.get_context("spawn"))
        got = []
        for k, batch in enumerate(dl):
            got.append((batch.epoch, batch.step, batch.sample_ids.tolist()))
            if k == 41:
                a.signal(signal.SIGKILL)
        n = n_samples(len(stream), seq_len)
        for epoch in (0, 1):
            want = reference_ids(n, 2, 0, shuffle=True, seed=seed, drop_last=False, epoch=epoch)
            mine = [g for g in got if g[0] == epoch]
            assert [s for _, s, _ in mine] == list(range(len(mine)))
            assert [i for _, _, ids in mine for i in ids] == want
        # Every pass with workers starts from the dataset's cursor in this process: the same batches.
        if persistent:
            again = [(batch.epoch, batch.step, batch.sample_ids.tolist()) for batch in dl]
            assert again == got
    finally:
        a.stop()
        b.stop()


def test_a_worker_resumed_from_its_own_cursor_takes_the_batch_after_its_own_turn(feeder, stream):
    """The mechanism under finding 2, without a DataLoader: worker 1 of 3 reads two batches,
    reopens from its own last cursor (phase = its index + 1) and must get exactly the batches of
    an uninterrupted worker 1."""
    from feeder_client.stream import ClientConfig, FeederClient

    def worker_spec(**kw):
        return StreamSpec(job="phase", rank=0, world_size=1, seq_len=16, micro_batch=4, seed=1,
                          worker_index=1, num_workers=3, **kw)

    def take(client, k=None):
        out = []
        for batch in client:
            out.append(batch)
            if k is not None and len(out) == k:
                break
        client.close()
        return out

    whole = take(FeederClient(ClientConfig(targets=(feeder.address,), spec=worker_spec())))
    first = take(FeederClient(ClientConfig(targets=(feeder.address,), spec=worker_spec())), 2)
    rest = take(FeederClient(ClientConfig(targets=(feeder.address,), spec=worker_spec(worker_phase=2),
                                          cursor=first[-1].cursor)))
    assert [b.step for b in whole][:4] == [1, 4, 7, 10]
    assert [(b.step, b.sample_ids.tolist()) for b in first + rest] == \
        [(b.step, b.sample_ids.tolist()) for b in whole]


# -- 3. DATA_LOSS on one replica, a good one elsewhere ---------------------------------------

def test_data_loss_on_one_replica_fails_over_to_a_good_one(dataset, stream, tmp_path):
    """Audit finding 3: a corrupt chunk on one feeder ended training although another target
    served a good replica of the same fingerprint."""
    copy, _ = _corrupt_copy(dataset, tmp_path, _flip_token_byte)
    seq_len, seed = 64, 4
    with ServerThread(ServeConfig(source=str(copy), listen="127.0.0.1:0")) as bad, \
            ServerThread(ServeConfig(source=str(dataset), listen="127.0.0.1:0")) as good:
        ds = FeederDataset([bad.address, good.address], job="dataloss", rank=0, world_size=1, seq_len=seq_len,
                           micro_batch=4, seed=seed, shuffle=False, prefer="order", failback_s=0)
        got = list(ds)
        assert ds.client.target == good.address
    want = reference_ids(n_samples(len(stream), seq_len), 1, 0, shuffle=False, seed=seed, drop_last=False, epoch=0)
    check_batches(got, stream, seq_len, want)


def test_data_loss_everywhere_is_still_raised(dataset, tmp_path):
    copy, m = _corrupt_copy(dataset, tmp_path, _flip_token_byte)
    with ServerThread(ServeConfig(source=str(copy), listen="127.0.0.1:0")) as a, \
            ServerThread(ServeConfig(source=str(copy), listen="127.0.0.1:0")) as b:
        ds = FeederDataset([a.address, b.address], job="dataloss-all", rank=0, world_size=1, seq_len=64,
                           micro_batch=4, shuffle=False)
        with pytest.raises(FeederError) as e:
            list(ds)
    assert e.value.code == Code.DATA_LOSS and m.shards[-1].path in str(e.value)


# -- 4. Ranks of one job that disagree on how many batches they get --------------------------

@pytest.mark.parametrize("field,theirs", [("micro_batch", 8), ("num_epochs", 2), ("epoch", 1)])
def test_ranks_disagreeing_on_batches_per_epoch_are_refused(feeder, field, theirs):
    """Audit finding 4: rank 0 with micro_batch 4 and rank 1 with 8 were both served (219 vs 111
    batches); in a real job the rank that finishes first leaves the other hanging."""
    base = dict(job=f"disagree-{field}", world_size=2, seq_len=16, micro_batch=4, seed=0, num_epochs=1, epoch=0)
    r0 = iter(FeederDataset([feeder.address], rank=0, **base))
    next(r0)   # rank 0's stream is live
    other = FeederDataset([feeder.address], rank=1, **{**base, field: theirs}, retry_for_s=5)
    with pytest.raises(FeederError) as e:
        next(iter(other))
    assert e.value.code == Code.FAILED_PRECONDITION
    assert f"{field}={base[field]!r}" in str(e.value) and f"{field}={theirs!r}" in str(e.value)
    r0.close()


# -- found by the property tests --------------------------------------------------------------

def test_reshard_at_an_epochs_end_does_not_deal_drop_lasts_tail_again():
    """n=10, world 4, drop_last: ids 2 and 4 are left out of epoch 0. A job that checkpointed
    right after the epoch's last batch and resumed with world 1 (reshard) got epoch 0 steps 2-3
    with ids [2] and [4]; now it goes on with epoch 1, as an uninterrupted run would."""
    from feeder.core.cursor import DEV_SECRET, Cursor
    from feeder.core.planning import StreamPlan

    def spec(world, rank, **kw):
        return StreamSpec(job="tail", rank=rank, world_size=world, seq_len=1, micro_batch=1, seed=3,
                          drop_last=True, num_epochs=2, **kw)

    last = list(StreamPlan(spec(4, 0), n_tokens=11, fingerprint="f", cursor=None).batches())
    end_of_epoch0 = [b for b in last if b.epoch == 0][-1].cursor
    resumed = list(StreamPlan(spec(1, 0, reshard=True), n_tokens=11, fingerprint="f",
                              cursor=Cursor.decode(end_of_epoch0.encode(DEV_SECRET), DEV_SECRET)).batches())
    assert {b.epoch for b in resumed} == {1}
    assert [int(i) for b in resumed for i in b.ids] == reference_ids(10, 1, 0, shuffle=True, seed=3, drop_last=True,
                                                                    epoch=1)


def test_a_resharded_ranks_own_cursor_resumes_its_dealing_instead_of_re_dealing_it():
    """Found by the soak (seed 600466): world 8 -> 4 by reshard, then rank 3 began a new pass 6
    steps ahead of the other ranks, from its own cursor, with reshard still on. The feeder
    re-dealt from where rank 3 alone stood, so the padding of its last batch came from another
    place in the order than in the batch it had already served for that step (`feeder audit`:
    conflicting batches). A cursor of a dealing over the same world size now goes on in it."""
    from feeder.core.cursor import DEV_SECRET, Cursor
    from feeder.core.planning import StreamPlan

    def spec(world, rank, **kw):
        return StreamSpec(job="own", rank=rank, world_size=world, seq_len=1, micro_batch=2, seed=5,
                          num_epochs=1, **kw)

    def plan(sp, cur):
        c = None if cur is None else Cursor.decode(cur.encode(DEV_SECRET), DEV_SECRET)
        return list(StreamPlan(sp, n_tokens=104, fingerprint="f", cursor=c).batches())

    at8 = plan(spec(8, 0), None)[1].cursor                   # every rank of world 8 took 2 batches
    resharded = plan(spec(4, 3, reshard=True), at8)         # rank 3 of the new world 4
    own = resharded[2].cursor                                # its own cursor, 3 batches on
    again = plan(spec(4, 3, reshard=True), own)              # a new pass, reshard still set
    assert [(b.step, b.ids.tolist()) for b in again] == [(b.step, b.ids.tolist()) for b in resharded[3:]]


def test_load_state_dict_reaches_persistent_workers_for_the_next_pass(feeder, stream):
    """Found by the fault harness (seed 543): after a pass broken off at step 30 and
    load_state_dict(cursor of step 30), the next pass over 3 persistent workers went on from
    where the workers had streamed to (step 37): they kept the copy of the dataset they were
    started with. Now each pass starts at the main process's latest cursor."""
    seq_len, mb, seed = 16, 2, 3
    ds = FeederDataset([feeder.address], job="persistent-repass", rank=1, world_size=2, seq_len=seq_len,
                       micro_batch=mb, seed=seed, num_epochs=1)
    dl = DataLoader(ds, batch_size=None, num_workers=3, persistent_workers=True,
                    multiprocessing_context=mp.get_context("spawn"))
    first = []
    for batch in dl:
        first.append(batch)
        if len(first) == 31:
            break
    ds.load_state_dict({"version": 1, "cursor": first[-1].cursor})
    rest = list(dl)
    assert rest[0].step == 31
    want = expected_ids(stream, 1, 2, seq_len, seed)
    check_batches(first + rest, stream, seq_len, want)
    ds.load_state_dict({"version": 1, "cursor": None})   # and back to the start
    assert [b.step for b in dl][:3] == [0, 1, 2]


def test_a_refusal_raised_in_a_dataloader_worker_keeps_its_code(feeder):
    """Found by the fault harness (seed 100392): a stream superseded inside a DataLoader worker
    reached the training loop as INTERNAL. torch re-raises a worker's exception as
    `type(e)(message)`, and a FeederError built with code=... lost its code that way."""
    base = dict(job="worker-code", world_size=2, seq_len=16, micro_batch=4, seed=0, num_epochs=0)  # live
    r0 = iter(FeederDataset([feeder.address], rank=0, **base))
    next(r0)   # rank 0's stream is live with micro_batch 4
    other = FeederDataset([feeder.address], rank=1, **{**base, "micro_batch": 8}, retry_for_s=5)
    dl = DataLoader(other, batch_size=None, num_workers=1, multiprocessing_context=mp.get_context("spawn"))
    with pytest.raises(FeederError) as e:
        next(iter(dl))
    assert e.value.code == Code.FAILED_PRECONDITION and "micro_batch=4" in str(e.value)
    r0.close()


# -- found by the 500-scenario soak (seed 200307) ------------------------------------------------

def test_a_replaced_trainer_reconnecting_cannot_take_its_rank_back(feeder, stream):
    """A restarted trainer superseded the old one; the old one's stream had broken for another
    reason (its feeder's SIGTERM), so it reconnected before it learned it was replaced. Its
    stream was then the newest of the rank and displaced the live process. Now a feeder refuses
    a continued stream of a rank from a process that started before the one that last opened
    the rank; a first stream from an older process (a pool reusing a job name) still opens."""
    from feeder_client.stream import ClientConfig, FeederClient
    from feeder.service.convert import stream_request
    from feeder.v1 import feeder_pb2_grpc as pb_grpc

    seq_len, mb, seed = 16, 2, 7
    base = dict(job="fence", rank=0, world_size=1, seq_len=seq_len, micro_batch=mb, seed=seed, num_epochs=1)
    t = time.time_ns()

    def client(started_ns, cursor=None):
        return FeederClient(ClientConfig(targets=(feeder.address,), cursor=cursor, read_ahead=1, retry_for_s=5,
                                         spec=StreamSpec(**base, client_started_ns=started_ns)))

    old = client(t)
    got = [next(old) for _ in range(3)]
    new = client(t + 10**9, got[-1].cursor)   # the restarted trainer, from the old one's checkpoint
    got.append(next(new))
    # the old trainer reconnecting from where it stood, as its client does after a break
    request = stream_request(StreamSpec(**base), got[-2].cursor, client_started_ns=t, continued=True)
    with grpc.insecure_channel(feeder.address) as ch:
        with pytest.raises(grpc.RpcError) as e:
            next(iter(pb_grpc.FeederStub(ch).Stream(request, timeout=10)))
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "no longer holds this rank" in e.value.details()
    got += list(new)                         # the live trainer was not displaced
    check_batches(got, stream, seq_len, expected_ids(stream, 0, 1, seq_len, seed))
    again = client(t)                        # a first stream of an older process opens
    assert next(again).step == 0
    for c in (old, new, again):
        c.close()


def test_dataloader_workers_send_their_trainers_start_time(feeder):
    """The fence compares processes: a rank's DataLoader workers (spawned, so each has its own
    clock of first use) must send their trainer's start time, which the dataset carries."""
    ds = FeederDataset([feeder.address], job="fence-workers", rank=0, world_size=1, seq_len=16, micro_batch=2)
    dl = DataLoader(ds, batch_size=None, num_workers=2, multiprocessing_context=mp.get_context("spawn"))
    for k, _ in enumerate(dl):
        if k == 3:
            break
    holders = feeder.server.engine.jobs.get("fence-workers").holders
    assert holders == {(0, 0, 1, 0, 0): ds.spec.client_started_ns, (0, 1, 1, 0, 0): ds.spec.client_started_ns}


# -- found by the outside review of cursor version 3 ---------------------------------------------

def _deep_json_v2(c):
    from tests.test_cursor import _v2
    return _v2(c, '{"P":' + "[" * 100_000, b"")


@pytest.mark.parametrize("change", [
    dict(step=2**64 - 1),                          # was INTERNAL: OverflowError
    dict(world_size=0, reshard=True),              # was UNKNOWN: ZeroDivisionError
    dict(pos=2**64 - 1), dict(base=2**63),         # were served as an empty, complete stream
    dict(src="epoch"), dict(src="follow"),         # a Kafka position on a dataset of files: was served
    dict(v2="deep"),                               # was UNKNOWN: RecursionError
])
def test_a_cursor_that_names_no_place_in_the_stream_is_refused(feeder, change):
    """Hand-made cursors under the deployment's secret (here the development one): each must
    get FAILED_PRECONDITION with a message, not INTERNAL or UNKNOWN, nor an empty stream."""
    import dataclasses

    from feeder.core.cursor import DEV_SECRET, Cursor
    from feeder.sources.kafka_positions import KafkaEpoch, KafkaFollow
    from feeder_client.stream import ClientConfig, FeederClient

    base = dict(job="bad-cursor", rank=0, world_size=2, seq_len=16, micro_batch=2, seed=1, num_epochs=1)
    first = FeederClient(ClientConfig(targets=(feeder.address,), spec=StreamSpec(**base)))
    c = Cursor.decode(next(first).cursor, DEV_SECRET)
    first.close()
    change = dict(change)
    reshard = change.pop("reshard", False)
    if "src" in change:
        change["src"] = KafkaEpoch("t:0=0-9") if change["src"] == "epoch" else \
            KafkaFollow(partitions=1, next=(0,), turn=0, k=0, skip=0, i=0)
    raw = _deep_json_v2(c) if change.pop("v2", None) else dataclasses.replace(c, **change).encode(DEV_SECRET)
    client = FeederClient(ClientConfig(targets=(feeder.address,), cursor=raw, retry_for_s=5,
                                       spec=StreamSpec(**base, reshard=reshard)))
    with pytest.raises(FeederError) as e:
        next(client)
    client.close()
    assert e.value.code == Code.FAILED_PRECONDITION and "cursor" in str(e.value), e.value


# -- found by the soak (seed 600321): two feeders on one port -------------------------------------

def test_a_second_feeder_on_a_taken_port_fails_instead_of_sharing_it(dataset, tmp_path):
    """grpcio binds with SO_REUSEPORT by default: a second `feeder serve` on a taken port (here
    two soak scenarios' feeders, each with its own data) bound too and got half the
    connections, so a rank was served another dataset's batches. Now it fails to bind with a
    clear message, unless both ask to share the port (--reuse-port, as `--processes` does)."""
    import subprocess
    import sys

    first = FeederProc(dataset)
    try:
        r = subprocess.run([sys.executable, "-m", "feeder.cli", "serve", "--source", str(dataset), "--listen",
                            first.address], capture_output=True, text=True, timeout=60)
        assert r.returncode != 0 and "cannot listen on" in r.stderr and "Traceback" not in r.stderr, r.stderr
    finally:
        first.stop()
    a = FeederProc(dataset, extra=["--reuse-port"])
    b = FeederProc(dataset, port=int(a.address.rpartition(":")[2]), extra=["--reuse-port"])
    for f in (a, b):
        f.stop()


def test_a_client_killed_mid_stream_leaves_no_error_in_the_feeders_log(dataset, tmp_path):
    """A rank killed while its stream sends (SIGKILL: the socket reset under a write) is a rank
    leaving, not the feeder's error: gRPC logged it as `ERROR ... ExecuteBatchError raised in core
    by servicer method` with a traceback, once per such rank. Now the stream closes as "cancelled
    by client", and the log holds no ERROR and no traceback."""
    import subprocess
    import sys

    from tests.helpers import free_port

    address = f"127.0.0.1:{free_port()}"
    log = tmp_path / "feeder.log"
    with open(log, "w") as err:
        feeder = subprocess.Popen([sys.executable, "-m", "feeder.cli", "serve", "--source", str(dataset), "--listen",
                                   address, "--grace", "1", "--message-bytes", "4096"],
                                  stdout=subprocess.PIPE, stderr=err, text=True)
    try:
        assert "listening on" in feeder.stdout.readline()
        rank = ("import sys, time\nfrom feeder_client import FeederDataset\n"
                f"ds = FeederDataset([{address!r}], job='killed', rank=0, world_size=1, seq_len=16, micro_batch=2)\n"
                "it = iter(ds)\nnext(it)\nprint('got', flush=True)\ntime.sleep(60)\n")
        for _ in range(3):
            r = subprocess.Popen([sys.executable, "-c", rank], stdout=subprocess.PIPE, text=True)
            assert r.stdout.readline().strip() == "got"
            time.sleep(0.2)    # (the feeder's prefetch full: its next write is the one that fails)
            r.kill()
            r.wait(10)
        deadline = time.monotonic() + 20
        while log.read_text().count("cancelled by client") < 3 and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        feeder.send_signal(signal.SIGTERM)
        feeder.wait(20)
    text = log.read_text()
    assert text.count("stream closed job=killed rank=0: cancelled by client") == 3, text[-3000:]
    assert "Traceback" not in text and " ERROR " not in text, text[-3000:]


def test_regression_soak_seed_4710286_a_request_its_client_left_does_not_replace_the_ranks_live_stream(dataset):
    """Soak seed 4710286: a rank moved to a feeder, away and back, while the feeder built a Kafka
    snapshot; its first request, long cancelled, finished opening after the second and replaced
    the rank's live stream, which ended FAILED_PRECONDITION ("replaced by a newer stream"). A
    stream whose client left while it opened is not attached."""
    from feeder.domain.engine import Engine
    from feeder.service.wire import encode_reply
    from feeder.sources.open import load_sources

    async def run():
        cfg = ServeConfig(source=str(dataset), message_bytes=4096)
        engine = Engine(cfg, load_sources(cfg), lambda block: encode_reply(block, cfg.region))
        spec = StreamSpec(job="left-before-open", rank=0, world_size=1, seq_len=16, micro_batch=4)
        live = await engine.open_stream(spec, b"")
        with pytest.raises(Unavailable, match="left before its stream opened"):
            await engine.open_stream(spec, b"", left=lambda: True)
        from feeder.pipeline.jobs import slot_of
        assert live._end is None and engine.jobs.get(spec.job).streams[slot_of(spec)] is live
        newer = await engine.open_stream(spec, b"")   # (a request still there does replace it)
        assert isinstance(live._end, FeederError) and "replaced by a newer stream" in str(live._end)
        engine.close_stream(newer, "finished")
        engine.close()

    asyncio.run(run())

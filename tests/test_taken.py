"""Status tells what the loops have taken, apart from what was sent ahead (issue 28): two ranks
at 0.1 s a batch on a real feeder; at every look, status's taken count is within one read-ahead
of what each loop took, and a rank is "finished" only once its loop took its last batch."""
from __future__ import annotations

import threading
import time

from feeder.core.config import ServeConfig
from feeder.core.errors import NotFound
from feeder.service.server import ServerThread
from feeder.ops.status import fetch
from feeder_client import FeederDataset

SEQ, MB, WORLD, READ_AHEAD = 64, 16, 2, 8


def test_status_shows_taken_within_one_read_ahead_and_finished_only_after_the_last_batch(dataset):
    srv = ServerThread(ServeConfig(source=str(dataset), listen="127.0.0.1:0", message_bytes=4096))
    taken = {r: 0 for r in range(WORLD)}     # samples each loop has taken
    done = {r: False for r in range(WORLD)}

    def rank(r):
        ds = FeederDataset([srv.address], job="slow", rank=r, world_size=WORLD, seq_len=SEQ, micro_batch=MB,
                           num_epochs=1, read_ahead=READ_AHEAD, max_read_ahead=READ_AHEAD)
        for batch in ds:
            taken[r] += len(batch.sample_ids)   # taken: the loop has it
            time.sleep(0.1)                     # the step
        done[r] = True

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(WORLD)]
    try:
        for t in threads:
            t.start()
        looks = 0
        while not all(done.values()):
            before = dict(taken)
            try:
                ranks = fetch(srv.address, job="slow").jobs[0].ranks
            except NotFound:                  # before the first stream opened
                ranks = ()
            after, finished = dict(taken), dict(done)
            for st in ranks:
                r = st.rank
                shown = st.samples_done if st.reported else 0
                assert shown <= after[r], (r, shown, after[r])
                assert before[r] - shown <= (READ_AHEAD + 1) * MB, (r, before[r], shown)
                if st.state == "finished":
                    assert finished[r], f"rank {r} shown finished before its loop took its last batch"
                looks += 1
            time.sleep(0.3)
        for t in threads:
            t.join(30)
        assert looks >= 10
        reply = fetch(srv.address, job="slow")
        for st in reply.jobs[0].ranks:
            assert st.state == "finished" and st.reported
            assert st.samples_done == st.samples_in_epoch == st.samples_sent == taken[st.rank]
    finally:
        srv.stop()


def test_a_job_stays_known_while_its_ranks_report_to_a_process_that_never_streamed_it(dataset):
    # A rank trains on what it was sent after its process of `serve --processes N` was replaced,
    # or reports to another process of the port: its reports keep the job in status.
    import grpc

    from feeder.v1 import feeder_pb2 as pb
    from feeder.v1 import feeder_pb2_grpc as pb_grpc

    with ServerThread(ServeConfig(source=str(dataset), listen="127.0.0.1:0")) as srv:
        with grpc.insecure_channel(srv.address) as ch:
            pb_grpc.FeederStub(ch).Report(pb.ReportRequest(job="elsewhere", rank=3, has_position=True, epoch=1,
                                                           step=7, wait_s=0.5, step_s=2.0, batches=4), timeout=5)
        (job,) = fetch(srv.address, job="elsewhere").jobs
    (rank,) = job.ranks
    assert (rank.rank, rank.reported, rank.epoch, rank.state, rank.connected) == (3, True, 1, "reporting", False)


def test_what_was_sent_and_not_taken_is_bounded_by_the_read_ahead_budget_in_bytes(dataset):
    """A slow loop over small batches: gRPC's receive window is the read-ahead budget, so the
    feeder runs ahead by at most that, a message or two and the decoded read-ahead (it ran
    ~6 MiB, thousands of batches, ahead with gRPC's own window and BDP probing)."""
    from feeder_client.stream import ClientConfig
    from feeder_client.transport import window_bytes

    message = 8192
    with ServerThread(ServeConfig(source=str(dataset), listen="127.0.0.1:0", message_bytes=message)) as srv:
        ds = FeederDataset([srv.address], job="ahead", rank=0, world_size=1, seq_len=16, micro_batch=4,
                           num_epochs=0, read_ahead=4, max_read_ahead=4, compression="none")
        it, taken, t0 = iter(ds), 0, time.monotonic()
        while time.monotonic() - t0 < 2.0:
            next(it)
            taken += 1
            time.sleep(0.01)
        (rank,) = fetch(srv.address, job="ahead").jobs[0].ranks
        it.close()
    per_batch = rank.bytes_sent / rank.batches_sent
    ahead = (rank.batches_sent - taken) * per_batch
    window = window_bytes(ClientConfig(targets=(srv.address,), spec=ds.spec, max_read_ahead=4))
    assert window == 64 << 10   # the floor: 4 batches of 4 x 17 tokens are far less
    assert 0 < ahead <= window + 2 * message + 4 * per_batch, (ahead, rank.batches_sent, taken)


def test_merged_status_takes_the_job_from_the_process_that_streamed_it():
    from feeder.domain.siblings import merge
    from feeder.v1 import feeder_pb2 as pb

    heard = pb.StatusReply(region="r", processes=1)
    heard.jobs.add(job="j", dataset="web", world_size=0).ranks.add(rank=1, reported=True, samples_done=8,
                                                                      state="reporting")
    streamed = pb.StatusReply(region="r", processes=1)
    streamed.jobs.add(job="j", dataset="web", world_size=4).ranks.add(rank=0, connected=True, state="streaming")
    (job,) = merge(heard, [streamed]).jobs
    assert job.world_size == 4 and [r.rank for r in job.ranks] == [0, 1]

"""Live elasticity: a replica's micro-batches of each global step, dealt over the replicas live
at that step (docs/elastic.md; the dealing is feeder.core.steps).

    feeder = ElasticFeeder(targets, job="run7", seq_len=2048, micro_batch=4, accumulation=8, replicas=16)
    for each step:   # S, r and W from the training loop (torchft: TorchftFeeder does this)
        for b in feeder.step(step=S, replica=r, replicas=W):
            loss = model(b.input_ids, b.labels).sum() / b.step_samples
            loss.backward()
        feeder.commit(step=S, committed=should_commit())

The same question ("step S, replica r of W") gives the same bytes from any feeder, so a healed,
restarted or moved replica needs no loader state from anyone. Under the default constant
global batch nothing but S, r and W decides the answer; under `shrink` where a step begins
depends on the worlds of the committed steps before it, which this object carries (the cursor
after the last committed step, also in `state_dict()`) and reports to the feeders, whose commit
log a replica without it starts from.

The stream of the current world reads ahead across steps like any rank's stream; a change of
world (or a step that did not commit in a shrink job whose world then changed) reopens it at
the step asked for. A step asked again in the same world (its attempt did not commit) is
answered from memory: the same micro-batches, bit for bit.
"""
from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time

from feeder.core.config import StreamSpec
from feeder.core.errors import Code, FeederError
from feeder.v1 import feeder_pb2 as pb

from .config import ClientConfig
from .decode import FeederBatch
from .stream import FeederClient
from .transport import Transport

log = logging.getLogger("feeder_client.elastic")

_SPEC_FIELDS = {f.name for f in dataclasses.fields(StreamSpec)}
_CLIENT_FIELDS = {f.name for f in dataclasses.fields(ClientConfig)} - {"targets", "spec", "cursor"}


class ElasticFeeder:
    """One replica's (or one member's of a replica) view of an elastic job: `step()` for its part
    of a global step, `commit()` once the step's fate is known.

    Args:
        targets: HOST:PORT of the feeders that may serve the job (failover as FeederClient's).
        job, seq_len, micro_batch, seed, ...: as for FeederClient (StreamSpec's fields).
        accumulation: micro-batches per replica per step.
        replicas: the data-parallel replicas the job starts with; under "constant" the global
            batch is micro_batch * accumulation * replicas samples for as long as it runs.
        global_batch: "constant" (default) or "shrink" (each live replica keeps micro_batch *
            accumulation samples a step; torchft's default).
        cursor: shrink only: the cursor after the last committed step (from `state_dict()`); None
            for a new job, or to start from the feeders' commit log.
        Other keywords go to StreamSpec (dataset, mixture, packing, member, cp_size, ...) or to
        ClientConfig (read_ahead, retry_for_s, security, ...).
    """

    def __init__(self, targets, *, job: str, seq_len: int, micro_batch: int, replicas: int,
                 accumulation: int = 1, seed: int = 0, global_batch: str = "constant",
                 cursor: bytes | None = None, **kwargs):
        unknown = set(kwargs) - _SPEC_FIELDS - _CLIENT_FIELDS
        if unknown or {"rank", "world_size", "first_step", "start_replicas"} & set(kwargs):
            bad = sorted(unknown | ({"rank", "world_size", "first_step", "start_replicas"} & set(kwargs)))
            raise FeederError(f"ElasticFeeder got unexpected arguments {bad}: the replica, the live replicas and the "
                              "step are step()'s; the rest are StreamSpec's or ClientConfig's fields",
                              code=Code.INVALID_ARGUMENT)
        if global_batch not in ("constant", "shrink"):
            raise FeederError(f"global_batch must be constant or shrink, got {global_batch!r}",
                              code=Code.INVALID_ARGUMENT)
        self.targets = (targets,) if isinstance(targets, str) else tuple(targets)
        spec_kw = {k: v for k, v in kwargs.items() if k in _SPEC_FIELDS}
        self._client_kw = {k: v for k, v in kwargs.items() if k in _CLIENT_FIELDS}
        # Checked now (a bad value is the caller's to hear at once, not in the first step).
        self._spec = StreamSpec(job=job, rank=0, world_size=replicas, seq_len=seq_len, micro_batch=micro_batch,
                                seed=seed, global_batch=global_batch, accumulation=accumulation,
                                start_replicas=replicas if global_batch == "constant" else 0, **spec_kw)
        self.global_batch = global_batch
        self.committed_cursor = cursor     # shrink: after the last committed step,
        self.committed_step: int | None = None   # that step (None: unknown, or none yet)
        self._client: FeederClient | None = None
        self._world: tuple[int, int] | None = None   # (replica, replicas) of the open stream
        self._next = -1                    # the step the open stream delivers next
        self._held: FeederBatch | None = None   # a batch read past the step asked
        self._last: tuple[tuple, list[FeederBatch]] | None = None   # the last step answered, by its question
        self._asked: dict[int, tuple[int, int]] = {}   # step -> (replica, replicas) it was last asked in
        self.finished = False              # every epoch asked for has been dealt
        self.reopens = 0                   # streams opened for a new world or a step out of order
        self._reports: queue.Queue = queue.Queue(maxsize=1024)
        self._closing = threading.Event()   # set when close() gives up waiting for the reports
        self._retry_for_s = float(self._client_kw.get("retry_for_s", 300.0))
        self._transport: Transport | None = None
        self._reporter = threading.Thread(target=self._report_loop, name="feeder-elastic-commits", daemon=True)
        self._reporter.start()

    # the training loop's side
    def step(self, step: int, replica: int, replicas: int) -> list[FeederBatch]:
        """This replica's micro-batches of global step `step` among `replicas` live replicas
        (torchft: manager.current_step(), participating_rank(), num_participants()). Each batch's
        `step_samples` is the whole step's sample count (the loss's denominator) and `parts` the
        length of this list. An empty list: nothing for this replica in this step (more replicas
        than the step has micro-batches), or every epoch asked for is done (`finished`)."""
        if not (isinstance(replicas, int) and replicas > 0 and isinstance(replica, int) and 0 <= replica < replicas):
            raise FeederError(f"replica must be in [0, replicas) and replicas > 0, got replica={replica!r} of "
                              f"replicas={replicas!r}", code=Code.INVALID_ARGUMENT)
        if not isinstance(step, int) or step < 0:
            raise FeederError(f"step must be a global step >= 0, got {step!r}", code=Code.INVALID_ARGUMENT)
        question = (step, replica, replicas, self.committed_cursor if self.global_batch == "shrink" else None)
        if self._last is not None and self._last[0] == question:   # the same step again in the same world
            return [b for b in self._last[1] if len(b.sample_ids)]   # (the same micro-batches; an empty part's marker is none)
        if self._client is None or self._world != (replica, replicas) or self._next != step:
            self._open(step, replica, replicas)
        try:
            got = self._read(step)
        except FeederError as e:
            if e.code != Code.FAILED_PRECONDITION or self.global_batch != "shrink" or self.committed_cursor is None:
                raise
            # The cursor held is not the one after step - 1: start from the feeders' commit log.
            log.warning("step %d: %s; starting from the feeders' commit log instead", step, e)
            self.committed_cursor = self.committed_step = None
            self._open(step, replica, replicas, cursor=False)
            got = self._read(step)
        self._next = step + 1
        self._last = (question, got)
        self._asked[step] = (replica, replicas)
        return [b for b in got if len(b.sample_ids)]

    def commit(self, step: int, committed: bool) -> None:
        """Step `step` ended: applied by every live replica (`committed`), or not (it is dealt
        again at its next attempt). Returns at once; the feeders are told in the background."""
        got = self._last[1] if self._last is not None and self._last[0][0] == step else None
        if not got:   # not dealt here (healing, or past the last epoch): nothing of ours to record
            return
        cursor = got[-1].cursor
        if committed and self.global_batch == "shrink":
            self.committed_cursor, self.committed_step = cursor, step
        replica, replicas = self._asked.get(step, (0, 0))
        try:
            self._reports.put_nowait(pb.ReportRequest(job=self._spec.job, rank=replica, has_commit=True,
                                                      committed_step=step, committed=committed, replicas=replicas,
                                                      step_cursor=cursor))
        except queue.Full:   # the feeders are unreachable for long: the log is for audits and new replicas
            log.warning("commit reports are not getting through; dropped step %d's", step)

    def state_dict(self) -> dict:
        """What a checkpoint keeps: the cursor after the last committed step (shrink)."""
        return {"global_batch": self.global_batch, "cursor": self.committed_cursor, "step": self.committed_step}

    def load_state_dict(self, state: dict) -> None:
        self.committed_cursor, self.committed_step = state.get("cursor"), state.get("step")
        self._last = None

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None
        self._reports.put(None)
        self._reporter.join(timeout=10)   # the reports still queued go out first
        self._closing.set()
        if self._transport is not None:
            self._transport.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # the stream
    def _open(self, step: int, replica: int, replicas: int, cursor: bool = True) -> None:
        if self._client is not None:
            self._client.close()
            self.reopens += 1
        # shrink: the cursor after step - 1's commit, when this replica has it; a replica that sat
        # steps out (healing) or is new starts from the feeders' commit log instead.
        held = self.committed_cursor if cursor else None
        cursor = None
        if self.global_batch == "shrink" and self.committed_step in (None, step - 1):
            cursor = held
        spec = dataclasses.replace(self._spec, rank=replica, world_size=replicas, first_step=step)
        self._client = FeederClient(ClientConfig(targets=self.targets, spec=spec, cursor=cursor, **self._client_kw))
        self._world, self._next, self._held = (replica, replicas), step, None

    def _read(self, step: int) -> list[FeederBatch]:
        got: list[FeederBatch] = []
        while True:
            b = self._held
            self._held = None
            if b is None:
                try:
                    b = next(self._client)
                except StopIteration:
                    self.finished = True
                    return got
            if b.step != step and not got:
                # A stream that does not start at the step asked was opened from a cursor of another
                # step (shrink: ElasticFeeder(cursor=...) of an older checkpoint): its steps between
                # would be dealt from a chain that is not the job's (outside review of issue 43).
                raise FeederError(f"the stream for step {step} began at step {b.step}: the cursor it was opened from "
                                  f"is after step {b.step - 1}, not {step - 1}", code=Code.FAILED_PRECONDITION)
            if b.step != step:
                self._held = b
                return got
            got.append(b)
            if b.part + 1 >= max(1, b.parts):
                return got

    # commit reports, off the training loop's path
    def _report_loop(self) -> None:
        while True:
            req = self._reports.get()
            if req is None:
                return
            # Every target in turn, again and again with a growing pause, until one takes it or the
            # client's retry_for_s runs out: a feeder restarting must not lose the job's commits
            # (a shrink job's new replicas start from them; the audit counts them).
            delay, deadline = 0.1, time.monotonic() + self._retry_for_s
            while not self._send(req):
                if time.monotonic() > deadline or self._closing.wait(delay):
                    log.warning("the commit of step %d reached no feeder; a shrink job's new replicas then need "
                                "their cursor from a peer", req.committed_step)
                    break
                delay = min(2.0, delay * 2)

    def _send(self, req) -> bool:
        client = self._client
        target = client.target if client is not None else self.targets[0]
        for t in (target, *[t for t in self.targets if t != target]):
            try:
                if self._transport is None:
                    self._transport = Transport(ClientConfig(targets=self.targets, spec=self._spec, **self._client_kw))
                self._transport.stub(t).Report(req, timeout=10)
                return True
            except Exception as e:   # (grpc.RpcError, or a channel that cannot open) the next target
                log.debug("commit report of step %d to %s: %s", req.committed_step, t, e)
        # A fresh channel for the next try: one to a feeder that restarted waits out gRPC's
        # reconnect backoff (seconds, growing), and a dying replica's last reports were lost so.
        if self._transport is not None:
            self._transport.close()
            self._transport = None
        return False


class TorchftFeeder:
    """An ElasticFeeder driven by a torchft Manager: the step, this replica and the live
    replicas come from its quorum (participating_rank, current_step, num_participants).

        data = TorchftFeeder(ElasticFeeder(targets, job=..., replicas=3, ...), manager)
        optimizer.zero_grad()                      # torchft starts the quorum here
        for b in data.batches():                   # this replica's micro-batches of the step
            (summed_loss(b) * data.scale).backward()
        committed = manager.should_commit()        # (OptimizerWrapper.step() asks it, and returns None)
        if committed: inner_optimizer.step()
        data.commit(committed)

    A replica that is healing (not participating in this step) gets no batches and reports no
    commit; it still runs a backward pass of zeros so the all-reduce has every group."""

    def __init__(self, feeder: ElasticFeeder, manager):
        self.feeder, self.manager = feeder, manager
        self._step: int | None = None
        self._dealt = False
        self.scale = 0.0   # what a summed loss is multiplied by (see batches())

    def batches(self) -> list[FeederBatch]:
        """This replica's micro-batches of the quorum's step ([] while it heals). Sets `scale`:
        torchft's all-reduce averages over the W participants, so a loss summed over a batch's
        samples times W / step_samples makes the step's gradient the mean over its global batch."""
        m = self.manager
        rank = m.participating_rank()     # waits for the quorum (async by default): the step is
        self._step = m.current_step()     # read after it, a healed group's jumping to its peers'
        self._dealt = rank is not None
        self.scale = 0.0
        if rank is None:
            return []
        world = m.num_participants()
        got = self.feeder.step(step=self._step, replica=rank, replicas=world)
        if got:
            self.scale = world / got[0].step_samples
        return got

    def commit(self, committed: bool) -> None:
        """The step's fate (manager.should_commit()), for a replica that was dealt it."""
        if self._step is not None and self._dealt:
            self.feeder.commit(step=self._step, committed=bool(committed))

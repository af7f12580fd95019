"""FeederDataset: a torch IterableDataset over one rank's feeder stream."""
from __future__ import annotations

import operator
import os
import tempfile
import uuid
import weakref
from typing import Iterator, Mapping, Sequence

from torch.utils.data import IterableDataset, get_worker_info

from .config import process_started_ns
from .stream import ClientConfig, FeederBatch, FeederClient
from feeder.core.config import StreamSpec
from feeder.service.security import ClientSecurity


class FeederDataset(IterableDataset):
    """A torch IterableDataset of one rank's batches, with DistributedSampler's samples.

    Each item is a `FeederBatch` (.tokens int64 [n, seq_len + 1], .sample_ids, .epoch,
    .cursor), already a batch: use `DataLoader(ds, batch_size=None)`. The rank receives
    exactly the ids `DistributedSampler(num_replicas=world_size, rank=rank, shuffle, seed,
    drop_last)` gives it, epoch after epoch, each batch once, in order, across failovers.

    Passes: without workers, a new pass (`iter`) continues after the last batch yielded.
    With workers, every pass starts from the cursor this object holds in the main process
    (the constructor's, or `load_state_dict`'s): a worker cannot know which of its prefetched
    batches the main process took. To continue after a pass with workers, load the cursor of
    the last batch the loop took (`batch.cursor`).

    Args:
        targets: "HOST:PORT", a list of them (preference order, or nearest first with
            prefer="rtt"), or {region: HOST:PORT}.
        job, rank, world_size, seq_len, micro_batch, seed, shuffle, drop_last, epoch,
            num_epochs (0: no end), reshard, expected_fingerprint, dataset, bad_records,
            compression, compression_level: the stream (feeder.config.StreamSpec): they
            decide the rank's samples; the same values give the same samples on any feeder.
        mixture, epoch_samples, remix: draw from several of the feeder's named sources by
            weight ({"web": 0.7, "code": 0.3}, normalized), epoch_samples positions per epoch
            (0: the sources' samples summed); remix=True continues a cursor of another mixture
            under this one. Each batch then has `sources` (the index of each sample's source in
            this mixture) and `sample_ids` within that source. docs/mixtures.md has the rules.
        mixture_schedule: weights that change with training progress instead of `mixture`'s
            fixed ones: {"unit": "samples"|"tokens", "segment": [{"until": N, "weights": {...},
            "to": {...}}, ..., {"weights": {...}}]} (each segment constant, or linear to `to`),
            or the path of a TOML file of that. An operator may change it live (feeder mix).
            docs/mixtures.md, "Schedules".
        permutation: the epoch's order. "torch" (the default): exactly torch.randperm's, as this
            process's torch release draws it, so the ids are a local DistributedSampler's; the
            feeder builds it once per epoch (O(n), ahead of need, shared). "stateless": a seeded
            random-access bijection of the epoch (O(1), instant at any size), a new one per epoch;
            not torch's order. docs/scale.md, "Choosing an order".
        member, members: model parallelism (docs/model-parallel.md). rank and world_size are the
            data-parallel rank and size; `members` processes consume this rank (its tensor-
            parallel ranks, its first and last pipeline stages), this one number `member`. Each
            receives the same batches; the feeder builds them once for all.
            feeder_client.parallel.feeder_ranks derives all of these from a framework's mesh.
        cp_rank, cp_size, cp_layout: context parallelism: this process receives only its
            positions of each sample (batch.input_ids, batch.labels, batch.position_ids,
            batch.loss_mask: [n, seq_len / cp_size]); "zigzag" (Megatron's split for ring
            attention: chunks c and 2C-1-c of 2C) or "contiguous" (chunk c of C: Ulysses).
        boundaries, packing: document-aware samples (docs/packing.md). boundaries=True: each batch
            also has `position_ids`, `cu_seqlens` and `loss_mask` (and `boundaries`, what
            feeder_client.packing turns into each stack's inputs). packing="best_fit": a sample is
            a bin of whole documents (best-fit decreasing; only documents longer than a bin are
            cut), padded, with boundaries; "concat" (the default): windows of the documents
            concatenated.
        cursor: a saved `batch.cursor` or `state_dict()["cursor"]`: resume right after that
            batch (None: from `epoch`'s start). Opaque bytes, bound to the stream's values.
        read_ahead .. keep_freed_memory, connect_timeout_s, slow_wait .. hedge: how the stream
            is carried (ClientConfig: read-ahead, timeouts, retry budget, failback, pinning,
            malloc, moving off a slow feeder, hedged reads).
        tls_ca, tls_cert, tls_key, token, token_file, tls_server_name: the ClientSecurity
            (TLS, mutual TLS, the job's bearer token).

    Raises:
        FeederError: INVALID_ARGUMENT for invalid values, here in the constructor (in the
            main process, not later in a worker).

    Threads and processes: no gRPC object exists until iteration starts, so the dataset can
    be pickled to DataLoader workers (fork or spawn) and each worker opens its own channel.
    With num_workers=k, worker w streams batches w, w+k, ...; the DataLoader's round-robin
    over workers restores the exact order, through any reconnect.
    """

    def __init__(self, targets: Sequence[str] | Mapping[str, str] | str, job: str, rank: int, world_size: int, seq_len: int,
                 micro_batch: int, seed: int = 0, shuffle: bool = True, drop_last: bool = False, epoch: int = 0,
                 num_epochs: int = 1, cursor: bytes | None = None, *, compression: str = "",
                 compression_level: int = 3, reshard: bool = False, expected_fingerprint: str = "",
                 dataset: str = "", read_ahead: int = 8, idle_timeout_s: float = 30.0, keepalive_s: float = 10.0,
                 retry_for_s: float = 300.0, report_every_s: float = 5.0, bad_records: str = "",
                 prefer: str = "rtt", tls_ca: str = "", tls_cert: str = "", tls_key: str = "", token: str = "",
                 token_file: str = "", tls_server_name: str = "", max_read_ahead: int = 64,
                 failback_s: float = 60.0, pin_memory: bool | None = None,
                 keep_freed_memory: bool = True, mixture: Mapping[str, float] | Sequence | None = None,
                 epoch_samples: int = 0, remix: bool = False, permutation: str = "torch",
                 connect_timeout_s: float = 30.0, boundaries: bool = False, packing: str = "concat",
                 member: int = 0, members: int = 1, cp_rank: int = 0, cp_size: int = 1, cp_layout: str = "zigzag",
                 slow_wait: float = 0.05, slow_window_s: float = 3.0, slow_hold_s: float = 15.0, hedge: bool = False,
                 mixture_schedule=None):
        # Mesh arithmetic gives numpy or torch integers: taken as the ints they are (a float or a
        # bool is still refused by StreamSpec, saying what was expected).
        rank, world_size, seq_len, micro_batch, member, members, cp_rank, cp_size = (
            _as_int(v) for v in (rank, world_size, seq_len, micro_batch, member, members, cp_rank, cp_size))
        regions: tuple[str, ...] = ()
        if isinstance(targets, str):
            targets = [targets]
        elif isinstance(targets, Mapping):  # {region: HOST:PORT}
            regions, targets = tuple(targets), list(targets.values())
        self.spec = StreamSpec(job=job, rank=rank, world_size=world_size, seq_len=seq_len,
                               micro_batch=micro_batch, seed=seed, shuffle=shuffle, drop_last=drop_last,
                               epoch=epoch, num_epochs=num_epochs, compression=compression,
                               compression_level=compression_level, reshard=reshard,
                               expected_fingerprint=expected_fingerprint, dataset=dataset,
                               bad_records=bad_records, client_started_ns=process_started_ns(),
                               mixture=mixture_pairs(mixture, mixture_schedule, seq_len), remix=remix,
                               mixture_schedule=schedule_text(mixture_schedule, seq_len), permutation=permutation,
                               boundaries=boundaries, packing=packing, member=member, members=members,
                               cp_rank=cp_rank, cp_size=cp_size, cp_layout=cp_layout,
                               epoch_samples=int(epoch_samples) if hasattr(epoch_samples, "__index__")
                               and not isinstance(epoch_samples, bool) else epoch_samples)
        self.targets = tuple(targets)
        self.cursor = cursor
        # Plain values only (no gRPC objects): the dataset is pickled to DataLoader workers.
        security = ClientSecurity(ca=tls_ca, cert=tls_cert, key=tls_key, token=token, token_file=token_file,
                                  server_name=tls_server_name)
        self.transport = dict(read_ahead=read_ahead, idle_timeout_s=idle_timeout_s, keepalive_s=keepalive_s,
                              retry_for_s=retry_for_s, connect_timeout_s=connect_timeout_s,
                              report_every_s=report_every_s, security=security,
                              regions=regions, prefer=prefer, max_read_ahead=max_read_ahead,
                              failback_s=failback_s, pin_memory=pin_memory,
                              keep_freed_memory=keep_freed_memory, slow_wait=slow_wait, slow_window_s=slow_window_s,
                              slow_hold_s=slow_hold_s, hedge=hedge)
        ClientConfig(targets=self.targets, spec=self.spec, **self.transport)  # validate now, not in a worker
        self.client: FeederClient | None = None
        # Where load_state_dict leaves the cursor for DataLoader workers: a persistent worker
        # holds the copy of this object it was started with, so a cursor loaded here later
        # reaches it only through a file it reads at the start of each pass.
        where = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
        _remove_orphaned_anchors(where)
        self._anchor = os.path.join(where, f"feeder-dataset-{os.getpid()}-{uuid.uuid4().hex}.cursor")
        weakref.finalize(self, _remove_anchor, self._anchor, os.getpid())

    def __iter__(self) -> Iterator[FeederBatch]:
        """One pass over the rank's stream: its batches, in order, until the last epoch ends.

        Each pass opens a FeederClient of its own (closing the previous pass's); in a
        DataLoader worker, only that worker's share of the batches.

        Raises:
            FeederError: when no target can serve the rank (see FeederClient.__next__);
                a refusal keeps its code (FAILED_PRECONDITION for a cursor of another
                stream, DATA_LOSS for a corrupt dataset, ...).
        """
        info = get_worker_info()
        spec = self.spec
        if info is not None and info.num_workers > 1:
            spec = StreamSpec(**{**spec.__dict__, "worker_index": info.id, "num_workers": info.num_workers})
        # A DataLoader worker never pins (CUDA does not start in a forked process, and the
        # batches are copied to the main process anyway: DataLoader(pin_memory=True) pins there).
        transport = self.transport if info is None else {**self.transport, "pin_memory": False}
        if self.client is not None:
            self.client.close()
        cursor = self.cursor if info is None else self._pass_start()
        self.client = FeederClient(ClientConfig(targets=self.targets, spec=spec, cursor=cursor, **transport))
        try:
            for batch in self.client:
                # In a DataLoader worker the cursor stays the pass's start: the worker's own
                # last batch is not where the main process stands (the other workers' batches
                # and the prefetch lie between), so every pass starts where the main process's
                # dataset says, persistent workers or not.
                if info is None:
                    self.cursor = batch.cursor
                yield batch
        finally:
            self.client.close()

    # torchdata's convention: the state is the cursor after the last batch yielded.
    def state_dict(self) -> dict:
        """The position to resume from: {"version": 1, "job", "rank", "cursor"}.

        The cursor is that of the last batch this object yielded (in the main process; see
        the class's note on passes with workers). Save it with the model's checkpoint and
        give it to load_state_dict (or as `cursor=`) to continue after that batch.
        """
        return {"version": 1, "job": self.spec.job, "rank": self.spec.rank, "cursor": self.cursor}

    def load_state_dict(self, state: dict) -> None:
        """Make the next pass start right after the batch that carried state["cursor"].

        Reaches DataLoader workers too, persistent ones included (through a file they read
        at the start of each pass).

        Raises:
            ValueError: a state of another version than 1.
        """
        if state.get("version") != 1:
            raise ValueError(f"FeederDataset state version {state.get('version')!r} is not supported, expected 1")
        self.cursor = state["cursor"]
        tmp = f"{self._anchor}.{os.getpid()}.tmp"
        with open(tmp, "wb") as f:
            f.write(b"N" if self.cursor is None else b"C" + bytes(self.cursor))
        os.replace(tmp, self._anchor)   # a worker starting a pass reads the old cursor or the new, whole

    def _pass_start(self) -> bytes | None:
        """In a DataLoader worker: the cursor a pass starts from, the main process's latest."""
        try:
            with open(self._anchor, "rb") as f:
                data = f.read()
        except FileNotFoundError:       # no load_state_dict since the worker got its copy
            return self.cursor
        return None if data[:1] == b"N" else data[1:]

    @property
    def data_wait_s(self) -> float:
        """Seconds the loop has waited for batches in this pass (0 before the first pass)."""
        return self.client.wait_s if self.client is not None else 0.0

    @property
    def region(self) -> str:
        """The region feeding this pass now ("" before the first batch)."""
        return self.client.region if self.client is not None else ""



def _as_int(value):
    """numpy's and torch's integers (what a framework's mesh arithmetic gives) as int; anything
    else as it is, for StreamSpec to refuse with a message."""
    if isinstance(value, (bool, int)) or not hasattr(value, "__index__"):
        return value
    try:
        return operator.index(value)
    except TypeError:
        return value


def _remove_anchor(path: str, owner: int) -> None:
    if os.getpid() == owner:       # not from a forked worker's copy
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def schedule_text(schedule, seq_len) -> str:
    """A mixture schedule as StreamSpec takes it (its canonical JSON; "" for none): a table of
    [[segment]]s (feeder.core.schedule.parse), a list of segments, or a TOML file's path."""
    if schedule is None or schedule == "":
        return ""
    from feeder.core import schedule as sc

    if isinstance(schedule, str):
        if schedule.lstrip().startswith("{"):   # (already canonical: a spec passed on)
            return sc.Schedule.from_canonical(schedule).canonical()
        from feeder.core.config import load_toml

        schedule = load_toml(schedule)
    return sc.parse(schedule, seq_len=seq_len if isinstance(seq_len, int) else 0).canonical()


def mixture_pairs(mixture, schedule=None, seq_len=0) -> tuple[tuple[str, float], ...]:
    """A mixture as StreamSpec takes it: {name: weight} or [(name, weight), ...], in order. With a
    schedule, its sources and first weights (a `mixture` given too must name the same sources)."""
    if schedule is not None and schedule != "":
        from feeder.core import schedule as sc

        sched = sc.Schedule.from_canonical(schedule_text(schedule, seq_len))
        pairs = tuple(zip(sched.names, sched.segments[0].weights))
        if mixture is not None and tuple(n for n, _ in mixture_pairs(mixture)) != sched.names:
            from feeder.core.errors import InvalidArgument

            raise InvalidArgument(f"mixture and mixture_schedule name other sources: {[n for n, _ in mixture_pairs(mixture)]}"
                                  f" and {list(sched.names)}; give the schedule alone")
        return pairs
    if mixture is None:
        return ()
    import numbers

    pairs = mixture.items() if isinstance(mixture, Mapping) else mixture
    try:   # numpy's scalars as Python's (the spec checks types; a weight of np.float32 is a number)
        return tuple((name, float(weight) if isinstance(weight, numbers.Real) and not isinstance(weight, bool)
                      else weight) for name, weight in pairs)
    except (TypeError, ValueError):
        from feeder.core.errors import InvalidArgument

        raise InvalidArgument(f"mixture must be {{source: weight}} or [(source, weight), ...], got {mixture!r:.80}") \
            from None


def _remove_orphaned_anchors(where: str) -> int:
    """Remove the anchors of processes that are gone: a trainer ended by SIGKILL or os._exit
    never runs its finalizers, and each of its datasets left a small file in /dev/shm (RAM)
    behind. Only this user's, only of dead processes; how many were removed."""
    import re

    removed = 0
    try:
        names = os.listdir(where)
    except OSError:
        return 0
    for name in names:
        m = re.fullmatch(r"feeder-dataset-(\d+)-[0-9a-f]{32}\.cursor", name)
        if not m:
            continue
        try:
            os.kill(int(m.group(1)), 0)
            continue           # alive (or another user's process: EPERM below)
        except ProcessLookupError:
            pass
        except (PermissionError, OverflowError, ValueError):
            continue
        path = os.path.join(where, name)
        try:
            if os.stat(path).st_uid == os.getuid():
                os.unlink(path)
                removed += 1
        except OSError:
            pass
    return removed

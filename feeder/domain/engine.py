"""The feeder's domain core: datasets, jobs and open streams. No gRPC here; the servicer
translates requests into StreamSpecs and FeederErrors into status codes."""
from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

from feeder import __version__
from feeder.sources import cache, preparing
from feeder.core import blend as blending
from feeder.core import schedule as schedule_blends
from feeder.core import scope
from feeder.sources import packed
from feeder.sources.kafka import snapshot
from feeder.core.config import ServeConfig, StreamSpec
from feeder.core.cursor import Cursor, Mixture, Scheduled
from feeder.core.errors import FailedPrecondition, InvalidArgument, NotFound, Unavailable
from feeder.domain.commits import CommitLog
from feeder.domain.schedules import Schedules
from feeder.domain.order_store import OrderStore
from feeder.pipeline.batcher import Block
from feeder.pipeline.jobs import Job, Jobs, RankState
from feeder.pipeline.members import Member, Window, share_key
from feeder.pipeline.reads import Reads, name_threads
from feeder.pipeline.stream import MemoryBudget, RankStream, default_budget_bytes
from feeder.domain.siblings import Siblings
from feeder.sources import Context, Source
from feeder.sources import scheduled as _scheduled  # noqa: F401 (registers scheduled mixtures' plan)
from feeder.sources.mixture import MixtureSource
from feeder.domain.process_status import JobStatus, MemberStatus, ProcessStatus, RankStatus

log = logging.getLogger("feeder.engine")


class Engine:
    def __init__(self, cfg: ServeConfig, sources: dict[str, Source],
                 serialize: Callable[[Block], bytes]):
        self.cfg = cfg
        self.serialize = serialize   # Block -> wire bytes, run on the pool threads
        self.sources = sources
        self.default = next(iter(sources))
        self._mixtures: dict[tuple, MixtureSource] = {}
        self.jobs = Jobs()
        self.pool = ThreadPoolExecutor(cfg.threads, thread_name_prefix="feeder-batch", initializer=name_threads,
                                       initargs=("feeder-batch",))
        # The builds in flight on the pool, and the stuck ones (watch_reads, every second).
        self.reads = Reads()
        self.stuck: tuple[str, ...] = ()
        self.stuck_names: frozenset[str] = frozenset()
        self.load = 0.0
        self._cpu = (time.monotonic(), _cpu_s())
        # What every stream and members' window of this server may hold built ahead of its peer.
        self.budget = MemoryBudget(int(cfg.memory_budget_mb * 2**20) or default_budget_bytes(cfg.processes))
        self.planner = _started_pool(PLAN_THREADS, "feeder-plan")
        self.started = time.monotonic()
        self.ledger = _open_ledger(cfg.ledger) if cfg.ledger else None
        # One of several processes on this port (`feeder serve --processes N`)
        self.siblings = Siblings(cfg.sibling_dir, cfg.process_index) if cfg.sibling_dir else None
        # Called (on the event loop) when a stream opens or closes, or a report adds a rank or
        # changes its state: the server then leaves its status for the siblings at once rather
        # than at the next second, so `feeder status` on any process sees a rank that just
        # connected or finished.
        self.on_change: Callable[[], None] = lambda: None
        self.version = __version__
        # Large epoch orders of torch's kind: built once into the cache directory, shared.
        self.orders = OrderStore(cfg.cache, max_bytes=int(cfg.cache_max_gb * 2**30))
        # What this server's plans build into and take from (no process-wide state: another
        # server in this process keeps its own).
        self.schedules = Schedules(cfg.cache)
        self.context = Context(cache_dir=cfg.cache, orders=self.orders, packing=cfg.packing, schedules=self.schedules)
        self.scrubber = None   # feeder.scrub.Scrubber, started by the server (--scrub-mb-s)
        # Elastic jobs' committed steps (feeder.core.steps), shared through the cache directory.
        self.commits = CommitLog(cfg.cache)
        self.elastic_steps: dict[str, tuple[int, int, set]] = {}   # job -> last committed step, its world, steps aborted

    def source(self, name: str) -> Source:
        src = self.sources.get(name or self.default)
        if src is None:
            served = scope.current().names(self.sources, "dataset")   # (those the caller may read)
            raise NotFound(f"dataset {name!r} is not served here (served: {served or 'none it may read'})",
                           elsewhere=True)
        return src

    def compression(self, requested: str, level: int, rtt_us: int) -> tuple[str, int]:
        """The compression and level a rank gets: what it asked for ("none", "zstd"; level 0 for
        the default), or, when it leaves that to us (""), the feeder's default, except that a
        remote rank (its measured RTT at least remote_rtt_ms) always gets zstd: over a long link
        bytes cost more than the CPU to shrink them."""
        remote = rtt_us > 0 and rtt_us >= self.cfg.remote_rtt_ms * 1000
        chosen = requested or ("zstd" if remote else self.cfg.default_compression)
        return chosen, level or self.cfg.default_level

    def status(self, job: str = "") -> ProcessStatus:
        """This process's jobs and ranks: one job (NotFound if unknown), or all. Call it on the event loop."""
        jobs = [self.jobs.get(job)] if job else list(self.jobs.jobs.values())
        region = self.cfg.region
        return ProcessStatus(
            preparing=tuple(v["what"] for v in preparing.current().values()),
            region=region, uptime_s=time.monotonic() - self.started, streams_open=self.jobs.streams_open,
            rss_mb=self.rss_mb(), tasks=len(asyncio.all_tasks()), threads=threading.active_count(), processes=1,
            building=tuple(b.describe() for b in self.orders.builds()),
            packings=tuple(packed.describe(p) for p in packed.built()),
            cache_damaged=sum(cache.damaged_counts().values()),
            cache_problems=tuple(p for p in (self.orders.unusable, packed.problem, snapshot.problem,
                                             self.commits.failed) if p),
            stuck=self.stuck, load=self.load,
            chunks_changed=sum(self.scrubber.changed.values()) if self.scrubber else 0,
            scrubbed_bytes=sum(self.scrubber.scrubbed_bytes.values()) if self.scrubber else 0,
            jobs=tuple(JobStatus(job=j.job, dataset=j.dataset or self.default, world_size=j.world_size,
                                 elastic=self._elastic_status(j.job), streams_open=len(j.streams),
                                 mixture=self._mixture_status(j.job),
                                 ranks=tuple(_rank_status(r, region)
                                             for r in sorted(j.ranks.values(), key=lambda r: r.rank)))
                       for j in jobs))

    def mix(self, job: str, phase: int, schedule: str, at: int) -> tuple[int, str, bool]:
        """A live change of a job's mixture schedule (feeder.domain.schedules): (where, the
        schedule in force here, whether this feeder knows the job)."""
        if self.siblings is not None:
            raise FailedPrecondition("a live mixture change reaches one process of a feeder started with --processes "
                                     "N > 1, and each process plans its own ranks; change it on feeders of one process")
        if phase not in (1, 2, 3):
            raise InvalidArgument(f"Mix phase must be 1 (prepare), 2 (commit) or 3 (abort), got {phase}")
        book = self.schedules.recorded(job)
        if phase == 1:
            return (book.prepare(), book.schedule.canonical(), True) if book is not None else (0, "", False)
        if phase == 3:
            if book is not None:
                book.abort()
            return 0, "", book is not None
        from feeder.core import schedule as sc

        new = sc.Schedule.from_canonical(schedule)
        got = self.schedules.commit(job, new, at)
        log.info("job %r: mixture schedule version %d from progress %d: %s", job, got.version, at, got.shown())
        return at, got.canonical(), book is not None

    def record_mix(self, job: str, at: int, schedule: str) -> None:
        """A committed change in the ledger (on the event loop, as every ledger line is written):
        what the batches after it were drawn under. Audit reads past it."""
        if self.ledger:
            self.ledger.write(json.dumps({"mix": job, "at": at, "schedule": schedule}) + "\n")

    def mixture(self, spec: StreamSpec, cursor: Cursor | None) -> tuple[MixtureSource, StreamSpec]:
        """The mixture a stream asks for, and its spec with the cursor's epoch_samples where the
        request leaves it open: a remix that adds a source changes the sources' sum, not the
        epoch the job is in. Otherwise the plan fills in the sum (a bounded topic's size is known
        only once the job's epoch of it is), before ranks of a job compare it."""
        src = self._mixtures.get(spec.mixture)
        if src is None:
            src = MixtureSource(spec.mixture, self.sources)
            if len(self._mixtures) >= 64:   # a job's mixture lives as long as the job asks for it
                self._mixtures.pop(next(iter(self._mixtures)))
            self._mixtures[spec.mixture] = src
        n = spec.epoch_samples
        if not n and cursor is not None and type(cursor.src) in (Mixture, Scheduled):
            n = cursor.src.epoch_samples
        return src, dataclasses.replace(spec, epoch_samples=n)

    async def open_stream(self, spec: StreamSpec, cursor: bytes, peer: str = "",
                          failover: bool = False, left=lambda: False) -> RankStream:
        """The rank's stream, attached to its job (where it replaces an older one of its slot).
        `left()` says whether its client went away while it opened (a plan can take seconds: a
        Kafka epoch's snapshot): such a stream is not attached."""
        self.budget.admit(spec)   # RESOURCE_EXHAUSTED while the open streams hold the whole budget
        src = None if spec.mixture else self.source(spec.dataset)
        names = tuple(n for n, _ in spec.mixture) if spec.mixture else (src.name,)
        self._refuse_if_stuck(names)
        if not cursor and spec.global_batch == "shrink" and spec.first_step:
            cursor = await self._committed(spec)
        decoded = Cursor.decode(cursor, self.cfg.cursor_secret) if cursor else None
        if spec.mixture:
            src, spec = self.mixture(spec, decoded)
        # Off the loop: a source may read to plan (Kafka decides per job what an epoch is).
        plan = await asyncio.get_running_loop().run_in_executor(self.planner, src.plan, spec, decoded, self.context)
        # The permutation as the plan agreed it: the job's ranks are held to that, not to the
        # torch release each one names (they agree wherever their releases draw the same).
        # (and a mixture's epoch_samples as the plan filled it in)
        spec = dataclasses.replace(spec, permutation=plan.spec.permutation, epoch_samples=plan.spec.epoch_samples)
        stream = RankStream(spec, plan, self.cfg, self.pool, self.serialize, self.budget)
        stream.reads, stream.read_names = self.reads, names
        if left():
            # (soak seed 4710286: a rank moved to this feeder, away, and back while a Kafka
            # snapshot was built; its first request, long cancelled, opened last and replaced
            # the rank's live stream here, which then ended FAILED_PRECONDITION)
            plan.close()
            raise Unavailable("the client left before its stream opened")
        try:
            stream.state = self.jobs.attach(spec, stream)
        except BaseException:
            plan.close()   # refused: the plan's reader or register entry must not outlive it
            raise
        stream.state.peer = peer
        stream.state.last_error = ""
        stream.state.failovers += failover
        if spec.members > 1 and not spec.hedge:   # (a side stream reads on its own: the window is its rank's)
            await self._join_members(stream, src, cursor)
        if self.ledger and spec.member == 0 and spec.cp_rank == 0:   # a rank's samples once, whoever sends them
            opened = {"open": spec.job, "region": self.cfg.region, "n": plan.n, "world": spec.world_size,
                      "rank": spec.rank, "seed": spec.seed, "shuffle": spec.shuffle, "drop_last": spec.drop_last,
                      "fingerprint": plan.fingerprint}
            if spec.mixture:   # what audit holds the per-source counts against (a schedule's: no one set)
                opened["mixture"] = {} if spec.mixture_schedule else dict(zip(src.names, src.weights))
            if spec.elastic:   # what audit holds the committed steps' padding against
                opened["elastic"] = {"global_batch": spec.global_batch, "start_replicas": spec.start_replicas,
                                     "accumulation": spec.accumulation}
            self.ledger.write(json.dumps(opened) + "\n")
        log.info("stream opened job=%s rank=%d/%d worker=%d/%d from epoch %d step %d peer=%s%s%s",
                 spec.job, spec.rank, spec.world_size, spec.worker_index, spec.num_workers,
                 plan.start.epoch, plan.start.step, peer, " (resumed)" if decoded else "",
                 " (failover)" if failover else "")
        self.on_change()
        return stream

    async def _committed(self, spec: StreamSpec) -> bytes:
        """The cursor after step first_step - 1 of a shrink job, for a replica that has none (new,
        or restarted): from the job's commit log, waiting for the report of that step's commit
        (sent by the replicas that ran it, off their critical path, so it may trail this ask)."""
        step, waited = spec.first_step - 1, 0.0
        while (got := await asyncio.to_thread(self.commits.cursor_after, spec.job, step)) is None:
            if waited >= ELASTIC_COMMIT_WAIT_S:
                why = f" (the log cannot be written: {self.commits.failed})" if self.commits.failed else ""
                raise FailedPrecondition(
                    f"job {spec.job!r} (global_batch=shrink): no replica reported step {step}'s commit to a feeder "
                    f"sharing this cache directory within {ELASTIC_COMMIT_WAIT_S:.0f} s{why}; where step "
                    f"{spec.first_step} begins depends on it. Send the cursor after the last committed step "
                    "(ElasticFeeder(cursor=...)), or have the replicas' commits reported (ElasticFeeder.commit)")
            await asyncio.sleep(0.1)
            waited += 0.1
        return got

    def _mixture_status(self, job: str) -> str:
        """`schedule v1 (changed at 12,288) at progress 40,960: web 0.50 (scheduled 0.50), ...`."""
        book = self.schedules.get(job)
        if book is None:
            return ""
        st = book.status()
        changes = ", ".join(f"{at:,}" if at >= 0 else "learned from a cursor" for v, at in st["changes"] if v)
        out = f"schedule v{st['version']}" + (f" (changed at {changes})" if changes else "")
        out += f" at progress {st['progress']:,}"
        if st["actual"]:
            out += ": " + ", ".join(f"{n} {a:.3f} (scheduled {w:.3f})"
                                    for n, a, w in zip(st["names"], st["actual"], st["scheduled"]))
        return out

    def _elastic_status(self, job: str) -> str:
        seen = self.elastic_steps.get(job)
        if seen is None:
            return ""
        step, world, aborted = seen
        last = f"step {step} committed in a world of {world}" if step >= 0 else "no step committed yet"
        return f"{last}; {len(aborted)} steps had an attempt that did not commit"

    def commit(self, job: str, replica: int, step: int, committed: bool, replicas: int, cursor: bytes) -> None:
        """An elastic job's step ended (committed or not): into the commit log and the ledger."""
        # (verified here too: a record any feeder will trust later must be one of ours)
        after = Cursor.decode(cursor, self.cfg.cursor_secret) if cursor else None
        if after is not None and after.job != job:
            raise InvalidArgument(f"the cursor reported with step {step} of job {job!r} is job {after.job!r}'s")
        self.commits.record(job, step=step, committed=committed, replicas=replicas, replica=replica, cursor=cursor)
        last, world, aborted = self.elastic_steps.get(job, (-1, 0, set()))
        if committed and step > last:
            last, world = step, replicas
        elif not committed:
            aborted.add(step)   # (each replica reports it: an attempt counted once per step)
        self.elastic_steps[job] = (last, world, aborted)
        self.on_change()
        if self.ledger:   # (`at`: which dealing of the step committed: the cursor after it)
            self.ledger.write(json.dumps({"commit": job, "step": step, "committed": committed, "replicas": replicas,
                                          "replica": replica, "at": [after.base, after.pos] if after else None})
                              + "\n")

    async def _join_members(self, stream: RankStream, src: Source, cursor: bytes) -> None:
        """A member of a model-parallel rank takes its messages from the rank's window (built
        once for all its members), made here with a plan of its own if the rank has none."""
        spec = stream.spec
        job = self.jobs.get(spec.job)
        key = share_key(spec)

        async def replan(at: bytes):
            s = spec if at == cursor or spec.num_workers == 1 else \
                dataclasses.replace(spec, worker_phase=(spec.worker_index + 1) % spec.num_workers)
            decoded = Cursor.decode(at, self.cfg.cursor_secret) if at else None
            return await asyncio.get_running_loop().run_in_executor(self.planner, src.plan, s, decoded, self.context)

        window = job.windows.get(key)
        if window is None:
            plan = await replan(cursor)
            window = job.windows.get(key)
            if window is None:
                window = job.windows[key] = Window(key, spec, plan, cursor, self.cfg, self.pool, self.serialize,
                                                   on_empty=lambda w: job.windows.pop(w.key, None)
                                                   if job.windows.get(w.key) is w else None, budget=self.budget)
                window.state = stream.state
            else:
                plan.close()   # another member made it meanwhile
        if stream._finished:   # replaced while the window's plan was made
            return
        stream.member = Member(stream, window, cursor, replan)
        stream.state.members[(spec.cp_rank, spec.member)] = stream.member

    def delivered(self, stream: RankStream, block: Block) -> None:
        """Visitation ledger: (job, epoch, world, rank, step, ids) per batch about to be handed to
        gRPC; a model-parallel rank's by its member 0 (context-parallel rank 0) only."""
        if self.ledger and stream.spec.member == 0 and stream.spec.cp_rank == 0:
            s = stream.spec
            bounds = block.bounds()
            lines = []
            for j in range(len(block)):
                a, b = bounds[j], bounds[j + 1]
                rec = {"job": s.job, "epoch": int(block.epochs[j]), "world": s.world_size, "rank": s.rank,
                       "step": int(block.steps[j]), "ids": block.ids[a:b].tolist()}
                if block.elastic is not None:   # a global step's part: audit holds it to the step's commit
                    e = block.elastic[j].tolist()
                    rec.update(elastic=s.global_batch, part=e[1], parts=e[0], at=e[3:5])
                if block.sources is not None:   # a mixture: audit counts positions, and sources by name
                    names = stream.state.mixture
                    rec.update(ids=block.positions[a:b].tolist(),
                               sources=[names[d] for d in block.sources[a:b].tolist()],
                               sample_ids=block.ids[a:b].tolist())
                if s.hedge:   # a copy of a batch the rank reads elsewhere: audit counts it apart
                    rec["hedge"] = True
                lines.append(json.dumps(rec) + "\n")
            self.ledger.write("".join(lines))

    def close_stream(self, stream: RankStream, reason: str) -> None:
        self.jobs.detach(stream.spec, stream)
        st = stream.state
        if st is not None and st.members.get((stream.spec.cp_rank, stream.spec.member)) is stream.member:
            st.members.pop((stream.spec.cp_rank, stream.spec.member), None)
        if st is not None and reason not in ("finished", "cancelled by client"):
            st.last_error = reason
        if st is not None and not st.connected:
            if reason == "finished":
                st.all_sent()
            else:
                st.state = "disconnected"
        log.info("stream closed job=%s rank=%d: %s", stream.spec.job, stream.spec.rank, reason)
        self.on_change()

    def report(self, job: str, rank: int, wait_s: float, step_s: float,
               position: tuple[int, int] | None = None, batches: int = 0, feed: dict | None = None) -> None:
        if position is not None and job not in self.jobs.jobs:
            # A rank training on what it was sent before this process (re)started, or streaming
            # from another process of this port: its job stays known to status while it reports.
            self.jobs.jobs[job] = Job(job=job, dataset="", key=None, world_size=0, idle_since=time.monotonic())
        j = self.jobs.get(job)
        if position is not None and rank not in j.ranks:
            j.ranks[rank] = RankState(rank=rank, state="reporting")
            self.on_change()
        st = j.ranks.get(rank)
        if st is None:
            raise NotFound(f"job {job!r} has no rank {rank} on this feeder (ranks: {sorted(j.ranks)})")
        st.wait_s += max(0.0, wait_s)
        st.step_s += max(0.0, step_s)
        if position is not None:
            was = st.state
            st.took(position)
            if st.state != was:   # ("all sent" -> "finished": the siblings' view must not lag it)
                self.on_change()
            stream = next((s for (r, w, *_), s in j.streams.items() if r == rank and w == 0), None)
            if stream is not None:
                stream.live_plan.taken(position[1])
        if batches and step_s > 0:
            st.taken_rate = batches * st.micro_batch * (st.seq_len + 1) / step_s
        if feed:
            st.feed = feed

    def _refuse_if_stuck(self, names: tuple[str, ...]) -> None:
        """A new stream of a source whose reads are stuck here goes elsewhere (a plain break:
        the rank's next target, and this one again later)."""
        stuck = self.stuck_names.intersection(names)
        if stuck:
            raise Unavailable(f"feeder in region {self.cfg.region}: reads of {', '.join(sorted(stuck))} have not "
                              f"returned for over {self.cfg.stuck_after_s:g} s (a hung filesystem?); this feeder "
                              "takes no new stream of it until they do: try another feeder")

    def watch_reads(self) -> None:
        """Every second, on the loop: the stuck reads (said once in the log; their streams end
        UNAVAILABLE so the ranks move), and the process's load."""
        now = time.monotonic()
        stuck = self.reads.older_than(self.cfg.stuck_after_s, now)
        for r in stuck:
            if not r.told:
                r.told = True
                log.error("a read of %s for %s has not returned for %.0f s (a hung filesystem?): its stream ends "
                          "so the rank moves, and no new stream of it is taken here until it returns",
                          "+".join(r.names), r.what, now - r.since)
            for stream in r.streams:
                if not stream._finished:
                    stream.end(Unavailable(f"feeder in region {self.cfg.region}: a read of {'+'.join(r.names)} has "
                                           f"not returned for {now - r.since:.0f} s; resume elsewhere"))
        if self.stuck and not stuck:
            log.warning("the stuck reads returned: %s is served again", ", ".join(sorted(self.stuck_names)))
        self.stuck = tuple(f"{'+'.join(r.names)}: a read for {r.what}, {now - r.since:.0f} s" for r in stuck)
        self.stuck_names = frozenset(n for r in stuck for n in r.names)
        t0, c0 = self._cpu
        c1 = _cpu_s()
        if now - t0 >= 0.5:
            # the busier of: this process's CPU against the cores it may use, and its batch
            # threads (builds in flight against the pool's threads)
            cpu = (c1 - c0) / (now - t0) / max(1, len(os.sched_getaffinity(0)))
            self.load = round(max(cpu, self.reads.in_flight() / max(1, self.cfg.threads)), 3)
            self._cpu = (now, c1)

    def rss_mb(self) -> float:
        try:
            with open(f"/proc/{os.getpid()}/statm") as f:
                return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
        except OSError:
            return 0.0

    def shutdown(self) -> None:
        """End every stream now with UNAVAILABLE, so clients resume elsewhere at once
        instead of waiting for the grace period to run out."""
        self.orders.stop()   # a build's loop ends within milliseconds: SIGTERM does not wait for it
        blending.stop()      # and so does a mixture's blending scan
        schedule_blends.stop()   # and a scheduled one's
        self.context.stopping.set()   # and this server's packing builds, within a block (the blocks done stay)
        for job in self.jobs.jobs.values():
            for stream in list(job.streams.values()):
                stream.end(Unavailable(f"feeder in region {self.cfg.region} is shutting down; resume elsewhere"))

    def close(self) -> None:
        self.orders.stop()
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.planner.shutdown(wait=False, cancel_futures=True)
        for src in self.sources.values():
            src.close()
        if self.ledger:
            self.ledger.close()


def _cpu_s() -> float:
    t = os.times()
    return t.user + t.system


def _rank_status(r, region: str) -> RankStatus:
    epoch, done = r.position
    return RankStatus(rank=r.rank, connected=r.connected, epoch=epoch, samples_done=done,
                      samples_in_epoch=r.samples_in_epoch, batches_sent=r.batches_sent, bytes_sent=r.bytes_sent,
                      tokens_per_s=r.tokens_per_s, queue_depth=r.queue_depth, data_wait_fraction=r.data_wait_fraction,
                      last_error=r.last_error, peer=r.peer,
                      restarts=r.restarts,
                      failovers=r.failovers, tokens_sent=r.tokens_sent, bad_records=r.bad_records, region=region,
                      state=r.state, samples_sent=r.samples_done, reported=r.consumed is not None,
                      sent_epoch=r.epoch, members=member_status(r), window_builds=r.window_builds,
                      member_shared=r.member_shared, member_solo=r.member_solo, **r.feed)


def member_status(r) -> tuple[MemberStatus, ...]:
    """A model-parallel rank's open members, each with how far behind the furthest it is."""
    seen = [(key, m.position or (0, -1), m.joined) for key, m in sorted(r.members.items())]
    if not seen:
        return ()
    ahead = max(pos for _, pos, _ in seen)
    return tuple(MemberStatus(member=member, cp_rank=cp, epoch=pos[0], step=max(0, pos[1]), shared=joined,
                              behind=ahead[1] - pos[1] if pos[0] == ahead[0] else 0)
                 for (cp, member), pos, joined in seen)


# How long a new replica of a shrink job waits for the commit of the step before its first to be
# reported (the survivors report it as they go on: well under a step's time).
ELASTIC_COMMIT_WAIT_S = 60.0

# Threads that make plans (Source.plan may block: a Kafka epoch's snapshot is built once while
# its job's other ranks wait for it), apart from the batch threads so those never wait on it.
PLAN_THREADS = 4


def _started_pool(n: int, prefix: str) -> ThreadPoolExecutor:
    """A pool with all its threads started now: a feeder's thread count is then fixed from the
    start (tests/test_resources.py counts threads after stream storms; a lazily grown pool
    reads as a leak)."""
    pool = ThreadPoolExecutor(n, thread_name_prefix=prefix)
    barrier = threading.Barrier(n + 1)
    for _ in range(n):
        pool.submit(barrier.wait)
    barrier.wait()
    return pool


def _open_ledger(path: str):
    try:
        return open(path, "a", buffering=1)
    except OSError as e:   # a directory, a missing parent, no permission: the operator's to fix
        raise InvalidArgument(f"--ledger {path}: {e.strerror}; expected a file path this user can append to") from None

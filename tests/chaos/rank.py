"""One trainer rank, as a process of its own: FeederDataset through a torch DataLoader,
every consumed batch written as a JSON line (position, epoch, step, ids, a hash of its
tokens, the cursor in hex), a checkpoint marker every few batches.

The runner starts these from a forkserver whose only preload is this module (torch and the
client imported, no gRPC object made), so a rank costs a fork, not a Python start with torch.
The rank tells the runner when it reaches a fault's moment ("pause", position) and waits
for "go": the fault lands between two batches the rank has consumed, at a known position.
"""
from __future__ import annotations

import functools
import hashlib
import json
import logging
import multiprocessing as mp
import os
import sys
import time
import traceback
import warnings

import threading

import numpy as np
import torch  # noqa: F401  (preloaded by the forkserver: ranks and their workers fork with it)
from torch.utils.data import DataLoader

from feeder_client import FeederDataset
from feeder.core.errors import FeederError


def token_hash(tokens_int64: bytes) -> str:
    return hashlib.blake2b(tokens_int64, digest_size=8).hexdigest()


def _log_to(path: str, *_worker_id) -> None:
    """The client's log lines (failovers) into the rank's log file, from workers too; not on
    the runner's stderr."""
    logging.basicConfig(filename=path, level=logging.INFO, force=True,
                        format="%(asctime)s %(process)d %(name)s %(levelname)s %(message)s")


def _ends(msg: str) -> str:
    """A long message's head and tail (a DataLoader worker's error puts the feeder's words last)."""
    return msg if len(msg) <= 1200 else msg[:300] + " ... " + msg[-900:]


class Shadows:
    """A model-parallel rank's other members (issue 33), read in threads beside the main stream
    (member 0): members 1..M-1 of the rank, and with cp_size C > 1 its C context-parallel
    slices (each slot apart from the main's: member M of M + 1). Each reads the rank's stream
    from the main's start cursor, through the same faults. At the end every shadow batch the
    main also took must be the main's (members: the same ids and tokens; slices: reassembled to
    the main's tokens), and each member's steps must follow one another without a gap."""

    def __init__(self, cfg: dict, make):
        self.cfg, self.stop = cfg, threading.Event()
        self.got: dict = {}            # key -> [(epoch, step, ids, hash)] or, for a slice, {(e, s): (ids, in, lab)}
        self.errors: dict = {}
        self.sets: list = []
        m, c = cfg.get("members", 1), cfg.get("cp_size", 1)
        for k in range(1, m):
            self.sets.append((("m", k), make(member=k, members=m)))
        for r in range(c if c > 1 else 0):
            self.sets.append((("cp", r), make(member=m, members=m + 1, cp_rank=r, cp_size=c,
                                              cp_layout=cfg.get("cp_layout", "zigzag"))))
        self.threads = [threading.Thread(target=self._read, args=(key, ds), daemon=True) for key, ds in self.sets]
        for t in self.threads:
            t.start()

    def _read(self, key, ds) -> None:
        out = self.got.setdefault(key, [] if key[0] == "m" else {})
        try:
            for b in ds:
                if key[0] == "m":
                    out.append((b.epoch, b.step, b.sample_ids.tolist(), token_hash(b.tokens.numpy().tobytes())))
                else:
                    out[b.epoch, b.step] = (b.sample_ids.tolist(), b.input_ids.numpy(), b.labels.numpy())
                if self.stop.is_set():
                    return
        except FeederError as e:
            if not self.stop.is_set():
                self.errors[key] = f"{e.code.name}: {_ends(str(e))}"
        except Exception as e:  # noqa: BLE001
            if not self.stop.is_set():
                self.errors[key] = f"bug: {type(e).__name__}: {e}"

    def close(self) -> None:
        self.stop.set()
        for _, ds in self.sets:
            if ds.client is not None:
                ds.client.close()
        for t in self.threads:
            t.join(10)

    def verdict(self, main: dict) -> dict:
        """main: (epoch, step) -> (ids, hash) of the main stream's batches."""
        from feeder.core.context import positions

        bad, compared = [], 0
        for key, got in self.got.items():
            if key[0] == "m":
                for a, b in zip(got, got[1:]):
                    if not (b[:2] == (a[0], a[1] + 1) or (b[0] == a[0] + 1 and b[1] == 0)):
                        bad.append(f"member {key[1]}: batch (epoch {b[0]}, step {b[1]}) after ({a[0]}, {a[1]})")
                for e, st, ids, h in got:
                    if (e, st) in main:
                        compared += 1
                        if main[e, st] != (ids, h):
                            bad.append(f"member {key[1]}: batch (epoch {e}, step {st}) differs from member 0's")
        slices = {k[1]: v for k, v in self.got.items() if k[0] == "cp"}
        size, seq = len(slices), self.cfg["seq_len"]
        for (e, st) in set.intersection(*(set(v) for v in slices.values())) if slices else ():
            if (e, st) not in main:
                continue
            ids0 = slices[0][e, st][0]
            tokens = np.zeros((len(ids0), seq + 1), dtype=np.int64)
            for r, v in slices.items():
                ids, inp, lab = v[e, st]
                at = positions(seq, size, r, self.cfg.get("cp_layout", "zigzag"))
                tokens[:, at], tokens[:, at + 1] = inp, lab
                if ids != ids0:
                    bad.append(f"slice {r}: ids of (epoch {e}, step {st}) differ")
            compared += 1
            if (ids0, token_hash(tokens.tobytes())) != main[e, st]:
                bad.append(f"slices of (epoch {e}, step {st}) do not reassemble to member 0's batch")
        return {"members": "mismatch" if bad else "ok", "compared": compared, "bad": bad[:5],
                "errors": {f"{kind}{index}": err for (kind, index), err in self.errors.items()}}


def rank_main(cfg: dict, conn) -> None:
    """cfg: plain values only (see runner.RankPlan.config). Exit 0: the stream ended or the
    rank took what it was asked to; 3: a FeederError (its code is in the last line); 4: a bug."""
    # A process group of its own: the runner ends the rank with its DataLoader workers (and
    # their forkserver), which a SIGKILL of the rank alone would leave running.
    os.setpgrp()
    warnings.filterwarnings("ignore", message=".*worker processes in total.*")   # more workers than cores: meant
    out = open(cfg["out"], "w", buffering=1)
    _log_to(cfg["out"] + ".log")
    pos = cfg["start_pos"]
    try:
        def make(**kw):
            return FeederDataset(cfg["targets"], job=cfg["job"], rank=cfg["rank"], world_size=cfg["world"],
                                 seq_len=cfg["seq_len"], micro_batch=cfg["micro_batch"], seed=cfg["seed"],
                                 shuffle=cfg["shuffle"], drop_last=cfg["drop_last"], epoch=cfg["epoch"],
                                 num_epochs=cfg["num_epochs"],
                                 cursor=bytes.fromhex(cfg["cursor"]) if cfg["cursor"] else None,
                                 reshard=cfg["reshard"], compression=cfg["compression"],
                                 read_ahead=cfg["read_ahead"], idle_timeout_s=2.0, keepalive_s=5.0,
                                 retry_for_s=cfg["retry_for_s"], prefer="order", failback_s=cfg["failback_s"],
                                 report_every_s=1.0, pin_memory=False,
                                 mixture=None if cfg.get("schedule") else cfg["mixture"] or None,
                                 mixture_schedule=cfg.get("schedule") or None,
                                 permutation=cfg.get("permutation", "torch"),
                                 epoch_samples=cfg.get("epoch_samples", 0), packing=cfg.get("packing", "concat"),
                                 # slow, not dead (issue 45), at the scale of a scenario's seconds
                                 hedge=cfg.get("hedge", False), slow_window_s=1.0, slow_hold_s=2.0, **kw)

        members = cfg.get("members", 1)
        ds = make(**(dict(member=0, members=members) if members > 1 else {}))
        shadows = Shadows(cfg, make) if members > 1 or cfg.get("cp_size", 1) > 1 else None
        taken: dict = {}
        workers = cfg["workers"]
        if workers and cfg["context"] == "forkserver":
            # The workers' forkserver imports torch and the client once; each worker is then a
            # fork of it (no gRPC object there) instead of a fresh import of torch (~3 s of CPU).
            mp.get_context("forkserver").set_forkserver_preload(["torch", "feeder_client.dataset"])
        loader = DataLoader(ds, batch_size=None, num_workers=workers,
                            persistent_workers=cfg["persistent"] and workers > 0,
                            multiprocessing_context=mp.get_context(cfg["context"]) if workers else None,
                            worker_init_fn=functools.partial(_log_to, cfg["out"] + ".log") if workers else None)
        pauses, repasses = set(cfg["pauses"]), set(cfg["repasses"])
        stop_at = cfg["stop_at"]     # 0: until the stream ends
        step_s = cfg["step_ms"] / 1000
        last_cursor = cfg["cursor"]
        done = stop_at and pos >= stop_at
        while not done:
            passed = False
            for b in loader:
                pos += 1
                last_cursor = b.cursor.hex()
                line = {"p": pos, "e": b.epoch, "s": b.step, "ids": b.sample_ids.tolist(),
                        "h": token_hash(b.tokens.numpy().tobytes()), "c": last_cursor}
                if shadows is not None:
                    taken[b.epoch, b.step] = (line["ids"], line["h"])
                if b.sources is not None:
                    line["src"] = b.sources.tolist()
                out.write(json.dumps(line) + "\n")
                if pos % cfg["ckpt_every"] == 0:
                    out.write(json.dumps({"ckpt": pos, "c": last_cursor}) + "\n")
                if pos in pauses:
                    conn.send(("pause", pos))
                    conn.recv()
                if stop_at and pos >= stop_at:
                    out.write(json.dumps({"ckpt": pos, "c": last_cursor}) + "\n")
                    done = True
                    break
                if pos in repasses:
                    # A new pass over the same DataLoader: with workers it starts from the cursor
                    # the main process holds, so hand it the last one consumed (as a trainer does
                    # after load_state_dict); without workers it continues on its own.
                    if workers:
                        ds.load_state_dict({**ds.state_dict(), "cursor": bytes.fromhex(last_cursor)})
                    out.write(json.dumps({"repass": pos}) + "\n")
                    passed = True
                    break
                if step_s:
                    time.sleep(step_s)
            if not passed:
                break
        if shadows is not None:
            shadows.close()
            out.write(json.dumps(shadows.verdict(taken)) + "\n")
        out.write(json.dumps({"end": "ok", "p": pos}) + "\n")
        code = 0
    except FeederError as e:
        out.write(json.dumps({"end": "error", "code": e.code.name, "msg": _ends(str(e)), "p": pos}) + "\n")
        code = 3
    except BaseException as e:  # noqa: BLE001 - anything else is a bug the oracle must show
        out.write(json.dumps({"end": "bug", "code": type(e).__name__, "msg": traceback.format_exc()[-1500:],
                              "p": pos}) + "\n")
        code = 4
    out.close()
    sys.stdout.flush()
    sys.stderr.flush()
    # Without gRPC's and the DataLoader's interpreter-exit teardown (seconds, and the subject of
    # other tests): the streams end with the process's sockets, the workers with their parent.
    for child in mp.active_children():
        child.kill()
    os._exit(code)

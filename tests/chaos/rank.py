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
        ds = FeederDataset(cfg["targets"], job=cfg["job"], rank=cfg["rank"], world_size=cfg["world"],
                           seq_len=cfg["seq_len"], micro_batch=cfg["micro_batch"], seed=cfg["seed"],
                           shuffle=cfg["shuffle"], drop_last=cfg["drop_last"], epoch=cfg["epoch"],
                           num_epochs=cfg["num_epochs"],
                           cursor=bytes.fromhex(cfg["cursor"]) if cfg["cursor"] else None, reshard=cfg["reshard"],
                           compression=cfg["compression"],
                           read_ahead=cfg["read_ahead"], idle_timeout_s=2.0, keepalive_s=5.0,
                           retry_for_s=cfg["retry_for_s"], prefer="order", failback_s=cfg["failback_s"],
                           report_every_s=1.0, pin_memory=False, mixture=cfg["mixture"] or None,
                           permutation=cfg.get("permutation", "torch"), epoch_samples=cfg.get("epoch_samples", 0),
                           packing=cfg.get("packing", "concat"))
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

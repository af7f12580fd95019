"""The background scrub: a chunk's checksum is checked on its first read, and a memory-mapped
chunk is served from the map from then on, so a byte that changes on disk later (a bad disk, a
stray write, a replica rsync'ed over a running feeder) would be served without a word. The
scrub re-hashes the chunks already verified, at `--scrub-mb-s`, and a chunk found changed is
DATA_LOSS from then on (its shard is taken out of service; ranks fail over to a sound replica),
counted for metrics and `feeder status`.
"""
from __future__ import annotations

import logging
import threading

log = logging.getLogger("feeder.scrub")

# Rest between passes: a small dataset is not re-hashed in a tight loop.
REST_S = 1.0


class Scrubber:
    """One thread re-hashing the verified chunks of `sources` ({name: PosixSource}) at
    `mb_s` MB/s (10^6 bytes), pass after pass, until stop()."""

    def __init__(self, sources: dict, mb_s: float):
        self.sources, self.mb_s = dict(sources), mb_s
        self.scrubbed_bytes: dict[str, int] = {name: 0 for name in self.sources}
        self.changed: dict[str, int] = {name: 0 for name in self.sources}   # chunks found changed
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="feeder-scrub", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            for name, src in self.sources.items():
                for k in range(len(src.chunk_starts) - 1):
                    if self._stop.is_set():
                        return
                    self._one(name, src, k)
            self._stop.wait(REST_S)

    def _one(self, name: str, src, k: int) -> None:
        try:
            nbytes, why = src.rescrub(k)
        except Exception as e:   # a scrub must never take the feeder down; the read path reports it
            log.warning("scrub of dataset %s chunk %d failed: %r", name, k, e)
            return
        if why:
            self.changed[name] += 1
            log.error("scrub: dataset %s changed under the feeder: %s; it is DATA_LOSS from now on", name, why)
        if nbytes:
            self.scrubbed_bytes[name] += nbytes
            self._stop.wait(nbytes / (self.mb_s * 1e6))   # the pace: mb_s on average

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)

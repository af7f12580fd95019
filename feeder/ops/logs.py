"""Logging: one line per significant event, text or JSON."""
from __future__ import annotations

import json
import logging
import sys
import time


class JsonFormatter(logging.Formatter):
    def __init__(self, process: int | None = None):
        super().__init__()
        self.process = process

    def format(self, record: logging.LogRecord) -> str:
        out = {"ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
               "level": record.levelname.lower(), "logger": record.name, "msg": record.getMessage()}
        if self.process is not None:
            out["process"] = self.process
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out)


def setup(fmt: str = "text", level: str = "INFO", process: int | None = None) -> None:
    """process: which of `feeder serve --processes N` this is (its lines say so)."""
    handler = logging.StreamHandler(sys.stderr)
    tag = "" if process is None else f"[process {process}] "
    handler.setFormatter(JsonFormatter(process) if fmt == "json"
                         else logging.Formatter(f"%(asctime)s %(levelname)s {tag}%(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)

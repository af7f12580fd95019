"""Region files: `feeder serve --config deploy/regions/<name>.toml` describes one region's
feeder (name, listen address, dataset replica or Kafka URL, TLS, tokens, prefetch and
compression, peers). Flags given on the command line override the file.

Paths may use $VAR / ${VAR} (an unset variable is an error, not an empty string) and ~;
a relative path is relative to the file, so a directory of configs can travel as a unit.
"""
from __future__ import annotations

import os
import re

from feeder.core.config import load_toml
from feeder.core.errors import InvalidArgument

# [section] key -> ServeConfig field. "" is the top level.
LAYOUT: dict[str, dict[str, str]] = {
    "": {"region": "region", "listen": "listen", "source": "source", "peers": "peers",
         "insecure": "insecure", "cursor_secret_file": "cursor_secret_file", "grace_s": "grace_s",
         "log_format": "log_format", "ledger": "ledger", "vocab_size": "vocab_size", "eos_id": "eos_id",
         "processes": "processes", "scrub_mb_s": "scrub_mb_s", "cache_dir": "cache_dir"},
    "tls": {"cert": "tls_cert", "key": "tls_key", "client_ca": "tls_client_ca", "ca": "tls_ca"},
    "auth": {"tokens_file": "tokens_file"},
    "stream": {"prefetch_messages": "prefetch_messages", "prefetch_bytes": "prefetch_bytes",
               "member_window_bytes": "member_window_bytes",
               "message_bytes": "message_bytes", "compression": "default_compression",
               "compression_level": "default_level", "threads": "threads", "remote_rtt_ms": "remote_rtt_ms"},
    "metrics": {"listen": "metrics_listen"},
}
PATHS = {"source", "cursor_secret_file", "ledger", "tls_cert", "tls_key", "tls_client_ca", "tls_ca", "tokens_file",
         "cache_dir"}
_VAR = re.compile(r"\$(\w+)|\$\{(\w+)\}")


def _expand(value: str, where: str, base: str) -> str:
    def var(m):
        name = m.group(1) or m.group(2)
        if name not in os.environ:
            raise InvalidArgument(f"{where} uses ${name}, which is not set in the environment")
        return os.environ[name]

    value = os.path.expanduser(_VAR.sub(var, value))
    if value and "://" not in value and not os.path.isabs(value):
        value = os.path.normpath(os.path.join(base, value))
    return value


def load_region(path: str) -> dict:
    """The file's settings as ServeConfig keyword arguments (checked again by ServeConfig)."""
    data = load_toml(path)
    base = os.path.dirname(os.path.abspath(path))
    out: dict = {}
    for key, value in data.items():
        if isinstance(value, dict) and key in LAYOUT and key != "":
            section, items = key, value.items()
        else:
            section, items = "", [(key, value)]
        for k, v in items:
            fields = LAYOUT[section]
            where = f"{path}: {section + '.' if section else ''}{k}"
            if k not in fields:
                known = [f"{s + '.' if s else ''}{name}" for s, names in LAYOUT.items() for name in names]
                raise InvalidArgument(f"{where} is not a setting; expected one of {', '.join(known)}")
            field = fields[k]
            if field == "peers":
                if not isinstance(v, dict) or not all(isinstance(a, str) for a in v.values()):
                    raise InvalidArgument(f"{where} must be a table of region = \"HOST:PORT\"")
                v = tuple(sorted(v.items()))
            elif field in PATHS and isinstance(v, str):
                v = _expand(v, where, base)
            elif field == "source" and isinstance(v, list):   # NAME=DATASET each (config.named_sources)
                v = [f"{n}{sep}{_expand(d, where, base)}" if sep else _expand(n, where, base)
                     for n, sep, d in (str(x).partition("=") for x in v)]
            out[field] = v
    return out

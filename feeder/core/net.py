"""Address helpers (standard library only, so the trainer, the bench and the tests share them)."""
from __future__ import annotations

import ipaddress
import socket


def is_loopback(host: str) -> bool:
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def free_port() -> int:
    """A port nothing listens on right now (for a child process to bind)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

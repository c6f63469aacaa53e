"""A free TCP port: the one network helper every part of the course shares.

The tensor-parallel ranks' rendezvous (common/worker/tp_workers.py), a Ray
replica's server (common/entrypoints/ray_replicas.py) and every server the
bench and the tests start (bench/, tests/) ask the system for a port nobody
listens on, here.

Left out: holding the port until it is used. Another process may take it
between `free_port()` and the bind that follows, a race no caller here has
met on one machine.
"""
from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A port nobody listens on now, on `host` (this machine by default)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]

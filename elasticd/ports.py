"""Picking a TCP port for a job's torch.distributed rendezvous."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A port the OS says is free on `host` now (another process may still take it before use)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]

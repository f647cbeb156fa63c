"""Free loopback ports, without importing torch (the launcher picks DeepSpeed's port with this)."""

from __future__ import annotations

import socket


def free_local_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (the launcher's DeepSpeed port, tests, benchmarks)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_loopback_address() -> str:
    return f"tcp://127.0.0.1:{free_local_port()}"

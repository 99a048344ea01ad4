"""Ports for test and demo processes that nothing else on the machine will take.

`bind(("127.0.0.1", 0))` hands out a port from the kernel's ephemeral range, and
frees it at once: by the time an engine binds it, UCX, ZMQ or an HTTP client in
another engine that starts beside it may have been given the same port for its own
socket. vLLM's side-channel listener then fails to bind in its thread, and the
scheduler waits for it forever (seen in CI: an engine that never became ready).
Ports here come from below the ephemeral range, which the kernel never assigns by
itself, and are never handed out twice by one process.
"""

from __future__ import annotations

import os
import random
import socket
import threading

_lock = threading.Lock()
_given: set[int] = set()
_rng = random.Random(os.getpid() ^ int.from_bytes(os.urandom(4), "little"))


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A port free now, outside the ephemeral range, not handed out before here."""
    high = _ephemeral_low() - 1
    low = max(1024, high - 12000)
    with _lock:
        for _ in range(2000):
            port = _rng.randint(low, high)
            if port not in _given and _bindable(port):
                _given.add(port)
                return port
    raise RuntimeError(f"no free port in {low}-{high}")

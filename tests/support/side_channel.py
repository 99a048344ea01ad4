"""A ZMQ relay in front of a real engine's side channel, for tests that make the
side channel stall, hold or lie while the engine's own handshake checks still run."""

from __future__ import annotations

import threading
from typing import Any

import zmq

from harness.runner import free_port


class SideChannelRelay:
    """A ZMQ ROUTER on a port of its own; `_serve` (the subclass's) decides what to do
    with each request, `_forward` hands one to the engine behind it and returns the reply."""

    def __init__(self, upstream_port: int | None, forward_timeout_ms: int = 10_000):
        self.port = free_port()
        self.upstream_port = upstream_port
        self._forward_timeout_ms = forward_timeout_ms
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(f"tcp://127.0.0.1:{self.port}")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)

    def start(self) -> None:
        self._thread.start()

    @property
    def address(self) -> dict[str, Any]:
        return {"host": "127.0.0.1", "port": self.port}

    def _serve(self) -> None:
        raise NotImplementedError

    def _forward(self, msg: bytes) -> list[bytes]:
        sock = self._ctx.socket(zmq.REQ)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVTIMEO, self._forward_timeout_ms)
        try:
            sock.connect(f"tcp://127.0.0.1:{self.upstream_port}")
            sock.send(msg)
            return sock.recv_multipart()
        finally:
            sock.close(0)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._sock.close(0)
        self._ctx.term()

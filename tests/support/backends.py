"""OTLP/HTTP trace back-ends that hold every export attempt until the test releases them.

A back-end that fails at once cannot show that a push did not wait for it. These hold
every request, like a collector that is overloaded or gone behind a load balancer,
until the test calls `release()` (or the client gives up first), then answer (or drop
the connection) at once. The test releases only once every push it runs meanwhile has
landed, so a push that waited for an export would never land. Each attempt records when
it arrived and ended (`time.perf_counter`), and a test can see which were still held.
"""

from __future__ import annotations

import gzip
import select
import socket
import socketserver
import threading
import time
from dataclasses import dataclass

from opentelemetry.proto.collector.trace.v1 import trace_service_pb2

# What each mode does once released.
DROP = "drop"  # closes the connection without an answer (a back-end gone behind a proxy)
REFUSE = "refuse"  # answers 503 (an overloaded collector; the exporter retries it)
ACCEPT = "accept"  # answers 200 and keeps the spans (a slow but working back-end)
MODES = (DROP, REFUSE, ACCEPT)


@dataclass
class Attempt:
    """One export request: fully read at `began`; over at `ended`, `how`."""

    began: float
    ended: float | None = None
    how: str = ""  # answered | dropped | client_gone


class HeldBackend:
    """An OTLP/HTTP endpoint on 127.0.0.1:`port` that holds every request until `release()`."""

    def __init__(self, port: int, mode: str):
        if mode not in MODES:
            raise ValueError(f"mode {mode!r}: one of {MODES}")
        self.mode = mode
        self.lock = threading.Lock()
        self.attempts: list[Attempt] = []
        self.spans_kept = 0
        # Set once released; `_wake` becomes readable then and stays so (nothing reads it),
        # which wakes every held request and lets later ones through at once.
        self.released = threading.Event()
        self._wake, self._waker = socket.socketpair()
        backend = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                backend._serve(self.request)

        class Server(socketserver.ThreadingTCPServer):
            allow_reuse_address = True
            daemon_threads = True
            block_on_close = False

        self._server = Server(("127.0.0.1", port), Handler)
        self.endpoint = f"http://127.0.0.1:{port}/v1/traces"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def snapshot(self) -> list[Attempt]:
        with self.lock:
            return [Attempt(a.began, a.ended, a.how) for a in self.attempts]

    def all_ended(self) -> list[Attempt] | None:
        """Every attempt so far, once each one has ended (else None: poll it)."""
        attempts = self.snapshot()
        return attempts if attempts and all(a.ended is not None for a in attempts) else None

    def release(self) -> None:
        """End the hold: held requests are answered (or dropped) now, later ones at once."""
        if not self.released.is_set():
            self.released.set()
            self._waker.send(b"x")

    def close(self) -> None:
        self.release()
        self._server.shutdown()
        self._server.server_close()
        self._wake.close()
        self._waker.close()

    # ------------------------------------------------------------------ serving
    def _serve(self, sock: socket.socket) -> None:
        body = _read_request(sock)
        if body is None:
            return
        attempt = Attempt(began=time.perf_counter())
        with self.lock:
            self.attempts.append(attempt)
        how = "client_gone" if self._client_hangs_up(sock) else self._answer(sock, body)
        with self.lock:
            attempt.ended, attempt.how = time.perf_counter(), how

    def _client_hangs_up(self, sock: socket.socket) -> bool:
        """Hold the request until released; True as soon as the client closes its end
        first (its own timeout ended the attempt)."""
        try:
            while not self.released.is_set():
                readable, _, _ = select.select([sock, self._wake], [], [])
                if self._wake in readable:
                    return False
                try:
                    if sock.recv(1, socket.MSG_PEEK) == b"":
                        return True
                except OSError:
                    return True
                select.select([self._wake], [], [])  # (more data, not a hang-up: the hold goes on)
        except (OSError, ValueError):  # `_wake` closed: the back-end was released and closed
            pass
        return False

    def _answer(self, sock: socket.socket, body: bytes) -> str:
        try:
            if self.mode == DROP:
                sock.shutdown(socket.SHUT_RDWR)
                return "dropped"
            if self.mode == REFUSE:
                sock.sendall(b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\n"
                             b"Connection: close\r\n\r\n")
                return "answered"
            request = trace_service_pb2.ExportTraceServiceRequest()
            request.ParseFromString(body)
            kept = sum(len(ss.spans) for rs in request.resource_spans for ss in rs.scope_spans)
            reply = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
            sock.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/x-protobuf\r\n"
                         b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(reply), reply))
            with self.lock:
                self.spans_kept += kept
            return "answered"
        except OSError:  # the client went while we answered
            return "client_gone"


def _read_request(sock: socket.socket) -> bytes | None:
    """The body of one HTTP request (None if the client went first)."""
    sock.settimeout(30)
    data = b""
    try:
        while b"\r\n\r\n" not in data:
            chunk = sock.recv(65536)
            if not chunk:
                return None
            data += chunk
        head, _, body = data.partition(b"\r\n\r\n")
        headers = {k.strip().lower(): v.strip() for k, _, v in
                   (line.partition(b":") for line in head.split(b"\r\n")[1:])}
        length = int(headers.get(b"content-length", b"0"))
        while len(body) < length:
            chunk = sock.recv(65536)
            if not chunk:
                return None
            body += chunk
    except OSError:
        return None
    return gzip.decompress(body) if headers.get(b"content-encoding") == b"gzip" else body

"""Small real HTTP engines on loopback for router tests (uvicorn, real sockets).

They record what arrived and can be told to wait for the other leg, fail, answer 400,
hang until disconnected, or stream one event and hold the rest (`stream_wait`), or hold a whole
answer (`wait`).
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
from typing import Any

import uvicorn

from harness.poll import PollTimeout, wait_until

WAIT_S = 15.0


class Served:
    """A real uvicorn server for `app` on a loopback port, in a thread."""

    def __init__(self, app: Any):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="error", lifespan="auto"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        wait_until(lambda: self.server.started, "uvicorn start", WAIT_S, interval_s=0.01)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.sock.close()


class Journal:
    """What all engines saw, in order, shared by P and D engines of one test."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.events: list[tuple[str, str]] = []  # (event, engine name)
        self.requests: dict[str, list[dict[str, Any]]] = {}
        self.release = threading.Event()  # lets a `stream_wait` engine finish its stream

    def add(self, event: str, name: str, request: dict[str, Any] | None = None) -> None:
        with self.lock:
            self.events.append((event, name))
            if request is not None:
                self.requests.setdefault(name, []).append(request)

    def seen(self, event: str, prefix: str) -> int:
        with self.lock:
            return sum(1 for e, n in self.events if e == event and n.startswith(prefix))


class Engine:
    """An ASGI engine. mode: ok | fail | bad | hang | stream_wait (streams its first event, then
    the rest once the journal's `release` is set or the router hangs up) | wait (answers, not
    streamed, once `release` is set); `waits_for` names the other leg's prefix."""

    def __init__(self, name: str, journal: Journal, mode: str = "ok", waits_for: str = ""):
        self.name, self.journal, self.mode, self.waits_for = name, journal, mode, waits_for

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        self.journal.add("connect", self.name)
        raw = b""
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":  # cancelled before the body was sent
                self.journal.add("disconnect", self.name)
                return
            raw += msg.get("body", b"")
            if not msg.get("more_body"):
                break
        headers = {k.decode(): v.decode() for k, v in scope["headers"]}
        body = json.loads(raw)
        self.journal.add("arrive", self.name, {"body": body, "headers": headers})
        if self.mode == "hang":
            while (await receive())["type"] != "http.disconnect":
                pass
            self.journal.add("disconnect", self.name)
            return
        if self.waits_for:  # (polled off the event loop, which keeps serving meanwhile)
            try:
                await asyncio.to_thread(wait_until, lambda: self.journal.seen("arrive", self.waits_for),
                                        f"the {self.waits_for} leg to arrive", WAIT_S, 0.01)
            except PollTimeout:
                await self._json(send, 500, {"error": f"{self.waits_for} leg never arrived"})
                return
        if self.mode == "fail":
            await self._json(send, 500, {"error": "engine exploded"})
        elif self.mode == "bad":
            await self._json(send, 400, {"error": {"message": "prompt too long", "code": 400}})
        elif body.get("stream"):
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"text/event-stream")]})
            for i, tok in enumerate((11, 12, 13)):
                chunk = {"choices": [{"token_ids": [tok]}], "engine": self.name}
                await send({"type": "http.response.body", "body": f"data: {json.dumps(chunk)}\n\n".encode(),
                            "more_body": True})
                if i == 0 and self.mode == "stream_wait" and not await self._released(receive):
                    self.journal.add("disconnect", self.name)
                    return
            await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})
        else:
            if self.mode == "wait" and not await self._released(receive):
                self.journal.add("disconnect", self.name)
                return
            await self._json(send, 200, {"choices": [{"token_ids": [11, 12, 13]}], "engine": self.name})
        self.journal.add("answer", self.name)

    async def _released(self, receive: Any) -> bool:
        """True once the journal's `release` is set; False if the router hangs up first."""
        released = asyncio.ensure_future(asyncio.to_thread(self.journal.release.wait, WAIT_S))
        hangup = asyncio.ensure_future(receive())
        done, _ = await asyncio.wait({released, hangup}, return_when=asyncio.FIRST_COMPLETED)
        if released in done and released.result():
            hangup.cancel()
            return True
        return False

    @staticmethod
    async def _json(send: Any, status: int, obj: Any) -> None:
        data = json.dumps(obj).encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": data})


def closed_port_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"

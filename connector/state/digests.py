"""D: the KV digests prefill ranks sent, kept until the receive they belong to ends.

Written by vLLM's writer thread (the notification router hands it each digest
notification), read by the engine's main thread when the receive's KV has landed
(connector/glue/integrity.py). One lock; each method decides and returns. Bounded: a
peer could send digests for requests this decoder never registered, so past
`capacity` the oldest request's digests are dropped (counted: `dropped`).
"""

from __future__ import annotations

import threading
from typing import Any

DEFAULT_CAPACITY = 16384


class DigestInbox:
    def __init__(self, capacity: int = DEFAULT_CAPACITY):
        self._lock = threading.Lock()
        self._by_request: dict[str, dict[int, Any]] = {}
        self._capacity = capacity
        # Prefill engines that have sent a digest: a sampled receive from one of them that
        # gets none lost it (not a stock prefill). Bounded by the engines this D talks to.
        self._sending_engines: set[str] = set()
        self.dropped = 0

    def __len__(self) -> int:
        with self._lock:
            return len(self._by_request)

    def put(self, request_id: str, sender: int, digest: Any, engine_id: str | None = None) -> None:
        """Writer: what `sender` (a P rank of `engine_id`) sent for `request_id`; a second
        one from the same rank replaces the first."""
        with self._lock:
            if engine_id is not None:
                self._sending_engines.add(engine_id)
            kept = self._by_request.get(request_id)
            if kept is None:
                if len(self._by_request) >= self._capacity:
                    self._by_request.pop(next(iter(self._by_request)))
                    self.dropped += 1
                kept = self._by_request[request_id] = {}
            kept[sender] = digest

    def sends_digests(self, engine_id: str) -> bool:
        """Main: `engine_id` has sent digests (a fork prefill with verification on)."""
        with self._lock:
            return engine_id in self._sending_engines

    def forget_engine(self, engine_id: str) -> None:
        """A prefill engine forgotten (or restarted): it may come back as a stock one."""
        with self._lock:
            self._sending_engines.discard(engine_id)

    def take(self, request_id: str) -> list[Any]:
        """Main: every digest sent for `request_id`, removed (empty when none came)."""
        with self._lock:
            kept = self._by_request.pop(request_id, None)
        return [] if kept is None else list(kept.values())

    def forget(self, request_ids: Any) -> None:
        """Main: receives that ended unchecked (failed): their digests go."""
        with self._lock:
            for request_id in request_ids:
                self._by_request.pop(request_id, None)

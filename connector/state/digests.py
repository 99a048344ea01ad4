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
        self.dropped = 0

    def __len__(self) -> int:
        with self._lock:
            return len(self._by_request)

    def put(self, request_id: str, sender: int, digest: Any) -> None:
        """Writer: what `sender` (a P rank) sent for `request_id`; a second one from the
        same rank replaces the first."""
        with self._lock:
            kept = self._by_request.get(request_id)
            if kept is None:
                if len(self._by_request) >= self._capacity:
                    self._by_request.pop(next(iter(self._by_request)))
                    self.dropped += 1
                kept = self._by_request[request_id] = {}
            kept[sender] = digest

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

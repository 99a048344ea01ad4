"""D's scheduler decides which receives are checked: the ratio's draw, and more where a
fault is likely or was seen (`kv_verify_ratio` below 1).

One decision per request, made where the registration is staged, so every rank of the
decoder checks the same receives: a prefill answers the first PUSH_REG of a request it
matches for every decoder rank, so ranks that asked differently would wait for digests
that never come (or get ones they never check).

The rules, first match wins (the `reason` label of `vllm:nixl_push_kv_verify_total`):
- `escalated`: the request's prefill engine sent KV that mismatched within the last
  `kv_verify_escalate_s`; each new mismatch restarts the window;
- `new_peer`: among the first `kv_verify_new_peer_requests` requests to a prefill
  engine this decoder had not sent one to (or not within `peer_forget_after_s`, when
  the workers forget it), or after the workers saw it restart;
- `at_risk`: the request waited longer than a lease before its blocks were allocated,
  so its KV was kept on the prefill by heartbeats alone (lease renewal is where
  upstream and every fork have had defects that hand a block to another request);
- `sampled`: the ratio's draw (at ratio 1, every request).

State: engine ids this scheduler talks to, owned by the scheduler's thread (vLLM calls
the scheduler connector from one thread only): no lock. Bounded: an engine not heard
of within `forget_after_s` is dropped when the table grows past `MAX_ENGINES`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

from connector.integrity.policy import VerifyPolicy
from connector.vocabulary import KvVerifyReason

MAX_ENGINES = 1024


class Escalation:
    def __init__(self, policy: VerifyPolicy, *, lease_s: float, forget_after_s: float,
                 clock: Callable[[], float] = time.monotonic):
        self._policy = policy
        self._lease_s = lease_s
        self._forget_after_s = forget_after_s
        self._clock = clock
        self._last_request: dict[str, float] = {}  # prefill engine -> when it last got one
        self._fresh_left: dict[str, int] = {}  # prefill engine -> new-peer checks left
        self._escalated_until: dict[str, float] = {}

    def decide(self, request_id: str, engine_id: str, waited_s: float) -> KvVerifyReason | None:
        """Why the receive of `request_id` from `engine_id` is checked, or None; `waited_s`:
        how long it waited at D before its blocks were allocated."""
        policy = self._policy
        if not policy.enabled:
            return None
        now = self._clock()
        last = self._last_request.get(engine_id)
        if last is None or now - last > self._forget_after_s:
            self._prune(now)
            self._fresh_left[engine_id] = policy.new_peer_requests
        self._last_request[engine_id] = now
        fresh = self._fresh_left.get(engine_id, 0)
        if fresh:
            self._fresh_left[engine_id] = fresh - 1
        if policy.ratio >= 1.0:
            return KvVerifyReason.SAMPLED
        if self._escalated_until.get(engine_id, 0.0) > now:
            return KvVerifyReason.ESCALATED
        if fresh:
            return KvVerifyReason.NEW_PEER
        if waited_s > self._lease_s:
            return KvVerifyReason.AT_RISK
        return KvVerifyReason.SAMPLED if policy.sampled(request_id) else None

    def mismatched(self, engine_ids: Iterable[str]) -> None:
        """The workers found KV from these prefills that was not what they sent."""
        until = self._clock() + self._policy.escalate_s
        for engine_id in engine_ids:
            self._escalated_until[engine_id] = until

    def restarted(self, engine_ids: Iterable[str]) -> None:
        """The workers saw these prefills come back with a new agent: new peers again."""
        for engine_id in engine_ids:
            self._fresh_left[engine_id] = self._policy.new_peer_requests

    def _prune(self, now: float) -> None:
        if len(self._last_request) < MAX_ENGINES:
            return
        for engine_id, last in list(self._last_request.items()):
            if now - last > self._forget_after_s and self._escalated_until.get(engine_id, 0.0) <= now:
                del self._last_request[engine_id]
                self._fresh_left.pop(engine_id, None)
                self._escalated_until.pop(engine_id, None)

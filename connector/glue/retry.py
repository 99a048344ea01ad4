"""When a failed handshake is tried again.

Only transient failures are retried: the peer's side channel refused the connection
(`unreachable`, e.g. its engine is restarting) or accepted it and stayed silent past
the timeout (`timeout`, e.g. its engine process is busy). Everything else (hash or
engine-id mismatch, bad payload, NIXL errors) fails at once: trying again cannot help.
The budget keeps every retry inside vLLM's default 30 s KV lease, so a request that
would have failed on the first stall completes, and one that cannot completes its
failure well before the lease runs out.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from connector.vocabulary import ErrorType

TRANSIENT = frozenset({ErrorType.TIMEOUT, ErrorType.UNREACHABLE})


@dataclass(frozen=True)
class RetryPolicy:
    retries: int = 3  # attempts after the first
    backoff_s: float = 0.5  # first delay; doubles each time
    budget_s: float = 20.0  # no retry starts after this much time since submission

    @classmethod
    def from_extra_config(cls, get: Any) -> RetryPolicy:
        """From `kv_connector_extra_config` (`handshake_retries`, ..._backoff_s, ..._budget_s)."""
        policy = cls(
            retries=int(get("handshake_retries", cls.retries)),
            backoff_s=float(get("handshake_retry_backoff_s", cls.backoff_s)),
            budget_s=float(get("handshake_retry_budget_s", cls.budget_s)),
        )
        if policy.retries < 0 or policy.backoff_s < 0 or policy.budget_s < 0:
            raise ValueError(f"handshake retry settings must be >= 0, got {policy}")
        return policy

    def delay(self, attempt: int, error_type: ErrorType | None, deadline: float) -> float | None:
        """Seconds until the next attempt after failed attempt `attempt`, or None: give up."""
        if error_type not in TRANSIENT or attempt > self.retries:
            return None
        delay = self.backoff_s * (2 ** (attempt - 1))
        if time.monotonic() + delay > deadline:
            return None
        return delay

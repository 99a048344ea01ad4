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

from connector import settings
from connector.vocabulary import ErrorType

TRANSIENT = frozenset({ErrorType.TIMEOUT, ErrorType.UNREACHABLE})


@dataclass(frozen=True)
class RetryPolicy:
    retries: int = settings.HANDSHAKE_RETRIES.default  # attempts after the first
    backoff_s: float = settings.HANDSHAKE_RETRY_BACKOFF_S.default  # first delay; doubles each time
    budget_s: float = settings.HANDSHAKE_RETRY_BUDGET_S.default  # no retry starts later than this

    @classmethod
    def from_extra_config(cls, get: Any) -> RetryPolicy:
        """From `kv_connector_extra_config` (`handshake_retries`, ..._backoff_s, ..._budget_s)."""
        policy = cls(
            retries=int(settings.read(get, settings.HANDSHAKE_RETRIES)),
            backoff_s=float(settings.read(get, settings.HANDSHAKE_RETRY_BACKOFF_S)),
            budget_s=float(settings.read(get, settings.HANDSHAKE_RETRY_BUDGET_S)),
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

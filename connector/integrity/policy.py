"""Which receives are checked, and what a mismatch does (`kv_connector_extra_config`).

- `kv_verify_ratio`: 0 off, 1 every request (the default), in between that share of
  requests. The draw is a hash of the request's base id (the transfer id P and D both
  know), so a run can be replayed and every rank of a decoder draws alike. The decoder
  decides and asks in its PUSH_REG; a prefill answers any ask unless its own ratio is 0.
- Below 1, D's scheduler checks more where a fault is likely or was seen
  (connector/integrity/escalation.py): `kv_verify_escalate_s` after a mismatch from a
  prefill, the first `kv_verify_new_peer_requests` after a new or restarted prefill,
  and receives whose KV was held by heartbeats alone.
- `kv_verify_action`: `fail` (a mismatched receive fails; `kv_load_failure_policy`
  decides: `recompute` recomputes, the client gets the right answer) or `observe`
  (counted, logged at ERROR, decoded anyway).

Every value is checked when the engine starts: a bad one stops it with a message naming
the key.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

from vllm.distributed.kv_transfer.kv_connector.v1.nixl.utils import get_base_request_id

from connector import settings
from connector.vocabulary import KvVerifyAction

_SPAN = float(1 << 64)


def _number(get: settings.Getter, setting: settings.Setting, what: str) -> float:
    raw = settings.read(get, setting)
    try:
        value = float(raw)
    except (TypeError, ValueError):
        raise ValueError(f"{setting.key} must be {what}, got {raw!r}") from None
    if isinstance(raw, bool) or not math.isfinite(value):
        raise ValueError(f"{setting.key} must be {what}, got {raw!r}")
    return value


@dataclass(frozen=True)
class VerifyPolicy:
    ratio: float
    action: KvVerifyAction
    escalate_s: float = float(settings.KV_VERIFY_ESCALATE_S.default)
    new_peer_requests: int = settings.KV_VERIFY_NEW_PEER_REQUESTS.default

    @classmethod
    def from_config(cls, get: settings.Getter) -> VerifyPolicy:
        """The policy the extra config sets; a clear error for a value outside its range."""
        ratio = _number(get, settings.KV_VERIFY_RATIO, "a number from 0 to 1")
        if not 0.0 <= ratio <= 1.0:
            raise ValueError(f"kv_verify_ratio must be from 0 to 1, got {ratio}")
        raw_action = str(settings.read(get, settings.KV_VERIFY_ACTION)).lower()
        try:
            action = KvVerifyAction(raw_action)
        except ValueError:
            raise ValueError(f"kv_verify_action must be one of {[a.value for a in KvVerifyAction]}, "
                             f"got {raw_action!r}") from None
        escalate_s = _number(get, settings.KV_VERIFY_ESCALATE_S, "a number of seconds, 0 or more")
        if escalate_s < 0:
            raise ValueError(f"kv_verify_escalate_s must be 0 or more seconds, got {escalate_s}")
        count = _number(get, settings.KV_VERIFY_NEW_PEER_REQUESTS, "a whole number, 0 or more")
        if count < 0 or count != int(count):
            raise ValueError(f"kv_verify_new_peer_requests must be a whole number, 0 or more, "
                             f"got {settings.read(get, settings.KV_VERIFY_NEW_PEER_REQUESTS)!r}")
        return cls(ratio, action, escalate_s, int(count))

    @property
    def enabled(self) -> bool:
        return self.ratio > 0.0

    def sampled(self, request_id: str) -> bool:
        """Whether the ratio draws the receive of `request_id` (the same on every rank)."""
        if self.ratio >= 1.0:
            return True
        if self.ratio <= 0.0:
            return False
        return sample_point(request_id) < self.ratio


def sample_point(request_id: str) -> float:
    """Where a request falls in [0, 1): a hash of its base id."""
    h = hashlib.blake2b(get_base_request_id(request_id).encode(), digest_size=8).digest()
    return int.from_bytes(h, "big") / _SPAN


"""Which receives are checked, and what a mismatch does (`kv_connector_extra_config`).

- `kv_verify_ratio`: 0 off, 1 every request, in between that share of requests. The
  choice is a hash of the request's base id (the transfer id P and D both know), so a
  run can be replayed and every rank of a decoder picks the same requests. The decoder
  decides and asks in its PUSH_REG; a prefill answers any ask unless its own ratio is 0.
- `kv_verify_action`: `fail` (a mismatched receive fails; `kv_load_failure_policy`
  decides: `recompute` recomputes, the client gets the right answer) or `observe`
  (counted, logged at ERROR, decoded anyway).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from vllm.distributed.kv_transfer.kv_connector.v1.nixl.utils import get_base_request_id

from connector.glue import settings
from connector.vocabulary import KvVerifyAction

_SPAN = float(1 << 64)


@dataclass(frozen=True)
class VerifyPolicy:
    ratio: float
    action: KvVerifyAction

    @classmethod
    def from_config(cls, get: settings.Getter) -> VerifyPolicy:
        """The policy the extra config sets; a clear error for a value outside the range."""
        raw_ratio = settings.read(get, settings.KV_VERIFY_RATIO)
        try:
            ratio = float(raw_ratio)
        except (TypeError, ValueError):
            raise ValueError(f"kv_verify_ratio must be a number from 0 to 1, got {raw_ratio!r}") from None
        if not 0.0 <= ratio <= 1.0:
            raise ValueError(f"kv_verify_ratio must be from 0 to 1, got {ratio}")
        raw_action = str(settings.read(get, settings.KV_VERIFY_ACTION)).lower()
        try:
            action = KvVerifyAction(raw_action)
        except ValueError:
            raise ValueError(f"kv_verify_action must be one of {[a.value for a in KvVerifyAction]}, "
                             f"got {raw_action!r}") from None
        return cls(ratio, action)

    @property
    def enabled(self) -> bool:
        return self.ratio > 0.0

    def sampled(self, request_id: str) -> bool:
        """Whether the receive of `request_id` is checked (the same answer on every rank)."""
        if self.ratio >= 1.0:
            return True
        if self.ratio <= 0.0:
            return False
        return sample_point(request_id) < self.ratio


def sample_point(request_id: str) -> float:
    """Where a request falls in [0, 1): a hash of its base id."""
    h = hashlib.blake2b(get_base_request_id(request_id).encode(), digest_size=8).digest()
    return int.from_bytes(h, "big") / _SPAN

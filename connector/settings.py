"""Every key of `kv_connector_extra_config` the fork reads, with its default, in one place.

The flows read their settings through `read`; the README's configuration table is
checked against `SETTINGS` (tests/test_docs_match_code.py), so a key cannot be added,
renamed or given another default without the table following.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

Getter = Callable[..., Any]  # vLLM's `kv_transfer_config.get_from_extra_config(key, default)`


@dataclass(frozen=True)
class Setting:
    key: str
    default: Any  # None: unset, or derived from other settings (`derived` says how)
    derived: str = ""  # the README's words for a default that follows from another setting
    vllms: bool = False  # vLLM reads it too, with the same default


KV_LEASE_DURATION = Setting("kv_lease_duration", 30, vllms=True)
HANDSHAKE_TIMEOUT_MS = Setting("handshake_timeout_ms", 5000)
HANDSHAKE_RETRIES = Setting("handshake_retries", 3)
HANDSHAKE_RETRY_BACKOFF_S = Setting("handshake_retry_backoff_s", 0.5)
HANDSHAKE_RETRY_BUDGET_S = Setting("handshake_retry_budget_s", 20)
HANDSHAKE_CONCURRENCY = Setting("handshake_concurrency", 16)
EARLY_P_TO_D_HANDSHAKE = Setting("early_p_to_d_handshake", True)
UNMATCHED_PUSH_REG_TIMEOUT_S = Setting("unmatched_push_reg_timeout_s", None, derived="the lease")
PUSH_WRITE_TIMEOUT_S = Setting("push_write_timeout_s", 30)
PUSH_LEASE_MARGIN_S = Setting("push_lease_margin_s", 2)
PUSH_REG_RESEND_S = Setting("push_reg_resend_s", None, derived="half the lease, at least 1")
PEER_FORGET_AFTER_S = Setting("peer_forget_after_s", 600)
PUSH_REGISTRATION_TIMEOUT = Setting("push_registration_timeout", None,
                                    derived="`decoder_kv_blocks_ttl`, else 480", vllms=True)
KV_TRANSFER_CPU_AFFINITY = Setting("kv_transfer_cpu_affinity", "contain")
NIXL_PROGRESS_DELAY_US = Setting("nixl_progress_delay_us", None, derived="unset")
KV_VERIFY_RATIO = Setting("kv_verify_ratio", 1.0)
KV_VERIFY_ACTION = Setting("kv_verify_action", "fail")
KV_VERIFY_ESCALATE_S = Setting("kv_verify_escalate_s", 600)
KV_VERIFY_NEW_PEER_REQUESTS = Setting("kv_verify_new_peer_requests", 16)
SIDE_CHANNEL_SECRET_FILE = Setting("side_channel_secret_file", None, derived="unset")
SIDE_CHANNEL_SECRET_PREVIOUS_S = Setting("side_channel_secret_previous_s", 300)

SETTINGS: tuple[Setting, ...] = (
    HANDSHAKE_TIMEOUT_MS, HANDSHAKE_RETRIES, HANDSHAKE_RETRY_BACKOFF_S, HANDSHAKE_RETRY_BUDGET_S,
    HANDSHAKE_CONCURRENCY, EARLY_P_TO_D_HANDSHAKE, UNMATCHED_PUSH_REG_TIMEOUT_S, KV_LEASE_DURATION,
    PUSH_WRITE_TIMEOUT_S, PUSH_LEASE_MARGIN_S, PUSH_REG_RESEND_S, PEER_FORGET_AFTER_S,
    PUSH_REGISTRATION_TIMEOUT, KV_TRANSFER_CPU_AFFINITY, NIXL_PROGRESS_DELAY_US, KV_VERIFY_RATIO,
    KV_VERIFY_ACTION, KV_VERIFY_ESCALATE_S, KV_VERIFY_NEW_PEER_REQUESTS, SIDE_CHANNEL_SECRET_FILE,
    SIDE_CHANNEL_SECRET_PREVIOUS_S,
)


def read(get: Getter, setting: Setting) -> Any:
    """The value of `setting` in the extra config, or its default (derived ones: see
    the functions below, which the flows use for them)."""
    return get(setting.key, setting.default)


def lease_s(get: Getter) -> float:
    return float(read(get, KV_LEASE_DURATION))


def unmatched_push_reg_timeout_s(get: Getter) -> float:
    return float(get(UNMATCHED_PUSH_REG_TIMEOUT_S.key, lease_s(get)))


def push_reg_resend_s(get: Getter) -> float:
    return float(get(PUSH_REG_RESEND_S.key, max(1.0, lease_s(get) / 2)))


def registration_timeout_s(get: Getter) -> float:
    return float(get(PUSH_REGISTRATION_TIMEOUT.key, get("decoder_kv_blocks_ttl", 480.0)))


def hold_bound_s(lease: float, write_timeout: float, margin: float) -> float:
    """How long after a decoder last asked for its KV a WRITE may still land in its
    blocks: P posts none later than a lease after that ask, and aborts any older than
    the WRITE timeout; two margins cover clock offsets and engine steps."""
    return lease + write_timeout + 2 * margin


def default_hold_bound_s() -> float:
    return hold_bound_s(KV_LEASE_DURATION.default, PUSH_WRITE_TIMEOUT_S.default,
                        PUSH_LEASE_MARGIN_S.default)

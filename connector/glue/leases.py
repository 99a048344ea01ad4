"""KV leases: P holds a finished prefill's blocks for its decoder until pushed or expired.

P grants a lease (`kv_lease_duration`, 30 s) when a prefill finishes; D's scheduler
sends heartbeats (`HB:` NIXL notifications, every `kv_lease_duration // 6` s) naming
the requests it still waits for, and each heartbeat extends their leases
(`kv_lease_duration * 2 // 3`). Upstream, in push mode, no heartbeat ever renews a
lease: D names a request by the router's id (`remote_request_id`), P keys its leases
by its own internal id, which carries vLLM's per-engine suffix, and vLLM's
`_handle_heartbeat` looks for an exact match. A request that waits in D's queue
longer than the lease loses its KV.

Here (main thread only, like vLLM's lease code):
- `_handle_heartbeat` is ours. A heartbeat id matches a lease by P's internal id, by
  base request id (the way PUSH_REGs match: a fork decoder's heartbeats carry its own
  internal ids, see scheduler.py), or by the id the router sent (a stock decoder's
  heartbeats): vLLM's OpenAI server derives P's id from the same `X-Request-Id`
  (`cmpl-<id>-<n>`, `chatcmpl-<id>`). Each id is counted by what it matched;
- vLLM's reaper (`_reap_expired_send_leases`, which scans every lease in 0.32 and
  0.33) runs unchanged; around it we count each expiry with what P knew of the
  request (its fate) and whether it was freed later than due;
- the leases held and the oldest one's age go to a gauge; a request's renewals and
  its expiry become events on its write span;
- D side: every heartbeat notification sent (or failed) is counted.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Iterable
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.nixl.utils import get_base_request_id

from connector.glue.flow import Flow
from connector.glue.wire import heartbeat_ids
from connector.telemetry import errors
from connector.telemetry.span_table import MAX_TRACKED_REQUESTS, BoundedIdSet
from connector.vocabulary import Attr, LeaseFate, LeaseRenewal, SpanEvent, TelemetryError

logger = logging.getLogger(__name__)

# How often the lease gauges are refreshed while leases are held (seconds).
LEASE_REPORT_INTERVAL_S = 1.0
# Renewal times kept per request for its write span's events.
MAX_RENEWALS_KEPT = 32


class LeaseFlow(Flow):
    """Mixin for `NixlPushConnectorWorker`: P's KV leases and D's heartbeats."""

    def _init_leases(self) -> None:
        # P request id -> when its lease was granted (monotonic), in grant order.
        self._lease_granted: dict[str, float] = {}
        # P request id -> wall-clock ns of each renewal (for span events).
        self._lease_renewed_at: dict[str, list[int]] = {}
        # P request id -> what a decoder said of it: WAITING (heartbeat) or REGISTERED.
        self._lease_claims: dict[str, LeaseFate] = {}
        # P request id -> its fate, from its expiry until its write span ends (tracing on).
        self._expired_fates: dict[str, LeaseFate] = {}
        # Base ids of leases that ended (pushed or released): "already done".
        self._ended_lease_bases = BoundedIdSet()
        self._last_reap = time.perf_counter()
        self._leases_reported_at = 0.0
        self._leases_report_owed = False

    # ---------------------------------------------------------------- granted
    def _note_leases_granted(self, reqs_to_send: dict[str, float]) -> None:
        """After vLLM's `start_load_kv`: the leases it started this step."""
        now = time.monotonic()
        held = self._reqs_to_send
        for req_id in reqs_to_send:
            if req_id in held and req_id not in self._lease_granted:
                self._lease_granted[req_id] = now
                self._leases_report_owed = True
        while len(self._lease_granted) > MAX_TRACKED_REQUESTS:
            self._forget_lease(next(iter(self._lease_granted)))

    def _note_lease_registered(self, p_request_id: str) -> None:
        """P's writer: a decoder's PUSH_REG matched this request (a dict store)."""
        self._lease_claims[p_request_id] = LeaseFate.REGISTERED

    # ---------------------------------------------------------------- renewed
    def _handle_heartbeat(self, payload: str) -> None:
        """vLLM's lease renewal, in our words: ids matched by base request id.

        (vLLM's own looks each id up exactly; push-mode heartbeats carry the router's
        id, never P's internal one, so nothing was ever renewed. No seam exists for
        the lookup, so the method is ours; the guard pins vLLM's source.)
        """
        held = self._reqs_to_send
        extension = float(self._lease_extension)
        new_expiry = time.perf_counter() + extension
        stamp = time.time_ns()
        leases: dict[str, list[str]] | None = None
        prefilling: dict[str, list[str]] | None = None
        outcomes: dict[str, int] = {}
        for hb_id in heartbeat_ids(payload):
            if hb_id in held:
                targets = [hb_id]
            else:
                if leases is None:
                    leases = index_request_ids(held)
                targets = lookup(leases, hb_id)
            if targets:
                for req_id in targets:
                    held[req_id] = max(held[req_id], new_expiry)
                    self._note_renewal(req_id, stamp)
                outcome = LeaseRenewal.RENEWED
            else:
                if prefilling is None:
                    prefilling = index_request_ids(self._reqs_to_process)
                if lookup(prefilling, hb_id):
                    outcome = LeaseRenewal.PREFILLING
                elif any(key in self._ended_lease_bases for key in match_keys(hb_id)):
                    outcome = LeaseRenewal.ALREADY_DONE
                else:
                    outcome = LeaseRenewal.UNKNOWN_REQUEST
            outcomes[outcome.value] = outcomes.get(outcome.value, 0) + 1
        if outcomes:
            logger.debug("heartbeat (%d ids): %s; leases extended by %.0f s", sum(outcomes.values()),
                         outcomes, extension)
            try:
                self.xfer_stats.record_lease_renewals(outcomes)
            except Exception as exc:
                errors.note(TelemetryError.STATS, exc)

    def _note_renewal(self, req_id: str, stamp_ns: int) -> None:
        if self._lease_claims.get(req_id) is not LeaseFate.REGISTERED:
            self._lease_claims[req_id] = LeaseFate.WAITING
        times = self._lease_renewed_at.setdefault(req_id, [])
        if len(times) < MAX_RENEWALS_KEPT:
            times.append(stamp_ns)

    # ---------------------------------------------------------------- expired
    def _reap_expired_send_leases(self, done_sending: set[str]) -> None:
        if not self._reqs_to_send:
            self._last_reap = time.perf_counter()
            return super()._reap_expired_send_leases(done_sending)
        before = dict(self._reqs_to_send)
        previous_pass = self._last_reap
        super()._reap_expired_send_leases(done_sending)
        self._last_reap = time.perf_counter()
        if len(before) == len(self._reqs_to_send):  # the usual step: nothing expired
            return
        try:
            for req_id, expiry in before.items():
                if req_id not in self._reqs_to_send and req_id in done_sending:
                    self._note_expired(req_id, late=expiry < previous_pass)
        except Exception as exc:
            errors.note(TelemetryError.STATS, exc)

    def _note_expired(self, req_id: str, late: bool) -> None:
        fate = self._lease_fate(req_id)
        granted = self._lease_granted.get(req_id)
        age = time.monotonic() - granted if granted is not None else None
        logger.warning("KV lease of request %s expired before its push (%s%s%s); its blocks are "
                       "released", req_id, fate.value,
                       f", held {age:.1f} s" if age is not None else "",
                       ", released later than due" if late else "")
        self.xfer_stats.record_lease_expiry(fate.value, late)
        if self._spans.enabled:
            self._expired_fates[req_id] = fate

    def _lease_fate(self, req_id: str) -> LeaseFate:
        with self._push_lock:
            failed = req_id in self._push_failed
        if failed:
            return LeaseFate.PUSH_FAILED
        return self._lease_claims.get(req_id, LeaseFate.UNCLAIMED)

    # ------------------------------------------------------------------ ended
    def _leases_ended(self, req_ids: Iterable[str]) -> None:
        """Main thread, from the step's finished_sending: pushed or released."""
        for req_id in req_ids:
            if self._forget_lease(req_id):
                for key in request_keys(req_id)[1:]:
                    self._ended_lease_bases.add(key)
                self._leases_report_owed = True

    def _forget_lease(self, req_id: str) -> bool:
        granted = self._lease_granted.pop(req_id, None)
        self._lease_renewed_at.pop(req_id, None)
        self._lease_claims.pop(req_id, None)
        self._expired_fates.pop(req_id, None)
        return granted is not None

    def _lease_events(self, req_id: str, span: Any) -> None:
        """Put the request's lease history on its write span (before it ends)."""
        renewed = self._lease_renewed_at.get(req_id) or ()
        fate = self._expired_fates.get(req_id)
        if not renewed and fate is None:
            return
        try:
            if not span.is_recording():
                return
            span.set_attribute(Attr.LEASE_RENEWALS, len(renewed))
            for stamp in renewed:
                span.add_event(SpanEvent.LEASE_RENEWED,
                               {Attr.LEASE_REMAINING: float(self._lease_extension)}, timestamp=stamp)
            if fate is not None:
                span.add_event(SpanEvent.LEASE_EXPIRED, {Attr.LEASE_FATE: fate.value})
        except Exception as exc:
            errors.note(TelemetryError.SPAN, exc)

    def _report_leases(self) -> None:
        """The gauges' snapshot, at most once a second while leases are held, and once
        when the last one ends (so the gauge returns to 0)."""
        now = time.monotonic()
        if not self._leases_report_owed and now - self._leases_reported_at < LEASE_REPORT_INTERVAL_S:
            return
        held = len(self._reqs_to_send)
        oldest = now - next(iter(self._lease_granted.values())) if self._lease_granted else 0.0
        self.xfer_stats.set_leases(held, oldest)
        self._leases_reported_at = now
        self._leases_report_owed = False

    # ------------------------------------------------------------ D: heartbeats
    def _count_heartbeat(self, ok: bool) -> None:
        try:
            self.xfer_stats.record_heartbeat(ok)
        except Exception as exc:
            errors.note(TelemetryError.STATS, exc)


# The ids vLLM's OpenAI server gives a request from its `X-Request-Id` (before the
# engine adds its `-<8 hex>` suffix): completions `cmpl-<id>-<prompt index>`, chat
# `chatcmpl-<id>`.
_ROUTER_ID = (re.compile(r"cmpl-(.+)-\d+"), re.compile(r"chatcmpl-(.+)"))


def request_keys(req_id: str) -> tuple[str, ...]:
    """The keys one of P's request ids is known by: itself, its base id, and the id
    the router sent when vLLM's OpenAI server derived the base from it."""
    base = get_base_request_id(req_id)
    keys = [req_id, base] if base != req_id else [req_id]
    for pattern in _ROUTER_ID:
        match = pattern.fullmatch(base)
        if match:
            keys.append(match[1])
            break
    return tuple(keys)


def match_keys(hb_id: str) -> tuple[str, ...]:
    """The keys a heartbeat id may name a request by: itself and its base id."""
    base = get_base_request_id(hb_id)
    return (hb_id, base) if base != hb_id else (hb_id,)


def index_request_ids(req_ids: Iterable[str]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for req_id in req_ids:
        for key in request_keys(req_id):
            out.setdefault(key, []).append(req_id)
    return out


def lookup(index: dict[str, list[str]], hb_id: str) -> list[str]:
    """P's requests a heartbeat id names (none, one, or more if ids were reused)."""
    for key in match_keys(hb_id):
        found = index.get(key)
        if found:
            return list(dict.fromkeys(found))
    return []

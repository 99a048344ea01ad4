"""KV leases: P holds a finished prefill's blocks for its decoder until pushed or expired.

P grants a lease (`kv_lease_duration`, 30 s) when a prefill finishes; D's scheduler
sends heartbeats (`HB:` NIXL notifications, every `kv_lease_duration // 6` s) naming
the requests it still waits for, and each heartbeat extends their leases
(`kv_lease_duration * 2 // 3`). Upstream, in push mode, no heartbeat ever renews a
lease: D names a request by the router's id, P keys its leases by its own internal
id (with vLLM's per-engine suffix), and vLLM's `_handle_heartbeat` looks for an exact
match. A request that waits in D's queue longer than the lease loses its KV.

Here the lease ledger (connector/state/leases.py) owns every lease:
- P grants each lease in the ledger before vLLM hands its blocks to the writer, and
  takes vLLM's exact deadline after;
- heartbeats are applied by the writer thread the moment it reads them (not one
  engine step later on the main thread): a heartbeat id matches by P's internal id,
  base id (a fork decoder names its own request) or router id (a stock decoder);
- vLLM's reaper (`_reap_expired_send_leases`, main thread) releases exactly the
  leases the ledger says are released (claimed leases never, until their WRITE
  settled), looking at those only. Each expiry is counted with what P knew of the
  request (its fate);
- D side: `_send_heartbeats`, in our words (vLLM's swallows a failed send, so a dead
  peer went unnoticed, and drops a heartbeat whose engine's handshake is pending): the
  heartbeats leave out receives this worker gave up, carry when they were sent, a send
  that fails marks the peer suspect, and one kept while its engine's handshake was
  pending is sent once that handshake is done.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Iterable
from typing import Any

from connector.glue.flow import Flow
from connector.glue.wire import HEARTBEAT_PREFIX, parse_heartbeat, sent_at_token
from connector.telemetry import errors
from connector.telemetry.tracing import span_ids
from connector.vocabulary import (
    METADATA_DIGEST_ATTR,
    Attr,
    PeerReset,
    SpanEvent,
    TelemetryError,
    Trigger,
)

logger = logging.getLogger(__name__)

# How often the lease gauges are refreshed while leases are held (seconds).
LEASE_REPORT_INTERVAL_S = 1.0
# How often leases vLLM holds that the ledger does not know are looked for (seconds).
UNKNOWN_LEASES_CHECK_S = 1.0
_RELEASE_NOW = float("-inf")


class LeaseFlow(Flow):
    """Mixin for `NixlPushConnectorWorker`: P's KV leases and D's heartbeats."""

    def _init_leases(self) -> None:
        self._leases_reported_at = 0.0
        self._reaped_unknown_at = 0.0
        self._leases_report_owed = False
        # D: heartbeats vLLM dropped while their engine's handshake was pending.
        self._owed_heartbeats: dict[str, Any] = {}

    # ---------------------------------------------------------------- granted
    def _grant_ahead(self, metadata: Any) -> list[str]:
        """Before vLLM's `start_load_kv`: the leases it is about to start (it keeps a
        lease for a request in this step's batch or an earlier one), with deadlines
        rebased onto this worker's clock the way vLLM rebases them."""
        leases = self._leases
        if metadata.reqs_in_batch or metadata.reqs_not_processed:
            leases.note_batch(metadata.reqs_in_batch, metadata.reqs_not_processed)
        if not metadata.reqs_to_send:
            return []
        now = time.perf_counter()
        clock = metadata.scheduler_clock
        in_batch, dropped = self._reqs_to_process, metadata.reqs_not_processed
        deadlines = {
            req_id: (now + (expiry - clock)) if clock else expiry
            for req_id, expiry in metadata.reqs_to_send.items()
            if (req_id in in_batch or req_id in metadata.reqs_in_batch) and req_id not in dropped}
        leases.grant(deadlines, getattr(metadata, METADATA_DIGEST_ATTR, None), time.monotonic(),
                     now)
        return list(deadlines)

    def _note_leases_granted(self, granted: list[str]) -> None:
        """After vLLM's `start_load_kv`: its exact deadlines (or none: not started)."""
        held = self._reqs_to_send
        self._leases.reconcile(granted, {r: held[r] for r in granted if r in held})
        self._leases_report_owed = True

    # ---------------------------------------------------------------- renewed
    def _renew_from(self, agent: Any, message: bytes) -> None:
        """Writer: a decoder's heartbeat, applied at once."""
        ids, sent_at = parse_heartbeat(message)
        outcomes, renewed = self._leases.renew(ids, sent_at, time.perf_counter(), time.time_ns())
        if outcomes:
            logger.debug("heartbeat (%d ids, %d leases renewed): %s", len(ids), renewed, outcomes)
            try:
                self.xfer_stats.record_lease_renewals(outcomes)
            except Exception as exc:
                errors.note(TelemetryError.STATS, exc)

    def _handle_heartbeat(self, payload: str) -> None:
        """vLLM's lease renewal, in our words: ids matched by base request id.

        (vLLM's own looks each id up exactly; push-mode heartbeats carry the router's
        id, never P's internal one, so nothing was ever renewed. The writer applies
        heartbeats as it reads them; this only runs for one that reached vLLM's
        main-thread path some other way.)
        """
        self._renew_from(None, payload.encode())

    # ---------------------------------------------------------------- expired
    def _reap_expired_send_leases(self, done_sending: set[str]) -> None:
        """vLLM's reaper, on the ledger's word and on what is due only: it runs over a map
        of just the leases the ledger released this step (deadlines -inf), put in place of
        `_reqs_to_send` for the call (main thread only, like every use of that map), and
        what it released leaves the real map after. So a step costs what it releases, not
        what P holds (vLLM's own pass scans every lease). Once a second the leases vLLM
        holds that the ledger does not know, if any, go through it too, with vLLM's own
        deadlines and rule."""
        held = self._reqs_to_send
        if not held:
            return None
        now = time.perf_counter()
        released = self._leases.plan_reap(now, held)
        due = {item.req_id: _RELEASE_NOW for item in released}
        if now - self._reaped_unknown_at >= UNKNOWN_LEASES_CHECK_S:
            self._reaped_unknown_at = now
            for req_id in self._leases.unknown(list(held)):
                due[req_id] = held[req_id]
        if not due:
            return None
        view = dict(due)
        self._reqs_to_send = view
        try:
            super()._reap_expired_send_leases(done_sending)
        finally:
            self._reqs_to_send = held
            for req_id in due:
                if req_id not in view:  # vLLM released it from the view: from the map too
                    held.pop(req_id, None)
        try:
            for item in released:
                if item.req_id in done_sending:
                    self._note_expired(item)
        except Exception as exc:
            errors.note(TelemetryError.STATS, exc)
        return None

    def _note_expired(self, item: Any) -> None:
        logger.warning("KV lease of request %s released before its push (%s%s); its blocks "
                       "are freed", item.req_id, item.fate.value,
                       ", later than due" if item.late else "")
        self.xfer_stats.record_lease_expiry(item.fate.value, item.late)

    # ------------------------------------------------------------------ ended
    def _leases_ended(self, req_ids: Iterable[str]) -> list[str]:
        """Main thread, from the step's finished_sending: pushed or released. Returns
        those whose push completed (counted once)."""
        self._leases_report_owed = True
        return self._leases.ended(req_ids)

    def _lease_events(self, req_id: str, span: Any) -> None:
        """Put the request's lease history on its write span (before it ends)."""
        renewed, fate = self._leases.lease_history(req_id)
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

    def _record_push_stages(self, settled: Any) -> None:
        """P, main thread: a completed push's TTFT stages (prefill done -> WRITE posted,
        PUSH_REG matched -> WRITE done) into the stats, with its write span as exemplar;
        the span gets the two boundaries it does not mark itself as events."""
        if not (settled.granted and settled.posted and settled.claimed):
            return  # pushed by a path the ledger did not see posted: no stages known
        wait = max(0.0, settled.posted - settled.granted)
        write = max(0.0, settled.at - settled.claimed)
        span = self._write_spans.get(settled.req_id) if self._spans.enabled else None
        ids = None
        if span is not None and span.is_recording():
            ids = span_ids(span)
            # perf_counter -> the span clock (wall ns), both read now.
            wall_ns, now = time.time_ns(), time.perf_counter()
            span.add_event(SpanEvent.PREFILL_DONE,
                           timestamp=wall_ns - int((now - settled.granted) * 1e9))
            span.add_event(SpanEvent.WRITE_POSTED,
                           timestamp=wall_ns - int((now - settled.posted) * 1e9))
            span.set_attribute(Attr.WRITE_WAIT, wait)
        self.xfer_stats.record_push_stages(wait, write, ids)

    def _report_leases(self) -> None:
        """The gauges' snapshot, at most once a second while leases are held, and once
        when the last one ends (so the gauge returns to 0)."""
        now = time.monotonic()
        if not self._leases_report_owed and now - self._leases_reported_at < LEASE_REPORT_INTERVAL_S:
            return
        held, oldest = self._leases.oldest_held(now)
        self.xfer_stats.set_leases(held, oldest)
        self._leases_reported_at = now
        self._leases_report_owed = False

    # ------------------------------------------------------------ D: heartbeats
    def _send_heartbeats(self, metadata: Any) -> None:
        """vLLM's step sends its heartbeats here, last (engine main thread). In our words
        (see the module docstring). One per engine connected (notification-only, as
        every D->P connection), naming the receives still wanted and when it was sent."""
        due = self._owed_heartbeats_due()
        for engine_id, info in (metadata.heartbeat_by_engine or {}).items():
            due[engine_id] = info
        if not due:
            return
        now = time.perf_counter()
        for engine_id, info in due.items():
            wanted = self._receives.wanted(set(info.req_ids))
            if not wanted:
                continue
            future = self._connect(Trigger.HEARTBEAT, None, engine_id, info.host, info.port,
                                   info.tp_size, {"dcp_size": getattr(info, "dcp_size", 1),
                                                  "pp_size": info.pp_size, "notif_agents_only": True})
            if future is not None:  # connecting: this heartbeat goes once connected
                self._owed_heartbeats[engine_id] = dataclasses.replace(info, req_ids=wanted)
                continue
            targets = self._connections.targets(engine_id)
            if not targets.agents:
                continue  # being dropped: the next heartbeat goes to the next connection
            self._connections.touch(engine_id, now)  # (vLLM's idle clock, as its heartbeat does)
            message = (HEARTBEAT_PREFIX + ",".join([*wanted, sent_at_token(now)]).encode())
            sent = 0
            for agent in targets.agents.values():
                try:
                    self.nixl_wrapper.send_notif(agent, notif_msg=message)
                    sent += 1
                except Exception:
                    self._connections.failed_agent(agent, PeerReset.NOTIFICATION_FAILED)
                    logger.debug("Failed to send a heartbeat to engine %s", engine_id, exc_info=True)
            if sent:  # (P may have it: the receives' last ask moves to now)
                self._receives.asked(wanted, now)
            self._count_heartbeats(sent, len(targets.agents) - sent)

    def _owed_heartbeats_due(self) -> dict[str, Any]:
        """Kept heartbeats whose handshake connected; those still pending stay kept.
        One whose handshake failed is dropped: sent again, it would start a new
        handshake on every engine step (a refused one fails at once, so it would
        never stop); the next regular heartbeat tries again, as vLLM's do."""
        if not self._owed_heartbeats:
            return {}
        owed, self._owed_heartbeats = self._owed_heartbeats, {}
        due = {}
        for engine_id, info in owed.items():
            if self._connections.is_pending(engine_id):
                self._owed_heartbeats[engine_id] = info
            elif self._connections.is_connected(engine_id):
                due[engine_id] = info
        return due

    def _count_heartbeats(self, sent: int, failed: int) -> None:
        try:
            for ok, n in ((True, sent), (False, failed)):
                for _ in range(n):
                    self.xfer_stats.record_heartbeat(ok)
        except Exception as exc:
            errors.note(TelemetryError.STATS, exc)

"""Worker-side stats: vLLM's NIXL stats plus one summary per handshake and push counters.

It travels exactly like the stock object (worker `get_kv_connector_stats()` ->
aggregation across TP/PP workers -> `to_dict()` in SchedulerStats -> rebuilt in the
API server with `build_kv_connector_stats`), so every field stays msgpack-friendly.

Thread safety: the writer and handshake threads record while the engine's main
thread takes the interval's stats with `clone_and_reset()`. The interval's dict is
swapped for a complete new one under a process-wide lock, never emptied in place,
and the `record_*` methods of other threads append under the same lock, so a record
lands in exactly one interval and can never hit a half-built dict. Records made on the
main thread itself (receives, completed pushes) need no lock: they cannot overlap the
swap. (The lock is module-level, not an attribute: the stats object is pickled between
processes.)
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.stats import NixlKVConnectorStats

from connector.telemetry.record import HandshakeRecord
from connector.vocabulary import OUR_STAT_KEYS, StatKey

_LOCK = threading.Lock()


class ObservedNixlStats(NixlKVConnectorStats):
    """`NixlKVConnectorStats` with handshake summaries and push counters."""

    def __post_init__(self) -> None:
        super().__post_init__()
        # Stats rebuilt from a stock peer's dict lack our keys: add them empty.
        for key in OUR_STAT_KEYS:
            self.data.setdefault(key, [])
        self._has_ours = self._scan_ours()

    def _scan_ours(self) -> bool:
        """Whether any of our keys holds a record (recomputed only when data arrives
        wholesale; the `record_*` methods set the flag as they append)."""
        data = self.data
        return any(data.get(key) for key in OUR_STAT_KEYS)

    def reset(self) -> None:
        with _LOCK:
            self._reset()

    def _reset(self) -> None:
        # Binds a new dict; the old one belongs to the clone. Our keys are added as
        # records arrive (`_append`), not here: a D ships an interval per step with a
        # receive, and twelve empty lists built and serialized per interval were most
        # of what that cost. The API server's rebuilt object adds the missing keys
        # (`__post_init__`), so readers there still find every key.
        super().reset()
        self._has_ours = False

    def clone_and_reset(self) -> ObservedNixlStats:
        # vLLM asks every step that has records; `copy.copy` went through the pickle
        # protocol each time. A shallow copy of the fields is all it did.
        old = object.__new__(type(self))
        with _LOCK:
            old.__dict__.update(self.__dict__)
            self._reset()
        return old

    # -- vLLM's own records that other threads make ---------------------------
    # vLLM appends these without a lock from the writer (a WRITE that could not be
    # posted, a notification that failed) and the handshake pool (a failed handshake),
    # while the main thread swaps the interval's dict: under our lock, each lands in
    # exactly one interval.
    def record_failed_transfer(self) -> None:
        with _LOCK:
            super().record_failed_transfer()

    def record_failed_notification(self) -> None:
        with _LOCK:
            super().record_failed_notification()

    def record_failed_handshake(self) -> None:
        with _LOCK:
            super().record_failed_handshake()

    # -- recording (writer, handshake and main threads) ---------------------
    def _append(self, key: str, value: Any) -> None:
        with _LOCK:
            self.data.setdefault(key, []).append(value)
            self._has_ours = True

    def record_handshake(self, record: HandshakeRecord) -> None:
        self._append(StatKey.HANDSHAKES, record.to_stats())

    def record_push_reg_notif(self, sent: bool, count: int = 1) -> None:
        """`count` PUSH_REG notifications sent (one per P agent reached) or not."""
        with _LOCK:
            self.data.setdefault(StatKey.PUSH_REG_SENT if sent else StatKey.PUSH_REG_FAILED,
                                 []).extend([1] * count)
            self._has_ours = True

    def record_push(self, key: str) -> None:
        self._append(key, 1)

    def record_retry(self, direction: str) -> None:
        self._append(StatKey.HANDSHAKE_RETRIES, direction)

    def record_push_reg_rejected(self, reason: str) -> None:
        self._append(StatKey.PUSH_REG_REJECTED, reason)

    def record_telemetry_errors(self, reasons: dict[str, int]) -> None:
        self._extend_counts(StatKey.TELEMETRY_ERRORS, reasons)

    def record_auth_refusals(self, refusals: dict[str, int]) -> None:
        """{"channel|reason": count} (connector/trust/refusals.py, drained)."""
        self._extend_counts(StatKey.AUTH_REFUSALS, refusals)

    def record_side_channel_rejected(self, reasons: dict[str, int]) -> None:
        self._extend_counts(StatKey.SIDE_CHANNEL_REJECTED, reasons)

    def _extend_counts(self, key: str, reasons: dict[str, int]) -> None:
        with _LOCK:
            bucket = self.data.setdefault(key, [])
            for reason, n in reasons.items():
                bucket.extend([reason] * n)
            self._has_ours = self._has_ours or bool(bucket)

    def set_in_flight(self, snapshot: dict[str, list[float]]) -> None:
        """This worker's unfinished handshakes now: {"dir|notif": [count, oldest_s]}."""
        with _LOCK:
            self.data[StatKey.IN_FLIGHT] = [snapshot]
            self._has_ours = True

    # -- KV leases (P) and heartbeats (D) ------------------------------------------
    def record_lease_renewals(self, outcomes: dict[str, int]) -> None:
        """Heartbeat ids by what they matched (LeaseRenewal values)."""
        self._extend_counts(StatKey.LEASE_RENEWALS, outcomes)

    def record_lease_expiry(self, fate: str, late: bool) -> None:
        with _LOCK:
            self.data.setdefault(StatKey.LEASE_EXPIRIES, []).append(fate)
            if late:
                self.data.setdefault(StatKey.LEASES_REAPED_LATE, []).append(1)
            self._has_ours = True

    def set_leases(self, held: int, oldest_age_s: float) -> None:
        """This worker's leases now (a snapshot: the API server keeps the latest)."""
        with _LOCK:
            self.data[StatKey.LEASES] = [[held, oldest_age_s]]
            self._has_ours = True

    def record_heartbeat(self, sent: bool) -> None:
        self._append(StatKey.HEARTBEATS_SENT if sent else StatKey.HEARTBEATS_FAILED, 1)

    def record_peer_reset(self, direction: str, reason: str) -> None:
        self._append(StatKey.PEER_RESETS, f"{direction}|{reason}")

    def record_peer_restart(self, direction: str) -> None:
        self._append(StatKey.PEER_RESTARTS, direction)

    def record_receive_failure(self, reason: str) -> None:
        self._append(StatKey.RECEIVE_FAILURES, reason)

    # -- what the push state's owner refused, aborted or gave up ----------------
    def record_push_fail(self, reason: str, outcome: str) -> None:
        self._append(StatKey.PUSH_FAILS, f"{reason}|{outcome}")

    def record_write_abort(self, outcome: str) -> None:
        self._append(StatKey.WRITE_ABORTS, outcome)

    def record_receive_abandoned(self, reason: str) -> None:
        self._append(StatKey.RECEIVES_ABANDONED, reason)

    def record_peer_forgotten(self, direction: str) -> None:
        self._append(StatKey.PEERS_FORGOTTEN, direction)

    def record_internal_error(self, step: str) -> None:
        self._append(StatKey.INTERNAL_ERRORS, step)

    # -- KV integrity (connector/integrity) -------------------------------------
    def record_kv_verify(self, outcome: str, reason: str) -> None:
        self._append(StatKey.KV_VERIFY, f"{outcome}|{reason}")

    def record_kv_mismatch_from(self, engine_id: str) -> None:
        """For D's scheduler (its escalation rules), not for /metrics."""
        self._append(StatKey.KV_MISMATCH_FROM, engine_id)

    def record_prefill_restarted(self, engine_id: str) -> None:
        """For D's scheduler (its escalation rules), not for /metrics."""
        self._append(StatKey.PREFILL_RESTARTED, engine_id)

    def record_kv_digest(self, seconds: float) -> None:
        self._append(StatKey.KV_DIGEST_SECONDS, seconds)

    def add_nixl_agent(self, tp_rank: int, agent_name: str) -> None:
        """This worker's NIXL agent, for the API server's join of NIXL's own series. Only
        on an interval that already carries records (the worker decides when): naming
        the agent never makes an idle step ship stats."""
        with _LOCK:
            self.data.setdefault(StatKey.NIXL_AGENTS, []).append([tp_rank, agent_name])

    def set_remote_prefills(self, waiting: int, oldest_wait_s: float) -> None:
        """D's scheduler: requests waiting for a remote prefill now (a snapshot)."""
        with _LOCK:
            self.data[StatKey.REMOTE_PREFILLS] = [[waiting, oldest_wait_s]]
            self._has_ours = True

    def record_receive(self, outcome: str, seconds: float, ids: tuple[str, str] | None,
                       kv_wait: float | None = None) -> None:
        """One D-side receive; `ids` (trace id, span id) of its span become the exemplar;
        `kv_wait`: seconds since the request arrived at D (None when not known).

        Engine main thread only: the thread that also takes the interval's stats
        (`clone_and_reset`), so no record can race the swap and no lock is taken (other
        threads' appends to other keys of the same dict are single dict operations,
        atomic under the GIL)."""
        rec: dict[str, Any] = {"outcome": outcome, "duration": seconds}
        if kv_wait is not None:
            rec["kv_wait"] = kv_wait
        if ids is not None:
            rec["trace_id"], rec["span_id"] = ids
        self._append_on_main_thread(StatKey.RECEIVES, rec)

    def record_push_stages(self, wait: float, write: float, ids: tuple[str, str] | None) -> None:
        """P: one completed push's stages (prefill done -> WRITE posted, PUSH_REG matched ->
        WRITE done); `ids` of its write span become the exemplar. Main thread only."""
        rec: dict[str, Any] = {"wait": wait, "write": write}
        if ids is not None:
            rec["trace_id"], rec["span_id"] = ids
        self._append_on_main_thread(StatKey.PUSH_STAGES, rec)

    def record_push_completed(self) -> None:
        """One push completed (engine main thread only; see `record_receive`)."""
        self._append_on_main_thread(StatKey.PUSHES_COMPLETED, 1)

    def _append_on_main_thread(self, key: str, value: Any) -> None:
        """`_append` without the lock, for the thread that takes the intervals."""
        self.data.setdefault(key, []).append(value)
        self._has_ours = True

    # -- vLLM's contract ---------------------------------------------------------
    def is_empty(self) -> bool:
        # An interval with only handshakes (no transfer yet) must not be dropped.
        # vLLM asks every engine step: a flag, not a scan of our twelve keys.
        return not self._has_ours and super().is_empty()

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        if other.is_empty():
            return self
        with _LOCK:
            for key, values in other.data.items():
                self.data.setdefault(key, []).extend(values)
            self._has_ours = self._scan_ours()
        return self

    @property
    def handshakes(self) -> list[dict[str, Any]]:
        return self.data.get(StatKey.HANDSHAKES, [])

    @property
    def receives(self) -> list[dict[str, Any]]:
        return self.data.get(StatKey.RECEIVES, [])

    def reduce(self) -> dict[str, int | float]:
        """The stock "KV Transfer metrics" log line, extended with handshakes.

        vLLM's logging path calls this in the API server: a malformed record from a
        peer build is skipped here (the Prometheus side counts it), never raised.
        """
        out = dict(super().reduce())
        receives = self.receives
        if receives:
            out["Receives"] = len(receives)
            out["Failed receives"] = sum(
                isinstance(r, dict) and r.get("outcome") != "success" for r in receives)
        hs = [h for h in self.handshakes if _well_formed(h) and h.get("retried") is not True]
        if not hs:
            out["Num handshakes"] = 0
            return out
        durations = np.asarray([h["duration"] for h in hs], dtype=float)
        d_to_p = [h for h in hs if h["direction"] == "d_to_p"]
        out.update(
            {
                "Num handshakes": len(hs),
                "Failed handshakes": sum(h["outcome"] != "success" for h in hs),
                "Notif-only D->P handshakes": sum(bool(h["notif_only"]) for h in d_to_p),
                "Full D->P handshakes": sum(not h["notif_only"] for h in d_to_p),
                "Avg handshake time (ms)": round(float(durations.mean()) * 1e3, 3),
                "P90 handshake time (ms)": round(float(np.percentile(durations, 90)) * 1e3, 3),
                "Descriptor regs saved": sum(int(h.get("saved_registrations") or 0) for h in hs),
                "Descriptors saved": sum(int(h.get("saved_descriptors") or 0) for h in hs),
                "PUSH_REG sent": len(self.data.get(StatKey.PUSH_REG_SENT, [])),
                "Pushes completed": len(self.data.get(StatKey.PUSHES_COMPLETED, [])),
            }
        )
        return out


def _well_formed(h: Any) -> bool:
    try:
        return (isinstance(h, dict) and isinstance(h["duration"], int | float)
                and h["direction"] in ("d_to_p", "p_to_d") and "outcome" in h
                and "notif_only" in h
                and all(isinstance(h.get(k) or 0, int)
                        for k in ("saved_registrations", "saved_descriptors")))
    except Exception:
        return False

"""Observe worker stats into Prometheus, in vLLM's API-server process.

vLLM calls the connector's `build_prom_metrics(...)` with its own metric classes
(plain prometheus_client, or multiprocess/Ray variants) and its `model_name`/`engine`
labels; we add only the closed label sets from the vocabulary.

Latency observations carry an OpenMetrics exemplar ({trace_id, span_id}) when the
stats record holds the ids of its span. prometheus_client shows exemplars only in
the OpenMetrics format (vLLM's /metrics negotiates it by Accept header); the text
format, multiprocess mode (no exemplar storage) and Ray's wrappers (no exemplar
argument) simply observe the value.
"""

from __future__ import annotations

import logging
import re
from collections import Counter as Counter_
from collections.abc import Callable
from typing import Any

from prometheus_client import REGISTRY, Counter, Gauge, Histogram
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.stats import NixlPromMetrics

from connector import vocabulary as V
from connector.vocabulary import MetricKind, MetricSpec, StatKey, bool_label

logger = logging.getLogger(__name__)

_TRACE_ID = re.compile(r"[0-9a-f]{32}")
_SPAN_ID = re.compile(r"[0-9a-f]{16}")
_AGENT_NAME = re.compile(r"[A-Za-z0-9._:@-]{1,128}")  # (vLLM's: a UUID)


def exemplar_of(trace_id: Any, span_id: Any = None) -> dict[str, str] | None:
    """Exemplar labels for a record's span ids; None unless the trace id is valid.

    Validated here, before observing: prometheus_client validates an exemplar only
    after it counted the observation, and a half-observed record must not happen.
    """
    if not isinstance(trace_id, str) or not _TRACE_ID.fullmatch(trace_id) or not int(trace_id, 16):
        return None
    out = {V.EXEMPLAR_TRACE_ID: trace_id}
    if isinstance(span_id, str) and _SPAN_ID.fullmatch(span_id):
        out[V.EXEMPLAR_SPAN_ID] = span_id
    return out


def observe(child: Any, value: float, exemplar: dict[str, str] | None) -> None:
    """`child.observe(value)`, with the exemplar where the metric class takes one."""
    if exemplar is not None and isinstance(child, Histogram):
        child.observe(value, exemplar)
    else:
        child.observe(value)


class ObservedPromMetrics(NixlPromMetrics):
    """vLLM's NIXL metrics plus the handshake and push metrics of the vocabulary."""

    def __init__(self, vllm_config: Any, metric_types: dict, labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]], *,
                 degraded: Callable[[], bool] = lambda: False):
        """`degraded`: whether this process runs on a vLLM the start-up guard does not
        vouch for (the connector passes the guard's verdict; telemetry imports no glue)."""
        # Built a second time in one process without vLLM's unregister (a second
        # KVConnectorProm), registration would raise for every name, stock ones
        # included: reuse the registered metric instead, so both instances count
        # into the same series and nothing is lost or counted twice.
        metric_types = {base: _reusing(cls) for base, cls in metric_types.items()}
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self.dropped_records = 0
        self._ours: dict[str, Any] = {}
        self._children: dict[tuple[str, int, tuple[str, ...]], Any] = {}
        for spec in V.ALL_METRICS:
            self._ours[spec.name] = self._make(spec, list(labelnames))
        for idx in self.per_engine_labelvalues:
            self._precreate_handshake_series(idx)
            self._precreate_push_series(idx)
        self._init_degraded_gauge(list(labelnames), degraded)
        self._agent_info = self._make(V.NIXL_AGENT_INFO, list(labelnames))
        self._agents: set[tuple[int, str, str]] = set()

    def _precreate_handshake_series(self, idx: int) -> None:
        """Pre-create the series dashboards and alerts rely on, so rates start at 0
        instead of appearing from nowhere (no NaN gaps on idle engines): handshakes."""
        for direction in V.Direction:
            for notif in (True, False):
                self._child(V.HANDSHAKE_DURATION, idx, direction.value, bool_label(notif),
                            V.Outcome.SUCCESS.value)
                # rate()/increase() cannot see a series' first sample: a counter
                # born at 1 (often the only D->P handshake per peer) would never
                # show. 32 counters + 20 histograms per engine.
                for trigger in V.Trigger:
                    for outcome in V.Outcome:
                        self._child(V.HANDSHAKES, idx, direction.value, trigger.value,
                                    bool_label(notif), outcome.value)
                for phase in V.Phase:
                    if notif and phase in V.FULL_ONLY_PHASES:
                        continue
                    self._child(V.HANDSHAKE_PHASE_DURATION, idx, direction.value,
                                bool_label(notif), phase.value)
            self._child(V.DESCRIPTOR_REGISTRATIONS_SAVED, idx, direction.value)
            self._child(V.DESCRIPTORS_SAVED, idx, direction.value)
            for which in V.DescriptorList:
                self._child(V.DESCRIPTOR_REGISTRATIONS, idx, direction.value, which.value)
                self._child(V.DESCRIPTORS_REGISTERED, idx, direction.value, which.value)

    def _precreate_push_series(self, idx: int) -> None:
        """The same for the push, lease, receive and KV-check series."""
        for outcome in V.NotifOutcome:
            self._child(V.PUSH_REG_NOTIFS, idx, outcome.value)
        for event in V.PushEvent:
            self._child(V.PUSHES, idx, event.value)
        for outcome in V.ReceiveOutcome:
            self._child(V.RECEIVE_DURATION, idx, outcome.value)
            self._child(V.KV_WAIT, idx, outcome.value)
        self._child(V.PUSH_WRITE_WAIT, idx)
        self._child(V.PUSH_WRITE_DURATION, idx)
        for direction in V.Direction:
            self._child(V.HANDSHAKE_OLDEST_IN_FLIGHT, idx, direction.value).set(0)
            for notif in (True, False):
                self._child(V.HANDSHAKES_IN_FLIGHT, idx, direction.value, bool_label(notif)).set(0)
        for _, metric, closed in _LABELLED:  # (one closed label each: every value from 0)
            for value in closed:
                self._child(metric, idx, value.value)
        self._child(V.KV_LEASES_REAPED_LATE, idx)
        for outcome in V.NotifOutcome:
            self._child(V.HEARTBEATS, idx, outcome.value)
        for gauge in _SNAPSHOT_GAUGES:
            self._child(gauge, idx).set(0)
        for direction in V.Direction:
            for reset in V.PeerReset:
                self._child(V.PEER_RESETS, idx, direction.value, reset.value)
        for reason in V.PushFailReason:
            for sent in V.PushFailOutcome:
                self._child(V.PUSH_FAIL_NOTIFS, idx, reason.value, sent.value)
        for verdict in V.KvVerifyOutcome:
            for reason in V.KvVerifyReason:
                self._child(V.KV_VERIFY, idx, verdict.value, reason.value)
        self._child(V.KV_DIGEST_DURATION, idx)
        for channel in V.AuthChannel:
            for refusal in V.AuthRefusal:
                self._child(V.PEER_AUTH_REFUSALS, idx, channel.value, refusal.value)

    # -- start-up guard verdict (connector/glue/guard.py) ----------------------------
    def _init_degraded_gauge(self, labelnames: list[str], degraded: Callable[[], bool]) -> None:
        """`vllm:nixl_observed_degraded` per engine: 1 when running on an untested vLLM."""
        try:
            value = 1.0 if degraded() else 0.0
            gauge = self._gauge_cls(name=V.OBSERVED_DEGRADED.name, documentation=V.OBSERVED_DEGRADED.help,
                                    labelnames=labelnames, multiprocess_mode="mostrecent")
            for base in self.per_engine_labelvalues.values():
                gauge.labels(*base).set(value)
        except Exception:
            logger.warning("could not export %s", V.OBSERVED_DEGRADED.name, exc_info=True)

    def _make(self, spec: MetricSpec, base_labels: list[str]) -> Any:
        labels = base_labels + list(spec.labels)
        if spec.kind is MetricKind.COUNTER:
            return self._counter_cls(name=spec.name, documentation=spec.help, labelnames=labels)
        if spec.kind is MetricKind.GAUGE:
            # Engine-level values (summed over workers before they get here).
            return self._gauge_cls(name=spec.name, documentation=spec.help, labelnames=labels,
                                   multiprocess_mode="mostrecent")
        return self._histogram_cls(name=spec.name, documentation=spec.help,
                                   labelnames=labels, buckets=list(spec.buckets))

    def _child(self, spec: MetricSpec, engine_idx: int, *values: str) -> Counter | Gauge | Histogram:
        """The bound child of a series, made once (label values here are closed sets, so
        the cache is bounded by the vocabulary's series bound): `labels()` validates and
        looks up under a lock on every call, several per request."""
        key = (spec.name, engine_idx, values)
        child = self._children.get(key)
        if child is None:
            base = self.per_engine_labelvalues[engine_idx]
            child = self._children[key] = self._ours[spec.name].labels(*base, *values)
        return child

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        # Stock keys first (a stock-shaped dict works unchanged).
        super().observe(transfer_stats_data, engine_idx)
        self._observe_ours(transfer_stats_data, engine_idx)

    def _drop(self, what: str, record: Any, idx: int) -> None:
        self.dropped_records += 1
        first = self.dropped_records == 1
        (logger.warning if first else logger.debug)(
            "dropping malformed NIXL %s stats record (%d dropped so far; all are counted in "
            "vllm:nixl_telemetry_errors_total{reason=\"malformed_record\"}): %.200r",
            what, self.dropped_records, record)
        try:
            self._child(V.TELEMETRY_ERRORS, idx, V.TelemetryError.MALFORMED_RECORD.value).inc()
        except Exception:  # pragma: no cover - the engine index itself is unknown
            logger.debug("could not count a dropped record", exc_info=True)

    def _observe_ours(self, data: dict[str, Any], idx: int) -> None:
        # A malformed record is dropped (counted, logged); the rest are observed.
        for hs in data.get(StatKey.HANDSHAKES, ()):
            try:
                self._observe_handshake(hs, idx)
            except Exception:
                self._drop("handshake", hs, idx)
        for rec in data.get(StatKey.RECEIVES, ()):
            try:
                self._observe_receive(rec, idx)
            except Exception:
                self._drop("receive", rec, idx)
        for rec in data.get(StatKey.PUSH_STAGES, ()):
            try:
                self._observe_push_stages(rec, idx)
            except Exception:
                self._drop("push stages", rec, idx)
        for seconds in data.get(StatKey.KV_DIGEST_SECONDS, ()):
            try:
                if not isinstance(seconds, int | float) or not 0 <= seconds < 3600:
                    raise ValueError(f"bad digest time {seconds!r}")
                self._child(V.KV_DIGEST_DURATION, idx).observe(seconds)
            except Exception:
                self._drop("KV digest time", seconds, idx)
        for key, spec, *label in _COUNTS:
            values = data.get(key)
            if not values:
                continue
            try:
                total = sum(values)
                if not isinstance(total, int) or total < 0:
                    raise ValueError(f"bad count {total!r}")
                self._child(spec, idx, *label).inc(total)
            except Exception:
                self._drop(key, values, idx)
        for key, spec, closed in _LABELLED:
            values = data.get(key)
            if not values:
                continue
            try:
                tally = Counter_(closed(v).value for v in values)  # validates every value first
            except Exception:
                self._drop(key, values, idx)
                continue
            for label, n in tally.items():
                self._child(spec, idx, label).inc(n)
        for key, spec, parse in _PAIRED:
            values = data.get(key)
            if not values:
                continue
            try:
                pairs = Counter_(parse(v) for v in values)  # validates every value first
            except Exception:
                self._drop(key, values, idx)
            else:
                for (first, second), n in pairs.items():
                    self._child(spec, idx, first, second).inc(n)
        agents = data.get(StatKey.NIXL_AGENTS)
        if agents:
            try:
                self._observe_agents(agents, idx)
            except Exception:
                self._drop(StatKey.NIXL_AGENTS, agents, idx)
        snapshots = data.get(StatKey.IN_FLIGHT)
        if snapshots:
            try:
                self._observe_in_flight(snapshots, idx)
            except Exception:
                self._drop(StatKey.IN_FLIGHT, snapshots, idx)
        for key, (count_gauge, age_gauge) in _SNAPSHOTS.items():
            snapshots = data.get(key)
            if not snapshots:
                continue
            try:
                # Workers of one engine hold the same requests: the largest one counts.
                pairs = [(int(n), float(age)) for n, age in snapshots]
                if any(n < 0 or age < 0 for n, age in pairs):
                    raise ValueError(f"negative {key} snapshot")
                self._child(count_gauge, idx).set(max(n for n, _ in pairs))
                self._child(age_gauge, idx).set(max(age for _, age in pairs))
            except Exception:
                self._drop(key, snapshots, idx)

    def _observe_agents(self, agents: list[list[Any]], idx: int) -> None:
        """`vllm:nixl_push_agent_info` for each worker's NIXL agent (validated first: a
        label value must be NIXL's agent name, and the set stays bounded)."""
        new = []
        for rank, name in agents:
            if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < 65536:
                raise ValueError(f"bad TP rank {rank!r}")
            if not isinstance(name, str) or not _AGENT_NAME.fullmatch(name):
                raise ValueError(f"bad agent name {name!r}")
            key = (idx, name, str(rank))
            if key not in self._agents:
                new.append(key)
        if len(self._agents) + len(set(new)) > V.MAX_NIXL_AGENTS:
            raise ValueError(f"more than {V.MAX_NIXL_AGENTS} NIXL agents")
        for key in new:
            self._agents.add(key)
            self._agent_info.labels(*self.per_engine_labelvalues[idx], key[1], key[2]).set(1)

    def _observe_in_flight(self, snapshots: list[dict[str, list[float]]], idx: int) -> None:
        """Sum the workers' snapshots of one step; every series not reported is 0."""
        counts: dict[tuple[str, str], int] = {}
        oldest: dict[str, float] = {}
        for snap in snapshots:
            for key, (count, age) in snap.items():
                direction, notif = key.split("|")
                direction = V.Direction(direction).value
                if notif not in V.BOOL_VALUES or count < 0 or age < 0:
                    raise ValueError(f"bad in-flight entry {key}")
                counts[(direction, notif)] = counts.get((direction, notif), 0) + int(count)
                oldest[direction] = max(oldest.get(direction, 0.0), float(age))
        for direction in V.Direction:
            self._child(V.HANDSHAKE_OLDEST_IN_FLIGHT, idx, direction.value).set(
                oldest.get(direction.value, 0.0))
            for notif in V.BOOL_VALUES:
                self._child(V.HANDSHAKES_IN_FLIGHT, idx, direction.value, notif).set(
                    counts.get((direction.value, notif), 0))

    def _observe_handshake(self, hs: dict[str, Any], idx: int) -> None:
        # Validate everything first so a bad record is dropped whole, never half-counted.
        direction = V.Direction(hs["direction"]).value
        trigger = V.Trigger(hs["trigger"]).value
        notif = bool_label(bool(hs["notif_only"]))
        outcome = V.Outcome(hs["outcome"]).value
        duration = float(hs["duration"])
        phases = [(V.Phase(p).value, float(sec)) for p, sec in hs.get("phases", {}).items()]
        trace_id = hs.get("trace_id")
        exemplar = exemplar_of(trace_id, hs.get("span_id"))
        phase_spans = hs.get("phase_span_ids") if exemplar is not None else None
        if not isinstance(phase_spans, dict):
            phase_spans = {}
        regs = [(V.DescriptorList(w).value, int(n)) for w, n in hs.get("registrations", {}).items()]
        descs = [(V.DescriptorList(w).value, int(n)) for w, n in hs.get("descriptors", {}).items()]
        saved_regs = int(hs.get("saved_registrations") or 0)
        saved_descs = int(hs.get("saved_descriptors") or 0)
        failure = None
        if outcome == V.Outcome.FAILURE.value:
            failure = (V.Phase(hs.get("failed_phase") or V.Phase.QUEUE_WAIT).value,
                       V.ErrorType(hs.get("error_type") or V.ErrorType.OTHER).value)
        if duration < 0 or saved_regs < 0 or saved_descs < 0 or any(
                v < 0 for _, v in [*phases, *regs, *descs]):
            raise ValueError("negative value in handshake record")

        if failure is not None:
            self._child(V.HANDSHAKE_PHASE_FAILURES, idx, direction, *failure).inc()
        retried = hs.get("retried") is True  # an attempt: the handshake counts at its last
        if not retried:
            self._child(V.HANDSHAKES, idx, direction, trigger, notif, outcome).inc()
            observe(self._child(V.HANDSHAKE_DURATION, idx, direction, notif, outcome), duration,
                    exemplar)
            for phase, seconds in phases:
                observe(self._child(V.HANDSHAKE_PHASE_DURATION, idx, direction, notif, phase),
                        seconds, exemplar_of(trace_id, phase_spans.get(phase)) if exemplar else None)
        for which, n in regs:
            if n:
                self._child(V.DESCRIPTOR_REGISTRATIONS, idx, direction, which).inc(n)
        for which, n in descs:
            if n:
                self._child(V.DESCRIPTORS_REGISTERED, idx, direction, which).inc(n)
        if saved_regs and not retried:
            self._child(V.DESCRIPTOR_REGISTRATIONS_SAVED, idx, direction).inc(saved_regs)
        if saved_descs and not retried:
            self._child(V.DESCRIPTORS_SAVED, idx, direction).inc(saved_descs)

    def _observe_receive(self, rec: dict[str, Any], idx: int) -> None:
        outcome = _RECEIVE_OUTCOMES[rec["outcome"]]  # (a value outside the closed set raises)
        duration = float(rec["duration"])
        if duration < 0:
            raise ValueError("negative receive duration")
        kv_wait = rec.get("kv_wait")
        if kv_wait is not None:
            kv_wait = float(kv_wait)
            if kv_wait < 0:
                raise ValueError("negative KV wait")
        exemplar = exemplar_of(rec.get("trace_id"), rec.get("span_id"))
        observe(self._child(V.RECEIVE_DURATION, idx, outcome), duration, exemplar)
        if kv_wait is not None:
            observe(self._child(V.KV_WAIT, idx, outcome), kv_wait, exemplar)

    def _observe_push_stages(self, rec: dict[str, Any], idx: int) -> None:
        wait, write = float(rec["wait"]), float(rec["write"])
        if wait < 0 or write < 0:
            raise ValueError("negative push stage")
        exemplar = exemplar_of(rec.get("trace_id"), rec.get("span_id"))
        observe(self._child(V.PUSH_WRITE_WAIT, idx), wait, exemplar)
        observe(self._child(V.PUSH_WRITE_DURATION, idx), write, exemplar)

# Stats keys whose records are one closed label value each: (key, metric, the closed set).
_LABELLED = (
    (StatKey.HANDSHAKE_RETRIES, V.HANDSHAKE_RETRIES, V.Direction),
    (StatKey.PUSH_REG_REJECTED, V.PUSH_REG_REJECTED, V.PushRegRejection),
    (StatKey.TELEMETRY_ERRORS, V.TELEMETRY_ERRORS, V.TelemetryError),
    (StatKey.SIDE_CHANNEL_REJECTED, V.SIDE_CHANNEL_REJECTED, V.SideChannelRejection),
    (StatKey.LEASE_RENEWALS, V.KV_LEASE_RENEWALS, V.LeaseRenewal),
    (StatKey.LEASE_EXPIRIES, V.KV_LEASE_EXPIRIES, V.LeaseFate),
    (StatKey.PEER_RESTARTS, V.PEER_RESTARTS, V.Direction),
    (StatKey.RECEIVE_FAILURES, V.RECEIVE_FAILURES, V.ReceiveFailure),
    (StatKey.WRITE_ABORTS, V.WRITE_ABORTS, V.WriteAbort),
    (StatKey.RECEIVES_ABANDONED, V.RECEIVES_ABANDONED, V.ReceiveAbandon),
    (StatKey.PEERS_FORGOTTEN, V.PEERS_FORGOTTEN, V.Direction),
    (StatKey.INTERNAL_ERRORS, V.INTERNAL_ERRORS, V.InternalStep),
)
# A receive's outcome, validated by one lookup (one record per request).
_RECEIVE_OUTCOMES = {outcome.value: outcome.value for outcome in V.ReceiveOutcome}


def _push_fail(value: Any) -> tuple[str, str]:
    reason, outcome = str(value).split("|")
    return V.PushFailReason(reason).value, V.PushFailOutcome(outcome).value


def _kv_verify(value: Any) -> tuple[str, str]:
    outcome, reason = str(value).split("|")
    return V.KvVerifyOutcome(outcome).value, V.KvVerifyReason(reason).value


def _auth_refusal(value: Any) -> tuple[str, str]:
    channel, reason = str(value).split("|")
    return V.AuthChannel(channel).value, V.AuthRefusal(reason).value


def _peer_reset(value: Any) -> tuple[str, str]:
    direction, reason = str(value).split("|")
    return V.Direction(direction).value, V.PeerReset(reason).value


# Stats keys holding "first|second" label pairs, with the metric and the parser.
_PAIRED: tuple[tuple[Any, ...], ...] = (
    (StatKey.PEER_RESETS, V.PEER_RESETS, _peer_reset),
    (StatKey.PUSH_FAILS, V.PUSH_FAIL_NOTIFS, _push_fail),
    (StatKey.KV_VERIFY, V.KV_VERIFY, _kv_verify),
    (StatKey.AUTH_REFUSALS, V.PEER_AUTH_REFUSALS, _auth_refusal),
)

# Stats keys holding counts, with the metric (and label value) they add to.
_COUNTS: tuple[tuple[Any, ...], ...] = (
    (StatKey.PUSH_REG_SENT, V.PUSH_REG_NOTIFS, V.NotifOutcome.SENT.value),
    (StatKey.PUSH_REG_FAILED, V.PUSH_REG_NOTIFS, V.NotifOutcome.FAILED.value),
    (StatKey.PUSHES_STARTED, V.PUSHES, V.PushEvent.STARTED.value),
    (StatKey.PUSHES_COMPLETED, V.PUSHES, V.PushEvent.COMPLETED.value),
    (StatKey.PUSHES_FAILED, V.PUSHES, V.PushEvent.FAILED.value),
    (StatKey.LEASES_REAPED_LATE, V.KV_LEASES_REAPED_LATE),
    (StatKey.HEARTBEATS_SENT, V.HEARTBEATS, V.NotifOutcome.SENT.value),
    (StatKey.HEARTBEATS_FAILED, V.HEARTBEATS, V.NotifOutcome.FAILED.value),
)
# Snapshot keys ([[count, oldest_age_s], ...]) and the two gauges each sets.
_SNAPSHOTS = {
    StatKey.LEASES: (V.KV_LEASES_HELD, V.KV_LEASE_OLDEST_AGE),
    StatKey.REMOTE_PREFILLS: (V.REMOTE_PREFILLS_WAITING, V.REMOTE_PREFILL_OLDEST_WAIT),
}
_SNAPSHOT_GAUGES = tuple(g for pair in _SNAPSHOTS.values() for g in pair)


def _reusing(cls: Any) -> Any:
    """`cls` as a factory that hands back the already-registered metric on a duplicate.

    Only the default registry is searched (vLLM's classes register there, in
    multiprocess mode too); a duplicate of another type or label set still raises.
    prometheus_client has no public way to look up a registered collector by name,
    so this is the one place in `connector/` that reads its private attributes
    (`_names_to_collectors`, `_labelnames`); should they change, the duplicate
    raises as it would without this factory.
    """

    def make(*args: Any, **kwargs: Any) -> Any:
        try:
            return cls(*args, **kwargs)
        except ValueError as exc:
            if "Duplicated timeseries" not in str(exc):
                raise
            name = kwargs.get("name", args[0] if args else "")
            existing = REGISTRY._names_to_collectors.get(name)
            wanted = tuple(kwargs.get("labelnames", args[2] if len(args) > 2 else ()))
            if (existing is None or not isinstance(existing, _base_of(cls))
                    or tuple(getattr(existing, "_labelnames", ())) != wanted):
                raise
            logger.info("metric %s already registered in this process: reusing it", name)
            return existing

    return make


def _base_of(cls: Any) -> tuple[type, ...]:
    bases = tuple(b for b in (Counter, Gauge, Histogram) if isinstance(cls, type) and issubclass(cls, b))
    return bases or (Counter, Gauge, Histogram)

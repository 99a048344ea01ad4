"""Observe worker stats into Prometheus, in vLLM's API-server process.

vLLM calls the connector's `build_prom_metrics(...)` with its own metric classes
(plain prometheus_client, or multiprocess/Ray variants) and its `model_name`/`engine`
labels; we add only the closed label sets from the vocabulary.
"""

from __future__ import annotations

import logging
from typing import Any

from prometheus_client import Counter, Histogram
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.stats import NixlPromMetrics

from connector import vocabulary as V
from connector.vocabulary import MetricKind, MetricSpec, StatKey, bool_label

logger = logging.getLogger(__name__)


class ObservedPromMetrics(NixlPromMetrics):
    """vLLM's NIXL metrics plus the handshake and push metrics of the vocabulary."""

    def __init__(self, vllm_config: Any, metric_types: dict, labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._ours: dict[str, Any] = {}
        for spec in V.ALL_METRICS:
            self._ours[spec.name] = self._make(spec, list(labelnames))
        # Pre-create the series dashboards and alerts rely on, so rates start at 0
        # instead of appearing from nowhere (no NaN gaps on idle engines).
        for idx in self.per_engine_labelvalues:
            for direction in V.Direction:
                for notif in (True, False):
                    self._child(V.HANDSHAKE_DURATION, idx, direction.value, bool_label(notif),
                                V.Outcome.SUCCESS.value)
                self._child(V.DESCRIPTOR_REGISTRATIONS_SAVED, idx, direction.value)
                self._child(V.DESCRIPTORS_SAVED, idx, direction.value)
                for which in V.DescriptorList:
                    self._child(V.DESCRIPTOR_REGISTRATIONS, idx, direction.value, which.value)
                    self._child(V.DESCRIPTORS_REGISTERED, idx, direction.value, which.value)
            for outcome in V.NotifOutcome:
                self._child(V.PUSH_REG_NOTIFS, idx, outcome.value)
            for event in V.PushEvent:
                self._child(V.PUSHES, idx, event.value)

    def _make(self, spec: MetricSpec, base_labels: list[str]) -> Any:
        labels = base_labels + list(spec.labels)
        if spec.kind is MetricKind.COUNTER:
            return self._counter_cls(name=spec.name, documentation=spec.help, labelnames=labels)
        return self._histogram_cls(name=spec.name, documentation=spec.help,
                                   labelnames=labels, buckets=list(spec.buckets))

    def _child(self, spec: MetricSpec, engine_idx: int, *values: str) -> Counter | Histogram:
        base = self.per_engine_labelvalues[engine_idx]
        return self._ours[spec.name].labels(*base, *values)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        # Stock keys first (a stock-shaped dict works unchanged).
        super().observe(transfer_stats_data, engine_idx)
        try:
            self._observe_ours(transfer_stats_data, engine_idx)
        except Exception:  # a malformed record must not break vLLM's stats loop
            logger.exception("dropping malformed NIXL handshake stats")

    def _observe_ours(self, data: dict[str, Any], idx: int) -> None:
        for hs in data.get(StatKey.HANDSHAKES, ()):
            self._observe_handshake(hs, idx)
        counts = (
            (StatKey.PUSH_REG_SENT, V.PUSH_REG_NOTIFS, V.NotifOutcome.SENT.value),
            (StatKey.PUSH_REG_FAILED, V.PUSH_REG_NOTIFS, V.NotifOutcome.FAILED.value),
            (StatKey.PUSHES_STARTED, V.PUSHES, V.PushEvent.STARTED.value),
            (StatKey.PUSHES_COMPLETED, V.PUSHES, V.PushEvent.COMPLETED.value),
            (StatKey.PUSHES_FAILED, V.PUSHES, V.PushEvent.FAILED.value),
        )
        for key, spec, label in counts:
            values = data.get(key)
            if values:
                self._child(spec, idx, label).inc(sum(values))

    def _observe_handshake(self, hs: dict[str, Any], idx: int) -> None:
        direction = V.Direction(hs["direction"]).value
        trigger = V.Trigger(hs["trigger"]).value
        notif = bool_label(bool(hs["notif_only"]))
        outcome = V.Outcome(hs["outcome"]).value
        self._child(V.HANDSHAKES, idx, direction, trigger, notif, outcome).inc()
        self._child(V.HANDSHAKE_DURATION, idx, direction, notif, outcome).observe(
            float(hs["duration"]))
        for phase, seconds in hs.get("phases", {}).items():
            self._child(V.HANDSHAKE_PHASE_DURATION, idx, direction, notif,
                        V.Phase(phase).value).observe(float(seconds))
        if outcome == V.Outcome.FAILURE.value:
            phase = V.Phase(hs.get("failed_phase") or V.Phase.QUEUE_WAIT).value
            error = V.ErrorType(hs.get("error_type") or V.ErrorType.OTHER).value
            self._child(V.HANDSHAKE_PHASE_FAILURES, idx, direction, phase, error).inc()
        for which, n in hs.get("registrations", {}).items():
            if n:
                self._child(V.DESCRIPTOR_REGISTRATIONS, idx, direction,
                            V.DescriptorList(which).value).inc(n)
        for which, n in hs.get("descriptors", {}).items():
            if n:
                self._child(V.DESCRIPTORS_REGISTERED, idx, direction,
                            V.DescriptorList(which).value).inc(n)
        if hs.get("saved_registrations"):
            self._child(V.DESCRIPTOR_REGISTRATIONS_SAVED, idx, direction).inc(
                hs["saved_registrations"])
        if hs.get("saved_descriptors"):
            self._child(V.DESCRIPTORS_SAVED, idx, direction).inc(hs["saved_descriptors"])

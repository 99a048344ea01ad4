"""What vLLM's API-server process does with connector stats, for one harness engine.

vLLM's `KVConnectorPrometheus` calls the connector class's
`build_prom_metrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)`
once and then `.observe(stats_dict, engine_idx)` for every scheduler stats update;
`KVConnectorLogging` rebuilds the stats with `build_kv_connector_stats` and logs
`reduce()`. We do the same, into a private registry that can be served on a real
`/metrics` endpoint (prometheus_client's own HTTP exposition, which, like vLLM's
`make_asgi_app`, answers OpenMetrics, with exemplars, to a scraper that asks for it).
"""

from __future__ import annotations

import copy
import threading
from types import SimpleNamespace
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import start_http_server
from prometheus_client.openmetrics.exposition import ALLOWUTF8
from prometheus_client.openmetrics.exposition import generate_latest as generate_openmetrics

MODEL_NAME = "tiny-llama"
LABELNAMES = ["model_name", "engine"]


def registry_metric_types(registry: CollectorRegistry) -> dict[type, type]:
    """prometheus_client classes bound to `registry` (vLLM injects its own classes)."""

    def bound(base: type) -> type:
        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            kwargs.setdefault("registry", registry)
            base.__init__(self, *args, **kwargs)

        return type(base.__name__, (base,), {"__init__": __init__})

    return {Counter: bound(Counter), Gauge: bound(Gauge), Histogram: bound(Histogram)}


class Frontend:
    """One engine's API-server side: Prometheus metrics plus the stats log line."""

    def __init__(self, connector_cls: Any, kv_transfer_config: Any, engine_label: str = "0",
                 model_name: str = MODEL_NAME):
        self.registry = CollectorRegistry()
        self.connector_cls = connector_cls
        # vLLM passes its VllmConfig; the NIXL metrics only read kv_transfer_config.
        config = SimpleNamespace(kv_transfer_config=kv_transfer_config)
        self.prom = connector_cls.build_prom_metrics(
            config, registry_metric_types(self.registry), list(LABELNAMES),
            {0: [model_name, engine_label]})
        self._lock = threading.Lock()
        self._server: Any = None
        self.log_lines: list[str] = []

    def observe(self, stats_dicts: list[dict[str, Any]]) -> None:
        """Observe worker stats dicts (as they arrive in SchedulerStats)."""
        if not stats_dicts:
            return
        with self._lock:
            acc = None
            for data in stats_dicts:
                self.prom.observe(data, 0)
                # vLLM rebuilds stats from freshly deserialized dicts; aggregate()
                # extends lists in place, so never hand it the caller's dict.
                stats = self.connector_cls.build_kv_connector_stats(copy.deepcopy(data))
                acc = stats if acc is None else acc.aggregate(stats)
            if acc is not None and not acc.is_empty():
                line = ", ".join(f"{k}={v}" for k, v in acc.reduce().items())
                self.log_lines.append(f"KV Transfer metrics: {line}")

    def observe_workers(self, per_worker: list[list[dict[str, Any]]]) -> dict[str, Any] | None:
        """Observe stats of several TP/PP workers the way vLLM does: aggregated first.

        vLLM's engine core merges the workers' connector stats of a step with the
        stats class's `aggregate()` (`KVOutputAggregator`) and ships one dict;
        our ranks step independently, so everything drained from them in one
        round counts as one step. Returns the dict that was observed.
        """
        merged = aggregate_worker_stats(self.connector_cls, [d for w in per_worker for d in w])
        if merged is not None:
            self.observe([merged])
        return merged

    def exposition(self, openmetrics: bool = False) -> str:
        """The /metrics text: Prometheus text format, or OpenMetrics (with exemplars)."""
        with self._lock:
            if openmetrics:
                # What a Prometheus 3 scrape gets (names kept; see the README's
                # Prometheus 2.x note for the `vllm_` renaming of older scrapers).
                return generate_openmetrics(self.registry, escaping=ALLOWUTF8).decode()
            return generate_latest(self.registry).decode()

    def sample(self, name: str, labels: dict[str, str] | None = None) -> float:
        """Current value of one sample (0.0 when absent), like client_python tests."""
        value = self.registry.get_sample_value(name, {"model_name": MODEL_NAME, "engine": "0",
                                                      **(labels or {})})
        return 0.0 if value is None else value

    def serve(self, port: int = 0, addr: str = "127.0.0.1") -> int:
        """Serve /metrics on a real HTTP port; returns the port."""
        server, _thread = start_http_server(port, addr=addr, registry=self.registry)
        self._server = server
        return server.server_address[1]

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


def aggregate_worker_stats(connector_cls: Any, dicts: list[dict[str, Any]]) -> dict[str, Any] | None:
    """One stats dict from many workers' dicts, with the connector's own `aggregate()`."""
    acc = None
    for data in dicts:
        stats = connector_cls.build_kv_connector_stats(copy.deepcopy(data))
        acc = stats if acc is None else acc.aggregate(stats)
    return None if acc is None or acc.is_empty() else acc.to_dict()


def frontend_for(spec: Any) -> Frontend:
    """A front end for the engine described by an `EngineSpec` (fork or stock class)."""
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    from harness.config import connector_settings

    name, module_path = connector_settings(spec)
    kv = KVTransferConfig(kv_connector=name, kv_connector_module_path=module_path,
                          kv_role=spec.kv_role, engine_id=spec.engine_id)
    return Frontend(KVConnectorFactory.get_connector_class(kv), kv)

"""`NixlPushConnector`: vLLM's push connector class with our worker, stats and metrics.

vLLM loads it with `kv_connector_module_path="connector"` and
`kv_connector="NixlPushConnector"` (the literal name vLLM and routers match to
select push mode). The scheduler role is `ObservedPushScheduler` (vLLM's, plus the
request trace context handed to workers); the worker role builds
`ObservedPushWorker` directly, never a stock worker first.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import (
    NixlBaseConnector,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import (
    NixlPushConnector as StockNixlPushConnector,
)

from connector.glue.scheduler import ObservedPushScheduler
from connector.glue.worker import ObservedPushWorker
from connector.telemetry.prometheus import ObservedPromMetrics
from connector.telemetry.stats import ObservedNixlStats

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

CONNECTOR_NAME = "NixlPushConnector"


class ConnectorConfigError(RuntimeError):
    """A configuration problem that prevents the connector from starting."""


def check_nixl_available() -> None:
    """Fail early, with the fix, when the NIXL Python package is missing."""
    if getattr(base_worker, "NixlWrapper", None) is None:
        raise ConnectorConfigError(
            "NIXL is not installed in this environment, so NixlPushConnector cannot "
            "create its transfer agent. Install it with `pip install nixl==1.5.1` "
            "(or this project's `make venv`)."
        )


def check_connector_config(vllm_config: VllmConfig) -> None:
    kv = vllm_config.kv_transfer_config
    if kv is None:
        raise ConnectorConfigError("NixlPushConnector needs --kv-transfer-config")
    if kv.kv_connector != CONNECTOR_NAME:
        raise ConnectorConfigError(
            f"kv_connector={kv.kv_connector!r} with kv_connector_module_path='connector': "
            f"this module only provides {CONNECTOR_NAME!r}; set "
            f'"kv_connector":"{CONNECTOR_NAME}" (push mode is selected by that name).'
        )
    if kv.engine_id is None:
        raise ConnectorConfigError("kv_transfer_config.engine_id must be set for push mode")


class NixlPushConnector(StockNixlPushConnector):
    """vLLM's push connector with the observed worker. See module docstring."""

    worker_cls = ObservedPushWorker
    scheduler_cls = ObservedPushScheduler

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig | None = None):
        check_connector_config(vllm_config)
        # Skip the stock push __init__ (it would build a stock worker) and run
        # the shared base set-up, then build our classes.
        NixlBaseConnector.__init__(self, vllm_config, role, kv_cache_config)
        if vllm_config.parallel_config.decode_context_parallel_size > 1:
            raise ValueError("NixlPushConnector does not support decode_context_parallel_size > 1.")
        self.connector_scheduler = None
        self.connector_worker = None
        if role == KVConnectorRole.SCHEDULER:
            self.connector_scheduler = self.scheduler_cls(vllm_config, self.engine_id, kv_cache_config)
        elif role == KVConnectorRole.WORKER:
            check_nixl_available()
            self.connector_worker = self.worker_cls(vllm_config, self.engine_id, kv_cache_config)
        else:
            raise ValueError(f"Unsupported KVConnectorRole: {role}")

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> ObservedNixlStats:
        return ObservedNixlStats(data=data) if data is not None else ObservedNixlStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig, metric_types: dict,
                           labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> ObservedPromMetrics:
        return ObservedPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

"""`NixlPushConnector`: vLLM's push connector class with our worker, stats and metrics.

vLLM loads it with `kv_connector_module_path="connector"` and
`kv_connector="NixlPushConnector"` (the literal name vLLM and routers match to
select push mode). vLLM's constructor runs as is; while it runs, the names it builds
its worker and scheduler by point at `ObservedPushWorker` and `ObservedPushScheduler`
(vLLM's scheduler plus the request trace context handed to workers), so no stock
worker (and no second NIXL agent) is ever created.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker
from vllm.distributed.kv_transfer.kv_connector.v1.nixl import connector as stock_connector
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import (
    NixlPushConnector as StockNixlPushConnector,
)

from connector.glue import guard, listener
from connector.glue.guard import SCHEDULER_SEAM, WORKER_SEAM
from connector.glue.host_settings import SETTING_ERRORS, HostSettings
from connector.glue.nixl_telemetry import NixlTelemetryEnvError, check_nixl_telemetry_env
from connector.glue.scheduler import ObservedPushScheduler
from connector.glue.worker import ObservedPushWorker
from connector.integrity.policy import VerifyPolicy
from connector.telemetry.prometheus import ObservedPromMetrics
from connector.telemetry.stats import ObservedNixlStats
from connector.trust import refusals
from connector.trust.secret import load_secret

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
    from vllm.v1.kv_cache_interface import KVCacheConfig

CONNECTOR_NAME = "NixlPushConnector"
_SEAM_LOCK = threading.Lock()
logger = logging.getLogger(__name__)
_warned_nixl_env = False


@contextmanager
def classes_injected(**classes: type) -> Iterator[None]:
    """Point vLLM's module-level class names at ours while a connector is constructed.

    One connector per process and role is the vLLM norm; the lock keeps two of ours
    built on different threads from restoring each other's class.
    """
    with _SEAM_LOCK:
        stock = {name: getattr(stock_connector, name) for name in classes}
        for name, cls in classes.items():
            setattr(stock_connector, name, cls)
        try:
            yield
        finally:
            for name, cls in stock.items():
                setattr(stock_connector, name, cls)


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
    try:
        HostSettings.from_extra_config(kv.get_from_extra_config)
        VerifyPolicy.from_config(kv.get_from_extra_config)  # (the KV check's settings)
        load_secret(kv.get_from_extra_config)  # (the side channel's secret: readable, usable)
    except (*SETTING_ERRORS, ValueError) as exc:
        raise ConnectorConfigError(f"kv_connector_extra_config: {exc}") from None
    check_nixl_env(vllm_config)


def check_nixl_env(vllm_config: VllmConfig) -> None:
    """NIXL's exporter settings (connector/glue/nixl_telemetry.py): stop here, with the
    variable named, rather than inside NIXL's agent constructor; warn once per process."""
    global _warned_nixl_env
    parallel = getattr(vllm_config, "parallel_config", None)
    world = int(getattr(parallel, "tensor_parallel_size", 1) or 1) * int(
        getattr(parallel, "pipeline_parallel_size", 1) or 1)
    try:
        found = check_nixl_telemetry_env(os.environ, world)
    except NixlTelemetryEnvError as exc:
        raise ConnectorConfigError(f"NIXL's telemetry exporter: {exc}") from None
    if found.warnings and not _warned_nixl_env:
        _warned_nixl_env = True
        for warning in found.warnings:
            logger.warning("NIXL's telemetry exporter: %s", warning)


class NixlPushConnector(StockNixlPushConnector):
    """vLLM's push connector with the observed worker. See module docstring."""

    worker_cls = ObservedPushWorker
    scheduler_cls = ObservedPushScheduler

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig | None = None):
        check_connector_config(vllm_config)
        if role == KVConnectorRole.WORKER:
            check_nixl_available()
        # vLLM's own constructor runs unchanged; it builds its worker and scheduler by the
        # module-level names `NixlPushConnectorWorker`/`...Scheduler`, pointed at ours meanwhile.
        with classes_injected(**{WORKER_SEAM: self.worker_cls, SCHEDULER_SEAM: self.scheduler_cls}):
            super().__init__(vllm_config, role, kv_cache_config)
        if role == KVConnectorRole.WORKER and not isinstance(self.connector_worker, self.worker_cls):
            raise ConnectorConfigError(
                "vLLM's NixlPushConnector no longer builds its worker through the module-level "
                f"name {WORKER_SEAM!r}, so the observed worker was not installed; this vLLM "
                "release is not supported by this connector version.")
        if role == KVConnectorRole.SCHEDULER and not isinstance(self.connector_scheduler,
                                                                self.scheduler_cls):
            raise ConnectorConfigError(
                f"vLLM's NixlPushConnector no longer builds its scheduler through {SCHEDULER_SEAM!r}; "
                "this vLLM release is not supported by this connector version.")

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        if self.connector_worker is not None:
            return super().get_kv_connector_stats()
        # Scheduler process: what its side-channel listener dropped, and (D) the
        # requests waiting for a remote prefill (vLLM aggregates this with the workers'
        # stats each step).
        scheduler = getattr(self, "connector_scheduler", None)
        waiting = scheduler.remote_prefills_waiting() if scheduler is not None else None
        rejected = listener.drain_rejected() if listener.pending_rejections else None
        refused = refusals.drain() if refusals.pending else None
        if waiting is None and not rejected and not refused:  # the usual step
            return None
        stats = ObservedNixlStats()
        if rejected:
            stats.record_side_channel_rejected(rejected)
        if refused:
            stats.record_auth_refusals(refused)
        if waiting is not None:
            stats.set_remote_prefills(*waiting)
        return stats

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> ObservedNixlStats:
        return ObservedNixlStats(data=data) if data is not None else ObservedNixlStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig, metric_types: dict,
                           labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> ObservedPromMetrics:
        return ObservedPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues,
                                   degraded=guard.degraded)

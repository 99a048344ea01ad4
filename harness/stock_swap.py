"""Turn a running fork engine into a stock one and back, in place (benchmarks only).

Two engine processes started alike can differ by 10-20% in CPU per request for
their whole life, whatever runs in them, so comparing a stock pair with a fork
pair cannot resolve a few percent. A fork engine can instead run vLLM's own code
paths for a while: every object the fork replaced or wrapped is given back its
stock class or its unwrapped value, and vLLM's methods, looked up on the object
at every call, then run exactly as they do in a stock engine (the writer thread
included, which calls through `self`). Swapped back, the fork's overrides run
again. Batches of both, alternated in the same processes, pair up exactly.

Only between batches: nothing may be in flight (no pending push, receive or
handshake), which the benchmarks guarantee by waiting for every request of a batch.
What stays of the fork in stock mode is process state, not per-request work: its
side-channel listener thread (busy only during handshakes) and, when tracing is
configured, an idle span exporter thread.
"""

from __future__ import annotations

import queue
from collections import defaultdict
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import NixlPushConnector
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.push_scheduler import (
    NixlPushConnectorScheduler,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.push_worker import NixlPushConnectorWorker
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.stats import NixlKVConnectorStats

from connector.glue.compat import RemoteAgentTable
from connector.glue.connector import NixlPushConnector as ForkConnector
from connector.glue.nixl_probe import NixlAgentProbe
from connector.glue.receive import NotifInbox
from connector.glue.scheduler import ObservedPushScheduler
from connector.glue.worker import ObservedPushWorker
from connector.telemetry.stats import ObservedNixlStats
from connector.vocabulary import OUR_STAT_KEYS


class StockSwap:
    """The fork's objects of one engine, and their stock counterparts."""

    def __init__(self, worker_connector: Any, scheduler_connector: Any, call_log: Any):
        if not isinstance(worker_connector, ForkConnector):
            raise TypeError("only a fork engine can be swapped to stock")
        self._connectors = [c for c in (worker_connector, scheduler_connector) if c is not None]
        self._worker = worker_connector.connector_worker
        self._scheduler = getattr(scheduler_connector, "connector_scheduler", None)
        self._call_log = call_log  # the harness's NIXL call log, wrapping the fork's probe
        self.stock = False

    def to_stock(self) -> None:
        if self.stock:
            return
        w = self._worker
        w.__class__ = NixlPushConnectorWorker
        w.xfer_stats.__class__ = NixlKVConnectorStats
        w._pending_completion_notifs.__class__ = queue.Queue
        w._remote_agents = defaultdict(dict, w._remote_agents)
        probe = self._call_log._agent
        if isinstance(probe, NixlAgentProbe):
            object.__setattr__(self._call_log, "_agent", probe._agent)
            self._probe = probe
        if isinstance(self._scheduler, ObservedPushScheduler):
            self._scheduler.__class__ = NixlPushConnectorScheduler
        for conn in self._connectors:
            conn.__class__ = NixlPushConnector
        self.stock = True

    def to_fork(self) -> None:
        if not self.stock:
            return
        w = self._worker
        w.__class__ = ObservedPushWorker
        stats = w.xfer_stats
        stats.__class__ = ObservedNixlStats
        for key in OUR_STAT_KEYS:  # (vLLM's reset made a dict of its own keys only)
            stats.data.setdefault(key, [])
        stats._has_ours = stats._scan_ours()
        w._pending_completion_notifs.__class__ = NotifInbox
        w._remote_agents = RemoteAgentTable(w._remote_agents)
        if getattr(self, "_probe", None) is not None:
            object.__setattr__(self._call_log, "_agent", self._probe)
        if self._scheduler is not None and type(self._scheduler) is NixlPushConnectorScheduler:
            self._scheduler.__class__ = ObservedPushScheduler
        for conn in self._connectors:
            conn.__class__ = ForkConnector
        self.stock = False

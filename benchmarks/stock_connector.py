"""vLLM's own `NixlPushConnector`, built under the same two deployment settings as the fork.

For `python -m benchmarks overhead` only: a stock engine pair on a shared 2-core host would
otherwise spin a core per worker in NIXL's progress thread and put both workers on
the same core (see connector/glue/host_settings.py), and the
benchmark would measure that instead of the connectors. Nothing else of the fork is
here: vLLM's worker, scheduler, stats and metrics, unchanged.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import (
    NixlPushConnector as StockNixlPushConnector,
)

from connector.glue.host_settings import HostSettings


class NixlPushConnector(StockNixlPushConnector):
    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None):
        host = HostSettings.from_extra_config(vllm_config.kv_transfer_config.get_from_extra_config)
        with host.applied():
            super().__init__(vllm_config, role, kv_cache_config)

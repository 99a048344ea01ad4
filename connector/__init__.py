"""Observability-first fork of vLLM's NIXL push connector.

Load it in vLLM with
`--kv-transfer-config '{"kv_connector":"NixlPushConnector","kv_connector_module_path":"connector",...}'`.
"""

from __future__ import annotations

from typing import Any

__all__ = ["NixlPushConnector"]


def __getattr__(name: str) -> Any:
    # Imported lazily so `connector.vocabulary` (dashboards, rules) needs no vLLM.
    if name == "NixlPushConnector":
        from connector.glue.connector import NixlPushConnector

        return NixlPushConnector
    if name[:1].isupper() and "Connector" in name:
        raise AttributeError(
            f"connector has no {name!r}: this package provides only 'NixlPushConnector'. "
            'Use --kv-transfer-config \'{"kv_connector":"NixlPushConnector",'
            '"kv_connector_module_path":"connector",...}\''
        )
    raise AttributeError(f"module 'connector' has no attribute {name!r}")

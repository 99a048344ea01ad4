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
        try:
            from connector.glue.connector import NixlPushConnector
        except ImportError as exc:
            # A vLLM that moved or renamed a class we import fails here, before the
            # start-up guard can run: say which vLLM and which range was tested.
            from connector.glue.guard import import_failure_message

            raise ImportError(import_failure_message(exc)) from exc
        return NixlPushConnector
    if name[:1].isupper() and "Connector" in name:
        raise AttributeError(
            f"connector has no {name!r}: this package provides only 'NixlPushConnector'. "
            'Use --kv-transfer-config \'{"kv_connector":"NixlPushConnector",'
            '"kv_connector_module_path":"connector",...}\''
        )
    raise AttributeError(f"module 'connector' has no attribute {name!r}")

"""Tolerate signature drift of the vLLM methods we override (0.32 -> 0.33 -> later).

`_ensure_handshake` grew `dcp_size` and later `pcp_size`; callers pass the tail
positionally in some releases and by keyword in others. We bind whatever arrives
against the installed base signature instead of hard-coding one release's order.
"""

from __future__ import annotations

import functools
import inspect
import threading
from collections import defaultdict
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker import (
    NixlBaseConnectorWorker,
)


def _optional_param_names(func: Any, skip: int) -> tuple[str, ...]:
    params = list(inspect.signature(func).parameters)
    return tuple(params[skip:])


# self, engine_id, host, port, tp_size -> then the optional tail.
ENSURE_HANDSHAKE_TAIL = _optional_param_names(NixlBaseConnectorWorker._ensure_handshake, 5)


def bind_handshake_tail(args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """Name the optional `_ensure_handshake` arguments of the installed vLLM."""
    if len(args) > len(ENSURE_HANDSHAKE_TAIL):
        raise TypeError(
            f"_ensure_handshake got {len(args)} optional positional arguments; the "
            f"installed vLLM defines {ENSURE_HANDSHAKE_TAIL}"
        )
    bound = dict(zip(ENSURE_HANDSHAKE_TAIL, args, strict=False))
    bound.update(kwargs)
    return bound


def accepted(func: Any, **named: Any) -> dict[str, Any]:
    """The subset of `named` that `func`'s signature accepts.

    `add_remote_agent` and `_add_notif_only_remote_agent` gained and lost
    `remote_dcp_size` (and later `pcp` arguments) across releases; we pass what we
    know by name and let the installed signature decide what it takes.
    """
    names = _param_names(func)
    if names is None:
        return named
    return {k: v for k, v in named.items() if k in names}


@functools.cache
def _param_names(func: Any) -> frozenset[str] | None:
    """Parameter names of `func` (None when it takes **kwargs); inspected once."""
    params = inspect.signature(func).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return None
    return frozenset(params)


class RemoteAgentTable(defaultdict):
    """vLLM's `_remote_agents` map, able to hide one engine from one thread.

    vLLM's full `add_remote_agent` returns early when the peer's agent is already
    known, which is exactly the case when a notification-only connection must be
    upgraded to a full one. During an upgrade the handshake thread hides that
    engine from its own `.get()` lookups, so the full path runs; every other thread
    (the writer sending PUSH_REG, the main thread sending heartbeats) still sees the
    connection and keeps using it.
    """

    def __init__(self, existing: dict | None = None):
        super().__init__(dict)
        if existing:
            self.update(existing)
        self._hidden = threading.local()

    def hide_from_this_thread(self, engine_id: str | None) -> None:
        self._hidden.engine_id = engine_id

    def get(self, key: Any, default: Any = None) -> Any:
        if key is not None and getattr(self._hidden, "engine_id", None) == key:
            return default
        return super().get(key, default)

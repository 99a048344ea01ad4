"""The two leg bodies of one disaggregated request (pure functions, no I/O).

P leg: the client's body, non-streaming, one output token, `do_remote_decode`.
D leg: the client's body as sent (streaming if asked), `do_remote_prefill` and P's
coordinates. Both carry the same `transfer_id`; the caller sends both with the same
`X-Request-Id` (vLLM 0.32 pairs the legs by it; newer vLLM by `transfer_id`).
"""

from __future__ import annotations

import json
from typing import Any

from connector.router.config import PrefillTarget
from connector.vocabulary import ROUTE_CHAT, ROUTE_COMPLETIONS

COMPLETIONS = ROUTE_COMPLETIONS
CHAT = ROUTE_CHAT
# The field that must be present per route (what the engine generates from).
_INPUT_FIELD = {COMPLETIONS: "prompt", CHAT: "messages"}


class BadRequest(ValueError):
    """The client's body cannot be routed; the message is the reason returned with 400."""


def parse_body(raw: bytes, route: str) -> dict[str, Any]:
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise BadRequest(f"body is not valid JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise BadRequest("body must be a JSON object")
    field = _INPUT_FIELD[route]
    if field not in body:
        raise BadRequest(f"'{field}' is required")
    if "kv_transfer_params" in body:
        raise BadRequest("'kv_transfer_params' is set by the router; do not send it")
    if not isinstance(body.get("stream", False), bool):
        raise BadRequest("'stream' must be true or false")
    if body.get("n", 1) != 1:
        raise BadRequest("'n' other than 1 is not supported by the disaggregated path")
    return body


def prefill_body(body: dict[str, Any], route: str, transfer_id: str) -> dict[str, Any]:
    out = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
    out["max_tokens"] = 1
    if route == CHAT:
        out["max_completion_tokens"] = 1
    out["kv_transfer_params"] = {"do_remote_decode": True, "do_remote_prefill": False,
                                 "transfer_id": transfer_id}
    return out


def decode_body(body: dict[str, Any], prefill: PrefillTarget, request_id: str,
                transfer_id: str) -> dict[str, Any]:
    out = dict(body)
    out["kv_transfer_params"] = {"do_remote_prefill": True, "do_remote_decode": False,
                                 **prefill.remote_params(), "remote_request_id": request_id,
                                 "transfer_id": transfer_id}
    return out


def error_body(status: int, message: str, kind: str) -> dict[str, Any]:
    """OpenAI-style error object, the shape vLLM itself answers with."""
    return {"error": {"message": message, "type": kind, "code": status}}

"""A push-aware P/D router for `NixlPushConnector` engines (the project's reference router).

Push mode needs both legs of a request in flight at once: P prefills and pushes,
D allocates blocks and registers them with P (PUSH_REG). The router fires both legs
concurrently with the same `X-Request-Id` and `kv_transfer_params.transfer_id`, tells
D where P's side channel is, cancels D when P fails, proxies D's answer (SSE when the
client asks `stream: true`) and joins both legs into one trace.

    python -m connector.router --prefill URL,engine_id=ID,side_channel=HOST:PORT --decode URL

Needs the `router` extra (fastapi, httpx, uvicorn; vLLM already depends on all three).
"""

from connector.router.config import PrefillTarget, RouterConfig

__all__ = ["PrefillTarget", "RouterConfig"]

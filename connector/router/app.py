"""The router's HTTP app: both legs at once, D's answer back, clean errors.

Error contract (bodies are OpenAI-style `{"error": {"message", "type", "code"}}`):
- bad body -> 400 with the reason, no leg is sent;
- P or D answers 4xx -> that status and the engine's own body (the client's fault);
- P or D answers 5xx -> 502 naming the leg and its status;
- P or D unreachable / times out -> 503 naming the leg and the cause.
When P fails, the D leg is cancelled (its connection closed, so vLLM aborts the request
instead of waiting out its KV lease); when D fails first, the P leg is cancelled too.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from connector.router import legs
from connector.router.config import PrefillTarget, RouterConfig
from connector.router.tracing import TRACE_HEADERS, RouterTracing
from connector.vocabulary import SPAN_ROUTER_REQUEST, RouterAttr, RouterLeg, router_leg_span_name

_PROPAGATOR = TraceContextTextMapPropagator()
_LOG = logging.getLogger("connector.router")


@dataclass
class LegResult:
    """What one leg came back with; `error` set when it never got an HTTP answer."""

    leg: RouterLeg
    status: int = 0
    body: bytes = b""
    error: str = ""

    @property
    def ok(self) -> bool:
        return not self.error and 200 <= self.status < 300

    def error_type(self) -> str:
        return "" if self.ok else (self.error.split(":", 1)[0] if self.error else "http_error")

    def failure(self) -> Response:
        """The response the client gets for this failed leg (also logged: the client's
        error body is all a user would otherwise have)."""
        _LOG.warning("%s leg failed: %s", self.leg.value, self.error or f"HTTP {self.status}")
        if self.error:
            return _error(503, f"{self.leg.value} leg unreachable: {self.error}", "upstream_unavailable")
        if 400 <= self.status < 500:
            return Response(self.body, status_code=self.status, media_type="application/json")
        detail = self.body[:300].decode(errors="replace")
        return _error(502, f"{self.leg.value} leg failed with HTTP {self.status}: {detail}", "upstream_error")


def _error(status: int, message: str, kind: str) -> JSONResponse:
    return JSONResponse(legs.error_body(status, message, kind), status_code=status)


def _sse_error(message: str) -> bytes:
    """An error event in the stream (headers are already sent, so no status code can change)."""
    _LOG.warning("%s", message)
    return f"data: {json.dumps(legs.error_body(502, message, 'upstream_error'))}\n\n".encode()


class _Span:
    """A span or nothing: the router works the same with tracing off."""

    def __init__(self, tracer: trace.Tracer | None, name: str, kind: SpanKind, parent: Any,
                 attributes: dict[str, Any]):
        self.span = tracer.start_span(name, context=parent, kind=kind, attributes=attributes) \
            if tracer is not None else None

    def context(self) -> Any:
        return trace.set_span_in_context(self.span) if self.span is not None else None

    def headers(self, fallback: dict[str, str]) -> dict[str, str]:
        if self.span is None:
            return dict(fallback)
        carrier: dict[str, str] = {}
        _PROPAGATOR.inject(carrier, context=self.context())
        return carrier

    def end(self, status: int = 0, error: str = "") -> None:
        if self.span is None:
            return
        if status:
            self.span.set_attribute(RouterAttr.HTTP_STATUS, status)
        if error or status >= 500:
            self.span.set_attribute(RouterAttr.ERROR_TYPE, error or str(status))
            self.span.set_status(Status(StatusCode.ERROR, error))
        self.span.end()


class Router:
    """Round-robin over P and D targets; one `httpx.AsyncClient` for all legs."""

    def __init__(self, config: RouterConfig, tracing: RouterTracing | None = None):
        self.config = config
        self.tracing = tracing or RouterTracing()
        self._prefill = itertools.cycle(config.prefill)
        self._decode = itertools.cycle(config.decode)
        self.client: httpx.AsyncClient | None = None

    async def start(self) -> None:
        timeout = httpx.Timeout(self.config.request_timeout_s, connect=self.config.connect_timeout_s)
        self.client = httpx.AsyncClient(timeout=timeout, limits=httpx.Limits(max_keepalive_connections=32))

    async def close(self) -> None:
        if self.client is not None:
            await self.client.aclose()
        self.tracing.shutdown()

    def pick(self) -> tuple[PrefillTarget, str]:
        return next(self._prefill), next(self._decode)

    # ------------------------------------------------------------------ one request
    async def handle(self, request: Request, route: str) -> Response:
        incoming = {k: request.headers[k] for k in TRACE_HEADERS if k in request.headers}
        parent = _PROPAGATOR.extract(incoming) if incoming else None
        request_id = request.headers.get("x-request-id") or f"router-{uuid.uuid4().hex}"
        server = _Span(self.tracing.tracer, SPAN_ROUTER_REQUEST, SpanKind.SERVER, parent,
                       {RouterAttr.HTTP_ROUTE: route, RouterAttr.HTTP_METHOD: "POST",
                        RouterAttr.REQUEST_ID: request_id})
        try:
            body = legs.parse_body(await request.body(), route)
        except legs.BadRequest as exc:
            server.end(400, "bad_request")
            return _error(400, str(exc), "invalid_request_error")
        prefill, decode_url = self.pick()
        transfer_id = request_id
        stream = bool(body.get("stream", False))
        if server.span is not None:
            server.span.set_attributes({RouterAttr.STREAM: stream, RouterAttr.TRANSFER_ID: transfer_id,
                                        RouterAttr.PREFILL_ENGINE_ID: prefill.engine_id})
        p_body = legs.prefill_body(body, route, transfer_id)
        d_body = legs.decode_body(body, prefill, request_id, transfer_id)
        p_leg = self._leg_span(server, RouterLeg.PREFILL, prefill.url + route)
        d_leg = self._leg_span(server, RouterLeg.DECODE, decode_url + route)
        base = {"X-Request-Id": request_id, "Content-Type": "application/json"}
        p_task = asyncio.create_task(self._post(RouterLeg.PREFILL, prefill.url + route, p_body,
                                                {**base, **p_leg.headers(incoming)}))
        if stream:
            return await self._stream(server, p_task, p_leg, d_leg, decode_url + route, d_body,
                                      {**base, **d_leg.headers(incoming)})
        d_task = asyncio.create_task(self._post(RouterLeg.DECODE, decode_url + route, d_body,
                                                {**base, **d_leg.headers(incoming)}))
        try:
            p, d, failed = await self._both(p_task, d_task)
        except BaseException:  # client went away: stop both legs
            for t in (p_task, d_task):
                t.cancel()
            p_leg.end(error="cancelled")
            d_leg.end(error="cancelled")
            server.end(499, "client_disconnected")
            raise
        p_leg.end(p.status, p.error_type())
        d_leg.end(d.status, d.error_type())
        if failed is None:  # D answered: the KV arrived
            response: Response = Response(d.body, status_code=d.status, media_type="application/json")
        else:
            response = failed.failure()
        server.end(response.status_code, "" if failed is None else f"{failed.leg.value}_failed")
        return response

    def _leg_span(self, server: _Span, leg: RouterLeg, url: str) -> _Span:
        return _Span(self.tracing.tracer, router_leg_span_name(leg), SpanKind.CLIENT, server.context(),
                     {RouterAttr.LEG: leg.value, RouterAttr.URL: url, RouterAttr.HTTP_METHOD: "POST"})

    async def _both(self, p_task: asyncio.Task[LegResult], d_task: asyncio.Task[LegResult]
                    ) -> tuple[LegResult, LegResult, LegResult | None]:
        """Both legs' results and the one that failed first (None when D succeeded).

        A failed leg cancels the other one still in flight. Once D has answered the
        request is served, whatever P's answer says.
        """
        pending = {p_task, d_task}
        while pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task, other, leg in ((p_task, d_task, RouterLeg.DECODE), (d_task, p_task, RouterLeg.PREFILL)):
                if task in done and not task.result().ok and not other.done():
                    other.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await other
                    stopped = LegResult(leg, error="cancelled: the other leg failed")
                    results = (task.result(), stopped) if task is p_task else (stopped, task.result())
                    return results[0], results[1], task.result()
        p, d = p_task.result(), d_task.result()
        return p, d, None if d.ok else (p if not p.ok else d)

    async def _post(self, leg: RouterLeg, url: str, body: dict[str, Any],
                    headers: dict[str, str]) -> LegResult:
        assert self.client is not None
        try:
            resp = await self.client.post(url, content=json.dumps(body), headers=headers)
        except httpx.HTTPError as exc:
            return LegResult(leg, error=f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__)
        return LegResult(leg, status=resp.status_code, body=resp.content)

    # ------------------------------------------------------------------ streaming
    async def _stream(self, server: _Span, p_task: asyncio.Task[LegResult], p_leg: _Span, d_leg: _Span,
                      url: str, body: dict[str, Any], headers: dict[str, str]) -> Response:
        assert self.client is not None
        d_request = self.client.build_request("POST", url, content=json.dumps(body), headers=headers)
        d_task = asyncio.create_task(self.client.send(d_request, stream=True))
        done, _ = await asyncio.wait({p_task, d_task}, return_when=asyncio.FIRST_COMPLETED)
        if p_task in done and not p_task.result().ok:
            d_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, httpx.HTTPError):
                resp = await d_task
                await resp.aclose()
            p = p_task.result()
            p_leg.end(p.status, p.error or "http_error")
            d_leg.end(error="cancelled")
            response = p.failure()
            server.end(response.status_code, "prefill_failed")
            return response
        try:
            d_resp = await d_task
        except httpx.HTTPError as exc:
            p_task.cancel()
            d = LegResult(RouterLeg.DECODE, error=f"{type(exc).__name__}: {exc}")
            p_leg.end(error="cancelled")
            d_leg.end(error=d.error)
            response = d.failure()
            server.end(response.status_code, "decode_failed")
            return response
        if d_resp.status_code != 200:
            d = LegResult(RouterLeg.DECODE, status=d_resp.status_code, body=await d_resp.aread())
            await d_resp.aclose()
            p_task.cancel()
            p_leg.end(error="cancelled")
            d_leg.end(d.status, "http_error")
            response = d.failure()
            server.end(response.status_code, "decode_failed")
            return response
        media = d_resp.headers.get("content-type", "text/event-stream")
        return StreamingResponse(self._pump(server, p_task, p_leg, d_leg, d_resp), media_type=media)

    async def _pump(self, server: _Span, p_task: asyncio.Task[LegResult], p_leg: _Span, d_leg: _Span,
                    d_resp: httpx.Response) -> AsyncIterator[bytes]:
        """D's SSE bytes as they come; an SSE error event and the end if P fails first."""
        chunks = d_resp.aiter_raw().__aiter__()
        error = ""
        nxt: asyncio.Future[Any] | None = None
        try:
            while True:
                # One read of D's stream at a time: a pending read is kept across turns
                # (starting another while it runs raises "anext(): ... already running").
                if nxt is None:
                    nxt = asyncio.ensure_future(chunks.__anext__())
                waits: set[asyncio.Future[Any]] = {nxt}
                if not p_task.done():
                    waits.add(p_task)
                await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
                if p_task.done() and not nxt.done() and not p_task.result().ok:
                    nxt.cancel()
                    p = p_task.result()
                    error = "prefill_failed"
                    yield _sse_error(f"prefill leg failed: {p.error or f'HTTP {p.status}'}")
                    return
                if not nxt.done():
                    continue  # P finished fine; keep waiting for D's next chunk
                done, nxt = nxt, None
                try:
                    yield done.result()
                except StopAsyncIteration:
                    return
                except httpx.HTTPError as exc:
                    error = "decode_failed"
                    yield _sse_error(f"decode leg failed: {type(exc).__name__}: {exc}")
                    return
        finally:
            if nxt is not None and not nxt.done():
                nxt.cancel()
            await d_resp.aclose()
            if not p_task.done():
                p_task.cancel()
                p_leg.end(error="cancelled")
            else:
                p = p_task.result()
                p_leg.end(p.status, "" if p.ok else (p.error or "http_error"))
            d_leg.end(d_resp.status_code, error)
            server.end(200, error)


def build_app(config: RouterConfig, tracing: RouterTracing | None = None) -> FastAPI:
    router = Router(config, tracing)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await router.start()
        try:
            yield
        finally:
            await router.close()

    app = FastAPI(title="nixl-push router", lifespan=lifespan)
    app.state.router = router

    @app.post(legs.COMPLETIONS)
    async def completions(request: Request) -> Response:
        return await router.handle(request, legs.COMPLETIONS)

    @app.post(legs.CHAT)
    async def chat(request: Request) -> Response:
        return await router.handle(request, legs.CHAT)

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"prefill": [p.url for p in config.prefill], "decode": list(config.decode)}

    @app.get("/v1/models")
    async def models() -> Response:
        assert router.client is not None
        url = config.decode[0] + "/v1/models"
        try:
            resp = await router.client.get(url)
        except httpx.HTTPError as exc:
            return _error(503, f"decode unreachable: {exc}", "upstream_unavailable")
        return Response(resp.content, status_code=resp.status_code, media_type="application/json")

    return app

"""The router's HTTP app: both legs at once, D's answer back, clean errors, its own /metrics.

Error contract (bodies are OpenAI-style `{"error": {"message", "type", "code"}}`):
- bad body -> 400 with the reason, no leg is sent;
- P or D answers 4xx -> that status and the engine's own body (the client's fault);
- P or D answers 5xx -> 502 naming the leg and its status;
- P or D unreachable / times out -> 503 naming the leg and the cause.
When P fails, the D leg is cancelled (its connection closed, so vLLM aborts the request
instead of waiting out its KV lease); when D fails first, the P leg is cancelled too; when
the client goes away, both are. `GET /metrics` serves the router's own metrics
(connector/router/metrics.py), OpenMetrics with exemplars when the scraper asks for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import anyio
import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from connector.router import legs
from connector.router.config import PrefillTarget, RouterConfig
from connector.router.metrics import RequestRecord, RouterMetrics
from connector.router.tracing import TRACE_HEADERS, RouterTracing
from connector.vocabulary import (
    ROUTER_METRICS_PATH,
    SPAN_ROUTER_REQUEST,
    LegCancel,
    LegOutcome,
    RouterAttr,
    RouterLeg,
    RouterOutcome,
    router_leg_span_name,
)

_PROPAGATOR = TraceContextTextMapPropagator()
_LOG = logging.getLogger("connector.router")
CANCELLED = "cancelled"


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

    def outcome(self) -> LegOutcome:
        if self.ok:
            return LegOutcome.OK
        return LegOutcome.CANCELLED if self.error.startswith(CANCELLED) else LegOutcome.FAILED

    def failure(self, ids: str = "") -> Response:
        """The response the client gets for this failed leg (also logged, with the
        request's ids: the client's error body is all a user would otherwise have)."""
        _LOG.warning("%s leg failed%s: %s", self.leg.value, ids, self.error or f"HTTP {self.status}")
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
        self.ended = False

    def context(self) -> Any:
        return trace.set_span_in_context(self.span) if self.span is not None else None

    def headers(self, fallback: dict[str, str]) -> dict[str, str]:
        if self.span is None:
            return dict(fallback)
        carrier: dict[str, str] = {}
        _PROPAGATOR.inject(carrier, context=self.context())
        return carrier

    def end(self, status: int = 0, error: str = "") -> None:
        if self.span is None or self.ended:
            return
        self.ended = True
        if status:
            self.span.set_attribute(RouterAttr.HTTP_STATUS, status)
        if error or status >= 500:
            self.span.set_attribute(RouterAttr.ERROR_TYPE, error or str(status))
            self.span.set_status(Status(StatusCode.ERROR, error))
        self.span.end()


class _Delivered(Response):
    """Sends `inner`, then awaits `on_done(sent)`: the moment the client has the answer (or
    the connection is gone), whatever the path, so nothing a request holds is left open."""

    def __init__(self, inner: Response, on_done: Callable[[bool], Awaitable[None]]):
        super().__init__(status_code=inner.status_code)
        self.inner, self.on_done = inner, on_done

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        sent = False
        try:
            await self.inner(scope, receive, send)
            sent = True
        finally:
            await self.on_done(sent)
        if self.background is not None:
            await self.background()


class _ClientGone(Exception):
    """The client closed its connection before the answer was ready."""


async def _until_disconnected(request: Request) -> None:
    """Returns when the client's connection closes (the body has already been read)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


@dataclass
class _Exchange:
    """The parts of one request in flight: its spans, its record, its legs."""

    rec: RequestRecord
    server: _Span
    p_leg: _Span
    d_leg: _Span
    p_task: asyncio.Task[LegResult] | None = None
    d_resp: httpx.Response | None = None
    closed: bool = False
    notes: dict[str, Any] = field(default_factory=dict)
    ids: str = ""  # " (request <client id>, transfer <id>)", for log lines

    def span(self, leg: RouterLeg) -> _Span:
        return self.p_leg if leg is RouterLeg.PREFILL else self.d_leg

    def leg_result(self, result: LegResult) -> None:
        """End a leg's span and figures with what it came back with."""
        self.span(result.leg).end(result.status, result.error_type())
        self.rec.leg_done(result.leg, result.outcome())

    def cancel_leg(self, leg: RouterLeg, reason: LegCancel) -> None:
        self.span(leg).end(error=CANCELLED)
        self.rec.leg_cancelled(leg, reason)


class Router:
    """Round-robin over P and D targets; one `httpx.AsyncClient` for all legs."""

    def __init__(self, config: RouterConfig, tracing: RouterTracing | None = None,
                 metrics: RouterMetrics | None = None):
        self.config = config
        self.tracing = tracing or RouterTracing()
        self.metrics = metrics or RouterMetrics()
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
        rec = self.metrics.start(route)
        try:
            response = await self._handle(request, route, rec)
        except BaseException:
            rec.release()
            raise
        if not isinstance(response, _Delivered):
            rec.release()  # (an answer that is still being sent leaves when it is done)
        return response

    async def _handle(self, request: Request, route: str, rec: RequestRecord) -> Response:
        incoming = {k: request.headers[k] for k in TRACE_HEADERS if k in request.headers}
        parent = _PROPAGATOR.extract(incoming) if incoming else None
        request_id = request.headers.get("x-request-id") or f"router-{uuid.uuid4().hex}"
        server = _Span(self.tracing.tracer, SPAN_ROUTER_REQUEST, SpanKind.SERVER, parent,
                       {RouterAttr.HTTP_ROUTE: route, RouterAttr.HTTP_METHOD: "POST",
                        RouterAttr.REQUEST_ID: request_id})
        rec.span = server.span
        try:
            body = legs.parse_body(await request.body(), route)
        except legs.BadRequest as exc:
            server.end(400, RouterOutcome.BAD_REQUEST.value)
            rec.finish(RouterOutcome.BAD_REQUEST)
            return _error(400, str(exc), "invalid_request_error")
        prefill, decode_url = self.pick()
        # Every request gets a transfer id of its own: the engines name (and P matches) the
        # request by it. Clients and gateways reuse X-Request-Id (retries with one key, a
        # copied trace id); used as the transfer id, two requests in flight would share it.
        transfer_id = f"router-{uuid.uuid4().hex}"
        stream = bool(body.get("stream", False))
        rec.stream = stream
        if server.span is not None:
            server.span.set_attributes({RouterAttr.STREAM: stream, RouterAttr.TRANSFER_ID: transfer_id,
                                        RouterAttr.PREFILL_ENGINE_ID: prefill.engine_id})
        p_body = legs.prefill_body(body, route, transfer_id)
        d_body = legs.decode_body(body, prefill, transfer_id, transfer_id)
        ex = _Exchange(rec, server, self._leg_span(server, RouterLeg.PREFILL, prefill.url + route),
                       self._leg_span(server, RouterLeg.DECODE, decode_url + route),
                       ids=f" (request {request_id[:128]}, transfer {transfer_id})")
        # (vLLM 0.32 pairs the two legs by X-Request-Id; newer vLLM by the transfer id.)
        base = {"X-Request-Id": transfer_id, "Content-Type": "application/json"}
        rec.leg_sent(RouterLeg.PREFILL, ex.p_leg.span)
        ex.p_task = asyncio.create_task(self._post(RouterLeg.PREFILL, prefill.url + route, p_body,
                                                   {**base, **ex.p_leg.headers(incoming)}))
        d_headers = {**base, **ex.d_leg.headers(incoming)}
        gone = asyncio.create_task(_until_disconnected(request))
        try:
            if stream:
                return await self._stream(ex, gone, decode_url + route, d_body, d_headers)
            return await self._whole(ex, gone, decode_url + route, d_body, d_headers)
        finally:
            gone.cancel()

    def _leg_span(self, server: _Span, leg: RouterLeg, url: str) -> _Span:
        return _Span(self.tracing.tracer, router_leg_span_name(leg), SpanKind.CLIENT, server.context(),
                     {RouterAttr.LEG: leg.value, RouterAttr.URL: url, RouterAttr.HTTP_METHOD: "POST"})

    def _client_gone(self, ex: _Exchange, tasks: list[asyncio.Future[Any]]) -> Response:
        """Stop every leg still in flight; the client will not read the answer."""
        for task in tasks:
            task.cancel()
        for leg in ex.rec.open_legs():
            ex.cancel_leg(leg, LegCancel.CLIENT_DISCONNECTED)
        ex.server.end(499, RouterOutcome.CLIENT_DISCONNECTED.value)
        ex.rec.finish(RouterOutcome.CLIENT_DISCONNECTED)
        return _error(499, "client disconnected", "client_disconnected")

    # ------------------------------------------------------------------ not streamed
    async def _whole(self, ex: _Exchange, gone: asyncio.Task[None], url: str, body: dict[str, Any],
                     headers: dict[str, str]) -> Response:
        assert ex.p_task is not None
        ex.rec.leg_sent(RouterLeg.DECODE, ex.d_leg.span)
        d_task = asyncio.create_task(self._post(RouterLeg.DECODE, url, body, headers))
        try:
            p, d, failed = await self._both(ex, ex.p_task, d_task, gone)
        except _ClientGone:
            return self._client_gone(ex, [ex.p_task, d_task])
        except BaseException:  # the router itself is stopping: stop both legs
            for t in (ex.p_task, d_task):
                t.cancel()
            ex.p_leg.end(error=CANCELLED)
            ex.d_leg.end(error=CANCELLED)
            ex.server.end(499, RouterOutcome.CLIENT_DISCONNECTED.value)
            raise
        ex.leg_result(p)
        ex.leg_result(d)
        if failed is not None:
            outcome = (RouterOutcome.PREFILL_FAILED if failed.leg is RouterLeg.PREFILL
                       else RouterOutcome.DECODE_FAILED)
            response = failed.failure(ex.ids)
            ex.server.end(response.status_code, outcome.value)
            ex.rec.finish(outcome)
            return response
        async def delivered(sent: bool) -> None:
            # D answered (the KV arrived); the request's span ends once the client has it.
            if sent:  # not streamed: the whole answer is the first token the client sees
                ex.rec.first_token()
                ex.server.end(d.status)
                ex.rec.finish(RouterOutcome.OK)
            else:
                ex.server.end(499, RouterOutcome.CLIENT_DISCONNECTED.value)
                ex.rec.finish(RouterOutcome.CLIENT_DISCONNECTED)

        return _Delivered(Response(d.body, status_code=d.status, media_type="application/json"), delivered)

    async def _both(self, ex: _Exchange, p_task: asyncio.Task[LegResult], d_task: asyncio.Task[LegResult],
                    gone: asyncio.Task[None]) -> tuple[LegResult, LegResult, LegResult | None]:
        """Both legs' results and the one that failed first (None when D succeeded).

        A failed leg cancels the other one still in flight. Once D has answered the
        request is served, whatever P's answer says. Raises _ClientGone if the client
        closes its connection first.
        """
        pending: set[asyncio.Future[Any]] = {p_task, d_task}
        while pending:
            done, _ = await asyncio.wait(pending | {gone}, return_when=asyncio.FIRST_COMPLETED)
            pending -= done
            if gone in done and not (p_task.done() and d_task.done()):
                raise _ClientGone
            for task in (p_task, d_task):
                if task in done and not task.cancelled() and task.result().ok:
                    ex.leg_result(task.result())  # a leg ends when it answers, not when both have
            for task, other, leg in ((p_task, d_task, RouterLeg.DECODE), (d_task, p_task, RouterLeg.PREFILL)):
                if task in done and not task.result().ok and not other.done():
                    other.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await other
                    ex.cancel_leg(leg, LegCancel.OTHER_LEG_FAILED)
                    stopped = LegResult(leg, error=f"{CANCELLED}: the other leg failed")
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
    async def _stream(self, ex: _Exchange, gone: asyncio.Task[None], url: str, body: dict[str, Any],
                      headers: dict[str, str]) -> Response:
        assert self.client is not None and ex.p_task is not None
        p_task = ex.p_task
        d_request = self.client.build_request("POST", url, content=json.dumps(body), headers=headers)
        ex.rec.leg_sent(RouterLeg.DECODE, ex.d_leg.span)
        d_task = asyncio.create_task(self.client.send(d_request, stream=True))
        done, _ = await asyncio.wait({p_task, d_task, gone}, return_when=asyncio.FIRST_COMPLETED)
        if gone in done and not d_task.done():
            response = self._client_gone(ex, [p_task, d_task])
            with contextlib.suppress(asyncio.CancelledError, httpx.HTTPError):
                await (await d_task).aclose()
            return response
        if p_task in done and not p_task.result().ok:
            d_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, httpx.HTTPError):
                resp = await d_task
                await resp.aclose()
            p = p_task.result()
            ex.span(RouterLeg.PREFILL).end(p.status, p.error or "http_error")
            ex.rec.leg_done(RouterLeg.PREFILL, p.outcome())
            ex.cancel_leg(RouterLeg.DECODE, LegCancel.OTHER_LEG_FAILED)
            response = p.failure(ex.ids)
            ex.server.end(response.status_code, RouterOutcome.PREFILL_FAILED.value)
            ex.rec.finish(RouterOutcome.PREFILL_FAILED)
            return response
        try:
            d_resp = await d_task
        except httpx.HTTPError as exc:
            p_task.cancel()
            d = LegResult(RouterLeg.DECODE, error=f"{type(exc).__name__}: {exc}")
            ex.cancel_leg(RouterLeg.PREFILL, LegCancel.OTHER_LEG_FAILED)
            ex.leg_result(d)
            response = d.failure(ex.ids)
            ex.server.end(response.status_code, RouterOutcome.DECODE_FAILED.value)
            ex.rec.finish(RouterOutcome.DECODE_FAILED)
            return response
        if d_resp.status_code != 200:
            d = LegResult(RouterLeg.DECODE, status=d_resp.status_code, body=await d_resp.aread())
            await d_resp.aclose()
            p_task.cancel()
            ex.cancel_leg(RouterLeg.PREFILL, LegCancel.OTHER_LEG_FAILED)
            ex.leg_result(d)
            response = d.failure(ex.ids)
            ex.server.end(response.status_code, RouterOutcome.DECODE_FAILED.value)
            ex.rec.finish(RouterOutcome.DECODE_FAILED)
            return response
        ex.d_resp = d_resp
        media = d_resp.headers.get("content-type", "text/event-stream")
        pump = self._pump(ex, d_resp)

        async def delivered(sent: bool) -> None:
            # The stream's generator ends the request itself; if it never ran, or the
            # connection broke mid-way, it is closed here (its `finally` then runs).
            with contextlib.suppress(Exception):
                await pump.aclose()
            await self._close_stream(ex, RouterOutcome.CLIENT_DISCONNECTED)

        return _Delivered(StreamingResponse(pump, media_type=media), delivered)

    async def _pump(self, ex: _Exchange, d_resp: httpx.Response) -> AsyncIterator[bytes]:
        """D's SSE bytes as they come; an SSE error event and the end if P fails first."""
        assert ex.p_task is not None
        p_task = ex.p_task
        chunks = d_resp.aiter_raw().__aiter__()
        outcome = RouterOutcome.CLIENT_DISCONNECTED  # unless the stream ends otherwise
        nxt: asyncio.Future[Any] | None = None
        p_reported = False
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
                    outcome = RouterOutcome.PREFILL_FAILED
                    yield _sse_error(f"prefill leg failed: {p.error or f'HTTP {p.status}'}")
                    return
                if not p_reported and p_task.done() and p_task.result().ok:
                    # P's leg ends when P answered, not with D's stream (its latency and
                    # outcome; the report at the stream's end is then a no-op).
                    ex.leg_result(p_task.result())
                    p_reported = True
                if not nxt.done():
                    continue  # P finished fine; keep waiting for D's next chunk
                done, nxt = nxt, None
                try:
                    chunk = done.result()
                except StopAsyncIteration:
                    outcome = RouterOutcome.OK
                    return
                except httpx.HTTPError as exc:
                    outcome = RouterOutcome.DECODE_FAILED
                    yield _sse_error(f"decode leg failed: {type(exc).__name__}: {exc}")
                    return
                yield chunk
                ex.rec.first_token()  # (the generator resumes once the chunk was sent)
        finally:
            if nxt is not None and not nxt.done():
                nxt.cancel()
            await self._close_stream(ex, outcome)

    async def _close_stream(self, ex: _Exchange, outcome: RouterOutcome) -> None:
        """End a streamed request once: close D's stream, stop P if it still runs, count it."""
        if ex.closed:
            return
        ex.closed = True
        assert ex.p_task is not None and ex.d_resp is not None
        if not ex.p_task.done():
            ex.p_task.cancel()
            reason = {RouterOutcome.OK: LegCancel.REQUEST_SERVED,
                      RouterOutcome.DECODE_FAILED: LegCancel.OTHER_LEG_FAILED}.get(
                outcome, LegCancel.CLIENT_DISCONNECTED)
            ex.cancel_leg(RouterLeg.PREFILL, reason)
        else:
            ex.leg_result(ex.p_task.result())
        if outcome is RouterOutcome.PREFILL_FAILED:
            ex.cancel_leg(RouterLeg.DECODE, LegCancel.OTHER_LEG_FAILED)
        elif outcome is RouterOutcome.CLIENT_DISCONNECTED:
            ex.cancel_leg(RouterLeg.DECODE, LegCancel.CLIENT_DISCONNECTED)
        else:
            ok = outcome is RouterOutcome.OK
            ex.d_leg.end(ex.d_resp.status_code, "" if ok else outcome.value)
            ex.rec.leg_done(RouterLeg.DECODE, LegOutcome.OK if ok else LegOutcome.FAILED)
        ex.server.end(200 if outcome is not RouterOutcome.CLIENT_DISCONNECTED else 499,
                      "" if outcome is RouterOutcome.OK else outcome.value)
        ex.rec.finish(outcome)
        # Last, and shielded: a cancelled stream (client gone) is cancelled again at every await.
        with anyio.CancelScope(shield=True), contextlib.suppress(Exception):
            await ex.d_resp.aclose()


def build_app(config: RouterConfig, tracing: RouterTracing | None = None,
              metrics: RouterMetrics | None = None) -> FastAPI:
    router = Router(config, tracing, metrics)

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

    @app.get(ROUTER_METRICS_PATH, include_in_schema=False)
    async def metrics(request: Request) -> Response:
        body, content_type = router.metrics.exposition(request.headers.get("accept", ""))
        return Response(body, media_type=content_type)

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


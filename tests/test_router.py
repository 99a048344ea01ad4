"""The push-aware router against small real HTTP engines on loopback.

The engines (tests/support/fake_engines.py) are tiny ASGI apps (uvicorn, real sockets)
that record what arrived and can be told to wait for the other leg, fail, hang until
disconnected or hold their stream after the first event. The router's own /metrics are
read from its registry (`get_sample_value`) and over HTTP. A P
engine that answers only after D's leg has arrived, and a D engine that answers only
after P's leg arrived, prove both legs are in flight at once: a router that sent
them one after the other would time out.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client.openmetrics.parser import (
    text_string_to_metric_families as text_string_to_openmetrics_families,
)
from prometheus_client.parser import text_string_to_metric_families

from connector import vocabulary as V
from connector.router import legs
from connector.router.app import build_app
from connector.router.config import ConfigError, PrefillTarget, RouterConfig
from connector.router.metrics import RouterMetrics
from connector.router.tracing import RouterTracing
from connector.vocabulary import SPAN_ROUTER_REQUEST, RouterLeg, router_leg_span_name
from dashboards import promrun
from harness.poll import wait_until
from tests.support.fake_engines import WAIT_S, Engine, Journal, Served, closed_port_url


class Deployment:
    """P engines, D engines and the router in front of them, all on loopback."""

    def __init__(self, p_modes: list[str], d_modes: list[str], exporter: Any = None,
                 p_urls: list[str] | None = None):
        self.journal = Journal()
        self.servers: list[Served] = []
        self.prefill = []
        for i, mode in enumerate(p_modes):
            srv = self._serve(Engine(f"P{i}", self.journal, mode, waits_for="D"))
            self.prefill.append(PrefillTarget(srv.url, f"prefill-{i}", "127.0.0.1", 5600 + i))
        for url in p_urls or []:
            self.prefill.append(PrefillTarget(url, "prefill-down", "127.0.0.1", 5699))
        decode = [self._serve(Engine(f"D{i}", self.journal, mode, waits_for="P")).url
                  for i, mode in enumerate(d_modes)]
        self.tracing = RouterTracing(exporter=exporter)
        self.metrics = RouterMetrics()
        self.router = self._serve(build_app(RouterConfig(tuple(self.prefill), tuple(decode)), self.tracing,
                                            self.metrics))
        self.client = httpx.Client(base_url=self.router.url, timeout=60)

    def _serve(self, app: Any) -> Served:
        srv = Served(app)
        self.servers.append(srv)
        return srv

    def post(self, body: Any, headers: dict[str, str] | None = None, path: str = "/v1/completions"
             ) -> httpx.Response:
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        return self.client.post(path, content=content, headers=headers or {})

    def close(self) -> None:
        self.journal.release.set()
        self.client.close()
        for srv in reversed(self.servers):
            srv.stop()


@pytest.fixture
def deploy() -> Iterator[Callable[..., Deployment]]:
    made: list[Deployment] = []

    def make(*args: Any, **kwargs: Any) -> Deployment:
        made.append(Deployment(*args, **kwargs))
        return made[-1]

    yield make
    for d in made:
        d.close()


BODY = {"model": "tiny", "prompt": [1, 2, 3, 4, 5], "max_tokens": 3, "temperature": 0}


def test_both_legs_in_flight_at_once_with_shared_ids_and_p_coordinates(deploy):
    dep = deploy(["ok"], ["ok"])
    resp = dep.post(BODY, {"X-Request-Id": "req-42"})
    assert resp.status_code == 200, resp.text
    assert resp.json()["engine"] == "D0"
    events = [e for e in dep.journal.events if e[0] != "connect"]
    first_answer = next(i for i, (e, _) in enumerate(events) if e == "answer")
    assert {n for e, n in events[:first_answer] if e == "arrive"} == {"P0", "D0"}
    p = dep.journal.requests["P0"][0]
    d = dep.journal.requests["D0"][0]
    # The legs carry a transfer id of the router's own, not the client's X-Request-Id.
    tid = p["headers"]["x-request-id"]
    assert tid.startswith("router-") and tid != "req-42"
    assert d["headers"]["x-request-id"] == tid
    assert p["body"]["max_tokens"] == 1 and p["body"]["prompt"] == BODY["prompt"]
    assert p["body"]["kv_transfer_params"] == {"do_remote_decode": True, "do_remote_prefill": False,
                                               "transfer_id": tid}
    assert d["body"]["max_tokens"] == 3
    assert d["body"]["kv_transfer_params"] == {
        "do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "prefill-0",
        "remote_host": "127.0.0.1", "remote_port": 5600, "tp_size": 1, "pp_size": 1,
        "remote_request_id": tid, "transfer_id": tid}


def test_requests_reusing_one_client_id_get_transfer_ids_of_their_own(deploy):
    """Retries with one idempotency key, gateways copying a trace id: the client's id
    may repeat; the engines never see it repeat."""
    dep = deploy(["ok"], ["ok"])
    for _ in range(3):
        assert dep.post(BODY, {"X-Request-Id": "same-client-id"}).status_code == 200
    p_ids = [r["headers"]["x-request-id"] for r in dep.journal.requests["P0"]]
    d_ids = [r["body"]["kv_transfer_params"]["transfer_id"] for r in dep.journal.requests["D0"]]
    assert len(set(p_ids)) == 3 and sorted(p_ids) == sorted(d_ids)


def test_router_generates_a_request_id_when_the_client_sends_none(deploy):
    dep = deploy(["ok"], ["ok"])
    assert dep.post(BODY).status_code == 200
    p, d = dep.journal.requests["P0"][0], dep.journal.requests["D0"][0]
    rid = p["headers"]["x-request-id"]
    assert rid and rid == d["headers"]["x-request-id"] == d["body"]["kv_transfer_params"]["remote_request_id"]


def test_prefill_failure_cancels_the_decode_leg(deploy):
    dep = deploy(["fail"], ["hang"])
    resp = dep.post(BODY)
    assert resp.status_code == 502
    assert "prefill leg failed with HTTP 500" in resp.json()["error"]["message"]
    wait_until(lambda: dep.journal.seen("disconnect", "D0") == 1, "D to see the router hang up", WAIT_S)


def test_prefill_down_gives_503_and_cancels_decode(deploy):
    dep = deploy([], ["hang"], p_urls=[closed_port_url()])
    resp = dep.post(BODY)
    assert resp.status_code == 503
    assert resp.json()["error"]["message"].startswith("prefill leg unreachable: ConnectError")
    # P refuses at once, often before D's leg is even sent; if D got it, it saw the hang-up.
    wait_until(lambda: dep.journal.seen("disconnect", "D0") == dep.journal.seen("connect", "D0"),
               "D to see the router hang up", WAIT_S)


def test_decode_down_gives_503_and_cancels_prefill():
    journal = Journal()
    p_srv = Served(Engine("P0", journal, "hang"))
    tracing = RouterTracing()
    router = Served(build_app(RouterConfig(
        (PrefillTarget(p_srv.url, "prefill-0", "127.0.0.1", 5600),), (closed_port_url(),)), tracing))
    try:
        resp = httpx.post(router.url + "/v1/completions", json=BODY, timeout=30)
        assert resp.status_code == 503
        assert resp.json()["error"]["message"].startswith("decode leg unreachable")
        # D refuses at once, often before P's leg is even sent; if P got it, it saw the hang-up.
        wait_until(lambda: journal.seen("disconnect", "P0") == journal.seen("connect", "P0"),
                   "P to see the router hang up", WAIT_S)
    finally:
        router.stop()
        p_srv.stop()


def test_engine_4xx_is_returned_with_the_engines_reason(deploy):
    dep = deploy(["ok"], ["bad"])
    resp = dep.post(BODY)
    assert resp.status_code == 400
    assert resp.json()["error"]["message"] == "prompt too long"


@pytest.mark.parametrize("raw, reason", [
    (b"{not json", "body is not valid JSON"),
    (b"[1, 2]", "body must be a JSON object"),
    (json.dumps({"model": "tiny"}).encode(), "'prompt' is required"),
    (json.dumps({**BODY, "kv_transfer_params": {}}).encode(), "'kv_transfer_params' is set by the router"),
    (json.dumps({**BODY, "stream": "yes"}).encode(), "'stream' must be true or false"),
    (json.dumps({**BODY, "n": 2}).encode(), "'n' other than 1"),
])
def test_bad_body_gets_400_with_reason_and_no_leg_is_sent(deploy, raw, reason):
    dep = deploy(["ok"], ["ok"])
    resp = dep.post(raw)
    assert resp.status_code == 400
    assert resp.json()["error"]["message"].startswith(reason)
    assert dep.journal.requests == {}


def test_round_robin_over_several_p_and_d(deploy):
    dep = deploy(["ok", "ok"], ["ok", "ok"])
    for i in range(4):
        assert dep.post(BODY, {"X-Request-Id": f"rr-{i}"}).status_code == 200
    reqs = dep.journal.requests
    assert [len(reqs[n]) for n in ("P0", "P1", "D0", "D1")] == [2, 2, 2, 2]
    p_engine = {r["headers"]["x-request-id"]: int(n[1]) for n in ("P0", "P1") for r in reqs[n]}
    for n in ("D0", "D1"):
        for r in reqs[n]:
            kv = r["body"]["kv_transfer_params"]
            # D is pointed at the P that got the same request
            assert kv["remote_engine_id"] == f"prefill-{p_engine[kv['remote_request_id']]}"
            assert kv["remote_port"] == 5600 + p_engine[kv["remote_request_id"]]


def test_streaming_proxies_decode_sse_and_prefill_is_not_streamed(deploy):
    dep = deploy(["ok"], ["ok"])
    with dep.client.stream("POST", "/v1/completions", json={**BODY, "stream": True}) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        data = b"".join(resp.iter_raw()).decode()
    events = [line[6:] for line in data.split("\n\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert [json.loads(e)["choices"][0]["token_ids"][0] for e in events[:-1]] == [11, 12, 13]
    p = dep.journal.requests["P0"][0]["body"]
    assert "stream" not in p and p["max_tokens"] == 1
    assert dep.journal.requests["D0"][0]["body"]["stream"] is True


def test_streaming_prefill_failure_cancels_decode(deploy):
    dep = deploy(["fail"], ["hang"])
    resp = dep.post({**BODY, "stream": True})
    assert resp.status_code == 502
    assert "prefill leg failed" in resp.json()["error"]["message"]
    wait_until(lambda: dep.journal.seen("disconnect", "D0") == 1, "D to see the router hang up", WAIT_S)


TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER_SPAN = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{CALLER_SPAN}-01"


def _parent_of(traceparent: str) -> tuple[str, str]:
    _, trace_id, span_id, _ = traceparent.split("-")
    return trace_id, span_id


def test_router_span_is_child_of_callers_trace_and_parents_both_legs(deploy):
    exporter = InMemorySpanExporter()
    dep = deploy(["ok"], ["ok"], exporter=exporter)
    assert dep.post(BODY, {"traceparent": TRACEPARENT}).status_code == 200
    dep.tracing.provider.force_flush()
    spans = {s.name: s for s in exporter.get_finished_spans()}
    server = spans[SPAN_ROUTER_REQUEST]
    assert f"{server.context.trace_id:032x}" == TRACE_ID
    assert f"{server.parent.span_id:016x}" == CALLER_SPAN
    for leg, engine in ((RouterLeg.PREFILL, "P0"), (RouterLeg.DECODE, "D0")):
        span = spans[router_leg_span_name(leg)]
        assert span.parent.span_id == server.context.span_id
        sent = dep.journal.requests[engine][0]["headers"]["traceparent"]
        assert _parent_of(sent) == (TRACE_ID, f"{span.context.span_id:016x}")
    assert server.attributes["http.response.status_code"] == 200


def test_router_starts_a_trace_when_the_caller_sends_none(deploy):
    exporter = InMemorySpanExporter()
    dep = deploy(["ok"], ["ok"], exporter=exporter)
    assert dep.post(BODY).status_code == 200
    dep.tracing.provider.force_flush()
    server = next(s for s in exporter.get_finished_spans() if s.name == SPAN_ROUTER_REQUEST)
    assert server.parent is None
    sent = {dep.journal.requests[e][0]["headers"]["traceparent"] for e in ("P0", "D0")}
    assert {_parent_of(t)[0] for t in sent} == {f"{server.context.trace_id:032x}"}


def test_without_tracing_the_callers_traceparent_goes_to_both_legs_unchanged(deploy):
    dep = deploy(["ok"], ["ok"])
    assert dep.post(BODY, {"traceparent": TRACEPARENT}).status_code == 200
    assert {dep.journal.requests[e][0]["headers"]["traceparent"] for e in ("P0", "D0")} == {TRACEPARENT}


def test_failed_request_marks_the_router_span_as_error(deploy):
    exporter = InMemorySpanExporter()
    dep = deploy(["fail"], ["hang"], exporter=exporter)
    assert dep.post(BODY).status_code == 502
    dep.tracing.provider.force_flush()
    server = next(s for s in exporter.get_finished_spans() if s.name == SPAN_ROUTER_REQUEST)
    assert server.status.status_code.name == "ERROR"
    assert server.attributes["error.type"] == "prefill_failed"


@pytest.mark.parametrize("spec, problem", [
    ("http://p:8100,engine_id=p0", "lacks side_channel"),
    ("http://p:8100,engine_id=p0,side_channel=p", "HOST:PORT"),
    ("ftp://p,engine_id=p0,side_channel=p:1", r"not an http\(s\) URL"),
    ("http://p:8100,engine_id=p0,side_channel=p:1,colour=red", "unknown keys"),
])
def test_bad_prefill_spec_is_rejected_with_reason(spec, problem):
    with pytest.raises(ConfigError, match=problem):
        PrefillTarget.parse(spec)


def test_prefill_spec_parses_coordinates():
    t = PrefillTarget.parse("http://p0:8100/,engine_id=prefill-0,side_channel=10.0.0.5:5600,tp_size=2")
    assert (t.url, t.engine_id, t.side_channel_host, t.side_channel_port, t.tp_size, t.pp_size) == \
        ("http://p0:8100", "prefill-0", "10.0.0.5", 5600, 2, 1)


# ------------------------------------------------------------------ the router's /metrics
COMPLETIONS = "/v1/completions"


def sample(dep: Deployment, spec: Any, suffix: str = "", **labels: str) -> float:
    """One sample of the router's registry (0 when the series does not exist)."""
    name = spec.name + (suffix or {"counter": "_total", "histogram": "_count"}.get(spec.kind.value, ""))
    value = dep.metrics.registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


def outcomes(dep: Deployment, route: str = COMPLETIONS) -> dict[str, float]:
    return {o.value: sample(dep, V.ROUTER_REQUESTS, route=route, outcome=o.value) for o in V.RouterOutcome}


def cancels(dep: Deployment) -> dict[tuple[str, str], float]:
    return {(leg.value, r.value): sample(dep, V.ROUTER_LEGS_CANCELLED, leg=leg.value, reason=r.value)
            for leg in RouterLeg for r in V.LegCancel}


def legs_by_outcome(dep: Deployment) -> dict[tuple[str, str], float]:
    return {(leg.value, o.value): sample(dep, V.ROUTER_LEG_DURATION, leg=leg.value, outcome=o.value)
            for leg in RouterLeg for o in V.LegOutcome}


def only(expected: dict[Any, float], got: dict[Any, float]) -> None:
    """`got` has exactly the non-zero values of `expected` and 0 elsewhere."""
    assert {k: v for k, v in got.items() if v} == expected, got


def ttft_count(dep: Deployment, stream: bool, route: str = COMPLETIONS) -> float:
    return sample(dep, V.ROUTER_TTFT, route=route, stream=V.bool_label(stream))


def in_flight(dep: Deployment, route: str = COMPLETIONS) -> float:
    return sample(dep, V.ROUTER_REQUESTS_IN_FLIGHT, route=route)


def settled(dep: Deployment, total: int) -> None:
    """Wait until `total` requests were counted and none is in flight (a streamed answer is
    counted after its last byte reached the client, so just after the client read it)."""
    wait_until(lambda: sum(outcomes(dep).values()) == total and in_flight(dep) == 0,
               "the router to count the request", WAIT_S, 0.01, last=lambda: (outcomes(dep), in_flight(dep)))


def test_every_router_series_exists_at_zero_before_any_request(deploy):
    dep = deploy(["ok"], ["ok"])
    text = dep.client.get(V.ROUTER_METRICS_PATH).text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for spec in V.ROUTER_METRICS:
        fam = families[spec.name]
        assert fam.type == spec.kind.value, spec.name
        combos = {tuple(s.labels[label] for label in spec.labels) for s in fam.samples
                  if s.name in spec.series_names}
        want = {()}
        for label in spec.labels:
            want = {(*c, v) for c in want for v in V.allowed_values(spec.name, label)}
        assert combos == want, spec.name
        assert all(s.value == 0 for s in fam.samples if s.name in spec.series_names), spec.name
    code, lines = promrun.check_metrics(text)
    assert (code, lines) == (0, []), lines


def test_ok_request_counts_once_with_both_legs_and_ttft(deploy):
    dep = deploy(["ok"], ["ok"])
    assert dep.post(BODY).status_code == 200
    settled(dep, 1)
    only({"ok": 1}, outcomes(dep))
    only({("prefill", "ok"): 1, ("decode", "ok"): 1}, legs_by_outcome(dep))
    only({}, cancels(dep))
    assert ttft_count(dep, stream=False) == 1 and ttft_count(dep, stream=True) == 0
    # Not streamed, the first token the client sees is the whole answer: it comes after
    # the decode leg, which the router sent after the request arrived.
    ttft = sample(dep, V.ROUTER_TTFT, "_sum", route=COMPLETIONS, stream="false")
    decode = sample(dep, V.ROUTER_LEG_DURATION, "_sum", leg="decode", outcome="ok")
    assert ttft >= decode > 0


def test_chat_requests_are_counted_under_their_route(deploy):
    dep = deploy(["ok"], ["ok"])
    resp = dep.post({"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}, path=legs.CHAT)
    assert resp.status_code == 200
    wait_until(lambda: outcomes(dep, legs.CHAT)["ok"] == 1, "the chat request counted", WAIT_S, 0.01)
    only({}, outcomes(dep, COMPLETIONS))
    assert ttft_count(dep, stream=False, route=legs.CHAT) == 1


def test_streamed_ttft_is_taken_at_the_first_event_not_the_end(deploy):
    dep = deploy(["ok"], ["stream_wait"])
    with dep.client.stream("POST", COMPLETIONS, json={**BODY, "stream": True}) as resp:
        lines = resp.iter_lines()
        assert next(lines).startswith("data: ")
        # D holds its stream open after the first event: TTFT is already there, the decode
        # leg and the request are not.
        wait_until(lambda: ttft_count(dep, stream=True) == 1, "the streamed TTFT", WAIT_S, 0.01)
        assert in_flight(dep) == 1
        assert sum(outcomes(dep).values()) == 0
        assert legs_by_outcome(dep)[("decode", "ok")] == 0
        # P's leg ends when P answers, while D's stream is still open.
        wait_until(lambda: legs_by_outcome(dep)[("prefill", "ok")] == 1, "P's leg", WAIT_S, 0.01)
        dep.journal.release.set()
        assert [line for line in lines if line][-1] == "data: [DONE]"
    settled(dep, 1)
    only({"ok": 1}, outcomes(dep))
    only({("prefill", "ok"): 1, ("decode", "ok"): 1}, legs_by_outcome(dep))
    assert ttft_count(dep, stream=False) == 0
    ttft = sample(dep, V.ROUTER_TTFT, "_sum", route=COMPLETIONS, stream="true")
    assert 0 < ttft < sample(dep, V.ROUTER_LEG_DURATION, "_sum", leg="decode", outcome="ok")


def test_a_not_streamed_requests_prefill_leg_ends_when_p_answers(deploy):
    """P's leg latency is P's: it is recorded when P answers, while D still works on the
    answer the client waits for (it was recorded when both had answered)."""
    dep = deploy(["ok"], ["wait"])
    with ThreadPoolExecutor(1) as pool:
        answer = pool.submit(dep.post, BODY)
        wait_until(lambda: legs_by_outcome(dep)[("prefill", "ok")] == 1, "P's leg", WAIT_S, 0.01)
        assert legs_by_outcome(dep)[("decode", "ok")] == 0 and in_flight(dep) == 1
        dep.journal.release.set()
        assert answer.result().status_code == 200
    settled(dep, 1)
    only({"ok": 1}, outcomes(dep))
    only({("prefill", "ok"): 1, ("decode", "ok"): 1}, legs_by_outcome(dep))
    assert (sample(dep, V.ROUTER_LEG_DURATION, "_sum", leg="prefill", outcome="ok")
            < sample(dep, V.ROUTER_LEG_DURATION, "_sum", leg="decode", outcome="ok"))


@pytest.mark.parametrize("stream", [False, True])
def test_prefill_failure_counts_prefill_failed_and_the_cancelled_decode_leg(deploy, stream):
    dep = deploy(["fail"], ["hang"])
    assert dep.post({**BODY, "stream": stream}).status_code == 502
    settled(dep, 1)
    only({"prefill_failed": 1}, outcomes(dep))
    only({("prefill", "failed"): 1, ("decode", "cancelled"): 1}, legs_by_outcome(dep))
    only({("decode", "other_leg_failed"): 1}, cancels(dep))
    assert ttft_count(dep, stream) == 0


@pytest.mark.parametrize("stream", [False, True])
def test_decode_failure_counts_decode_failed_and_the_cancelled_prefill_leg(deploy, stream):
    dep = deploy(["hang"], ["fail"])
    assert dep.post({**BODY, "stream": stream}).status_code == 502
    settled(dep, 1)
    only({"decode_failed": 1}, outcomes(dep))
    only({("prefill", "cancelled"): 1, ("decode", "failed"): 1}, legs_by_outcome(dep))
    only({("prefill", "other_leg_failed"): 1}, cancels(dep))


def test_bad_request_is_counted_without_legs(deploy):
    dep = deploy(["ok"], ["ok"])
    assert dep.post(b"{not json").status_code == 400
    settled(dep, 1)
    only({"bad_request": 1}, outcomes(dep))
    only({}, legs_by_outcome(dep))


def _raw_request(url: str, body: dict[str, Any]) -> socket.socket:
    """A request on a plain socket, so the test can hang up without reading the answer."""
    host, port = url.removeprefix("http://").split(":")
    data = json.dumps(body).encode()
    sock = socket.create_connection((host, int(port)))
    sock.sendall(f"POST {COMPLETIONS} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return sock


def test_client_disconnect_stops_both_legs_and_is_counted(deploy):
    dep = deploy(["hang"], ["hang"])
    sock = _raw_request(dep.router.url, BODY)
    try:
        wait_until(lambda: dep.journal.seen("arrive", "P0") and dep.journal.seen("arrive", "D0"),
                   "both legs at their engines", WAIT_S, 0.01)
        assert in_flight(dep) == 1
    finally:
        sock.close()
    settled(dep, 1)
    only({"client_disconnected": 1}, outcomes(dep))
    only({("prefill", "client_disconnected"): 1, ("decode", "client_disconnected"): 1}, cancels(dep))
    only({("prefill", "cancelled"): 1, ("decode", "cancelled"): 1}, legs_by_outcome(dep))
    wait_until(lambda: dep.journal.seen("disconnect", "P0") == dep.journal.seen("disconnect", "D0") == 1,
               "both engines to see the router hang up", WAIT_S)


def test_client_disconnect_mid_stream_stops_decode_and_is_counted(deploy):
    dep = deploy(["ok"], ["stream_wait"])
    sock = _raw_request(dep.router.url, {**BODY, "stream": True})
    try:
        wait_until(lambda: b"data: " in sock.recv(65536), "the first streamed event", WAIT_S)
        wait_until(lambda: ttft_count(dep, stream=True) == 1, "the streamed TTFT", WAIT_S, 0.01)
    finally:
        sock.close()
    settled(dep, 1)
    only({"client_disconnected": 1}, outcomes(dep))
    got = cancels(dep)
    assert got[("decode", "client_disconnected")] == 1
    legs_seen = legs_by_outcome(dep)
    # P answered (ok) or was still in flight and stopped with the stream (cancelled): once.
    assert legs_seen[("prefill", "ok")] + legs_seen[("prefill", "cancelled")] == 1
    assert got[("prefill", "client_disconnected")] == legs_seen[("prefill", "cancelled")]
    wait_until(lambda: dep.journal.seen("disconnect", "D0") == 1, "D to see the router hang up", WAIT_S)


class _Broken:
    """A metric whose every use raises (failure injection for the telemetry guard)."""

    def labels(self, *_: Any) -> Any:
        raise RuntimeError("metric backend exploded")


@pytest.mark.parametrize("stream", [False, True])
def test_telemetry_failures_never_fail_a_request(deploy, stream):
    dep = deploy(["ok"], ["ok"])
    for name in ("ttft", "leg_duration", "in_flight", "legs_cancelled"):
        setattr(dep.metrics, name, _Broken())
    with dep.client.stream("POST", COMPLETIONS, json={**BODY, "stream": stream}) as resp:
        assert resp.status_code == 200
        assert b"11" in resp.read()
    wait_until(lambda: outcomes(dep)["ok"] == 1, "the request counted", WAIT_S, 0.01)
    dep.metrics.requests = _Broken()
    assert dep.post({**BODY, "stream": stream}).status_code == 200


def test_metrics_endpoint_serves_openmetrics_with_trace_exemplars(deploy):
    exporter = InMemorySpanExporter()
    dep = deploy(["ok"], ["ok"], exporter=exporter)
    assert dep.post(BODY, {"traceparent": TRACEPARENT}).status_code == 200
    settled(dep, 1)
    dep.tracing.provider.force_flush()
    spans = {s.name: s for s in exporter.get_finished_spans()}
    text = dep.client.get(V.ROUTER_METRICS_PATH,
                          headers={"Accept": "application/openmetrics-text; version=1.0.0"}).text
    assert text.rstrip().endswith("# EOF")
    found = {(name, ex["trace_id"], ex["span_id"]) for name, _, ex in _exemplars(text)}
    assert (V.ROUTER_TTFT.name + "_bucket", TRACE_ID,
            f"{spans[SPAN_ROUTER_REQUEST].context.span_id:016x}") in found
    for leg in RouterLeg:
        assert (V.ROUTER_LEG_DURATION.name + "_bucket", TRACE_ID,
                f"{spans[router_leg_span_name(leg)].context.span_id:016x}") in found


def _exemplars(text: str) -> list[tuple[str, dict[str, str], dict[str, str]]]:
    """(sample name, labels, exemplar labels) of every OpenMetrics line with an exemplar."""
    out = []
    for family in text_string_to_openmetrics_families(text):
        for s in family.samples:
            if s.exemplar is not None:
                out.append((s.name, dict(s.labels), dict(s.exemplar.labels)))
    return out


@pytest.mark.parametrize("stream", [False, True])
def test_the_request_span_carries_the_ttft_the_histogram_observed(deploy, stream):
    exporter = InMemorySpanExporter()
    dep = deploy(["ok"], ["ok"], exporter=exporter)
    with dep.client.stream("POST", COMPLETIONS, json={**BODY, "stream": stream}) as resp:
        assert resp.status_code == 200
        resp.read()
    settled(dep, 1)
    dep.tracing.provider.force_flush()
    server = next(s for s in exporter.get_finished_spans() if s.name == SPAN_ROUTER_REQUEST)
    observed = sample(dep, V.ROUTER_TTFT, "_sum", route=COMPLETIONS, stream=V.bool_label(stream))
    assert observed > 0 and server.attributes[V.RouterAttr.TTFT] == observed

"""Local OTLP trace receivers (what Jaeger and the OTel Collector ingest), for tests and the demo.

Both decode the real OTLP protobuf (`ExportTraceServiceRequest`) into flat span dicts
in the same shape as `harness.spans.span_to_dict`.
"""

from __future__ import annotations

import collections
import gzip
import threading
import time
from concurrent import futures
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

_KINDS = {0: "UNSPECIFIED", 1: "INTERNAL", 2: "SERVER", 3: "CLIENT", 4: "PRODUCER", 5: "CONSUMER"}
_STATUS = {0: "UNSET", 1: "OK", 2: "ERROR"}


def _value(v: AnyValue) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


def decode_request(request: trace_service_pb2.ExportTraceServiceRequest) -> list[dict[str, Any]]:
    out = []
    for rs in request.resource_spans:
        resource = {kv.key: _value(kv.value) for kv in rs.resource.attributes}
        for ss in rs.scope_spans:
            for span in ss.spans:
                out.append({
                    "name": span.name,
                    "trace_id": span.trace_id.hex(),
                    "span_id": span.span_id.hex(),
                    "parent_span_id": span.parent_span_id.hex() or None,
                    "kind": _KINDS.get(span.kind, str(span.kind)),
                    "attributes": {kv.key: _value(kv.value) for kv in span.attributes},
                    "status": _STATUS.get(span.status.code, str(span.status.code)),
                    "start": span.start_time_unix_nano,
                    "end": span.end_time_unix_nano,
                    "service": resource.get("service.name"),
                    "scope": ss.scope.name,
                    "events": [e.name for e in span.events],
                    # (the first time of each event name: a stage boundary's time)
                    "event_times": {e.name: e.time_unix_nano for e in reversed(span.events)},
                    "links": [{"trace_id": link.trace_id.hex(), "span_id": link.span_id.hex(),
                               "attributes": {kv.key: _value(kv.value) for kv in link.attributes}}
                              for link in span.links],
                })
    return out


class _Store:
    """Received spans; `delay_s` makes every export take that long (a slow back-end),
    `hold` (an Event) keeps every export waiting until it is set (a stuck back-end), and
    `attempts`/`in_progress` count export calls, answered or not."""

    def __init__(self, delay_s: float = 0.0, hold: threading.Event | None = None,
                 count_only: bool = False) -> None:
        self.lock = threading.Lock()
        self.spans: list[dict[str, Any]] = []
        # count_only: spans are counted by instrumentation scope, not decoded or kept (a
        # receiver beside a CPU measurement must cost little).
        self.count_only = count_only
        self.by_scope: collections.Counter[str] = collections.Counter()
        self.requests = 0
        self.last_requests: collections.deque[Any] = collections.deque(maxlen=64)  # as received
        self.attempts = 0
        self.in_progress = 0
        self.delay_s = delay_s
        self.hold = hold

    def begin(self) -> None:
        with self.lock:
            self.attempts += 1
            self.in_progress += 1
        if self.hold is not None:
            self.hold.wait(600)  # the back-end being stuck, released by its owner
        if self.delay_s:
            time.sleep(self.delay_s)  # the back-end being slow, not test synchronisation

    def done(self) -> None:
        with self.lock:
            self.in_progress -= 1

    def add(self, request: trace_service_pb2.ExportTraceServiceRequest) -> None:
        if self.count_only:
            counts = collections.Counter()
            for resource_spans in request.resource_spans:
                for scope_spans in resource_spans.scope_spans:
                    counts[scope_spans.scope.name] += len(scope_spans.spans)
            with self.lock:
                self.requests += 1
                self.by_scope.update(counts)
            return
        spans = decode_request(request)
        with self.lock:
            self.requests += 1
            self.last_requests.append(request)
            self.spans.extend(spans)

    def snapshot(self) -> list[dict[str, Any]]:
        with self.lock:
            return list(self.spans)


class OtlpHttpReceiver(_Store):
    """`POST /v1/traces` with protobuf bodies (OTLP/HTTP), on 127.0.0.1."""

    def __init__(self, port: int = 0, delay_s: float = 0.0, status: int = 200,
                 hold: threading.Event | None = None):
        super().__init__(delay_s, hold)
        store = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                store.begin()
                try:
                    self._post()
                finally:
                    store.done()

            def _post(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if status != 200:  # a refusing back-end (e.g. 503 while overloaded)
                    self.send_response(status)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                if self.path != "/v1/traces":
                    self.send_response(404)
                    self.end_headers()
                    return
                request = trace_service_pb2.ExportTraceServiceRequest()
                request.ParseFromString(body)
                store.add(request)
                reply = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.port = self._server.server_address[1]
        self.endpoint = f"http://127.0.0.1:{self.port}/v1/traces"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def close(self) -> None:
        if self.hold is not None:
            self.hold.set()
        self._server.shutdown()
        self._server.server_close()


class OtlpGrpcReceiver(_Store):
    """OTLP/gRPC `TraceService.Export` on `host` (127.0.0.1 by default)."""

    def __init__(self, port: int = 0, delay_s: float = 0.0, refuse: bool = False,
                 host: str = "127.0.0.1", count_only: bool = False):
        import grpc

        super().__init__(delay_s, count_only=count_only)
        store = self

        class Servicer(trace_service_pb2_grpc.TraceServiceServicer):
            def Export(self, request: Any, context: Any) -> Any:
                store.begin()
                try:
                    if refuse:  # what an overloaded collector answers
                        context.abort(grpc.StatusCode.UNAVAILABLE, "collector overloaded")
                    store.add(request)
                    return trace_service_pb2.ExportTraceServiceResponse()
                finally:
                    store.done()

        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Servicer(), self._server)
        self.port = self._server.add_insecure_port(f"{host}:{port}")
        self.endpoint = f"http://{host}:{self.port}"
        self._server.start()

    def close(self) -> None:
        self._server.stop(grace=None)


class RaisingExporter:
    """A span exporter whose every export raises (a broken exporter plug-in)."""

    def __init__(self) -> None:
        self.calls = 0

    def export(self, spans: Any) -> Any:
        self.calls += 1
        raise RuntimeError("exporter exploded")

    def shutdown(self) -> None:
        pass

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True

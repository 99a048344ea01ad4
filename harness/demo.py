"""The harness demo (`make demo-harness`): a real P/D push with the fork, and what operators see.

Starts a local OTLP/gRPC receiver (standing in for Jaeger on 4317), a prefill and a
decode engine in separate processes (real NIXL over UCX, real ZMQ side channels),
pushes N requests, serves each engine's /metrics the way vLLM's API server does,
then prints: the push summary (bytes verified), one request's trace tree as it
arrived over OTLP, the handshake lines of /metrics, and vLLM's "KV Transfer
metrics" log line with our handshake fields.

    python -m harness.demo [--requests 20] [--serve SECONDS]
"""

from __future__ import annotations

import argparse
import time
import urllib.request
from typing import Any

from connector.vocabulary import SPAN_PUSH_RECEIVE, Attr
from harness.otlp_receiver import OtlpGrpcReceiver
from harness.poll import wait_until
from harness.runner import PushHarness


def span_tree(spans: list[dict[str, Any]], trace_id: str) -> list[str]:
    """Indented lines for one trace, children in start order, with key attributes."""
    in_trace = [s for s in spans if s["trace_id"] == trace_id]
    ids = {s["span_id"] for s in in_trace}
    kids: dict[str | None, list[dict[str, Any]]] = {}
    for s in in_trace:
        parent = s["parent_span_id"] if s["parent_span_id"] in ids else None
        kids.setdefault(parent, []).append(s)
    keys = (Attr.NOTIF_AGENTS_ONLY, Attr.DIRECTION, Attr.TRIGGER, Attr.DESCRIPTORS_REGISTERED,
            Attr.DESCRIPTORS_SAVED, Attr.ERROR_TYPE)
    lines: list[str] = []

    def walk(parent: str | None, depth: int) -> None:
        for s in sorted(kids.get(parent, []), key=lambda x: x["start"]):
            ms = (s["end"] - s["start"]) / 1e6
            attrs = " ".join(f"{k.rsplit('.', 1)[-1]}={s['attributes'][k]}" for k in keys
                             if k in s["attributes"])
            lines.append(f"{'  ' * depth}{s['name']}  [{s['service']}] {ms:.2f} ms {attrs}".rstrip())
            walk(s["span_id"], depth + 1)

    walk(None, 0)
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=20)
    parser.add_argument("--serve", type=float, default=0.0,
                        help="keep /metrics endpoints up this many seconds at the end")
    args = parser.parse_args(argv)

    receiver = OtlpGrpcReceiver()
    tracing = {"endpoint": receiver.endpoint, "protocol": "grpc"}
    print(f"OTLP/gRPC receiver on {receiver.endpoint}; starting P and D engine processes ...")
    t0 = time.perf_counter()
    try:
        with PushHarness.pd(tracing=tracing, num_blocks=max(128, 4 * args.requests + 8)) as h:
            print(f"engines ready in {time.perf_counter() - t0:.1f} s: "
                  f"P pid {h['P'].info['pid']} port {h['P'].info['port']}, "
                  f"D pid {h['D'].info['pid']} port {h['D'].info['port']}")
            report = h.push(args.requests)
            print(f"\npushed {len(report.requests)} requests P->D: {report.verified} verified "
                  f"byte-for-byte, failed={report.failed}, untouched D blocks intact="
                  f"{not report.dirty_blocks}; median push {report.median_latency_s * 1e3:.1f} ms")
            time.sleep(1.0)
            fronts = {name: h.frontend(name) for name in ("P", "D")}
            for name, fe in fronts.items():
                fe.observe(h.stats(name))
                time.sleep(0.3)
                fe.observe(h.stats(name))
            for name in ("P", "D"):
                h[name].call("spans")  # flush the batch span processors
            first = wait_until(lambda: next((s for s in receiver.snapshot() if s["name"] == SPAN_PUSH_RECEIVE
                                             and s["attributes"].get(Attr.REQUEST_ID) == report.requests[0]),
                                            None), "the first request's receive span at the receiver", 30)
            spans = receiver.snapshot()
            print(f"\n# trace of request {report.requests[0]} (as received over OTLP)")
            print("\n".join(span_tree(spans, first["trace_id"])))
            handshake_traces = {s["trace_id"] for s in spans if s["name"] == "nixl.handshake"
                                and s["parent_span_id"] is None}
            for trace_id in sorted(handshake_traces):
                print("\n# handshake trace (started by a heartbeat, no request parent)")
                print("\n".join(span_tree(spans, trace_id)))
            for name, fe in fronts.items():
                port = fe.serve()
                body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read()
                lines = [ln for ln in body.decode().splitlines()
                         if ln.startswith(("vllm:nixl_handshakes_total", "vllm:nixl_descriptor",
                                           "vllm:nixl_push", "vllm:nixl_handshake_duration_seconds_count",
                                           "vllm:nixl_handshake_phase_duration_seconds_sum"))
                         and "_created{" not in ln and not ln.rstrip().endswith(" 0.0")]
                print(f"\n# {name} /metrics on http://127.0.0.1:{port}/metrics (non-zero handshake lines)")
                print("\n".join(lines))
                for line in fe.log_lines[-1:]:
                    print(f"\n# {name} log: {line}")
            if args.serve > 0:
                print(f"\nserving /metrics for {args.serve:.0f} s ...")
                time.sleep(args.serve)
            for fe in fronts.values():
                fe.close()
            return 0 if report.ok else 1
    finally:
        receiver.close()


if __name__ == "__main__":
    raise SystemExit(main())

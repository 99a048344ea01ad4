"""`make demo` / `python -m demo`: the real P/D deployment on loopback, observed.

Starts real `vllm serve` P and D (tiny random-weight Llama, fork connector), the
router (`python -m connector.router`), a local OTLP/gRPC receiver (or your collector
with --otlp-endpoint) and a real Prometheus scraping both engines with the shipped
rules and exemplar storage. Sends requests one by one, then a concurrent batch;
checks each output equals a single-engine run; prints a report read from /metrics,
Prometheus and the traces; renders the dashboard preview into <workdir>/preview/ (the
tracked dashboards/preview/ copy changes only by `make preview`). Logs go to files.

    python -m demo [--connector fork|stock] [--hosts] [--otlp-endpoint URL] [--serve]

With `--hosts`, P, D and the router with Prometheus each run on a host of their own
(Linux network namespaces on a bridge, addresses in 198.18.0.0/15; needs root): KV
moves over UCX's TCP transport between them, and the report shows the addresses.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from pathlib import Path
from typing import Any

from dashboards import preview
from demo import drive, report
from demo.engines import PROGRESS_DELAY_US, REPO, SERVED_MODEL
from demo.network import unavailable_reason
from demo.stack import JOB, ROUTER_JOB, Stack
from harness.poll import wait_until

WORKDIR = REPO / ".cache" / "demo-run"


class Clock:
    def __init__(self) -> None:
        self.t0 = time.monotonic()

    def __call__(self, message: str) -> None:
        print(f"[{time.monotonic() - self.t0:6.1f}s] {message}", flush=True)


def section(title: str, lines: list[str]) -> None:
    print(f"\n{title}")
    for line in lines:
        print(f"  {line}")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m demo", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--connector", choices=("fork", "stock"), default="fork",
                   help="stock: the same deployment with vLLM's own NixlPushConnector")
    p.add_argument("--otlp-endpoint", help="send traces to your collector/Jaeger (OTLP gRPC, e.g. "
                   "http://localhost:4317) instead of the local receiver; the trace tree is then in your UI")
    p.add_argument("--nixl-progress-delay-us", type=int, default=PROGRESS_DELAY_US,
                   help="fork engines: NIXL progress-thread poll delay (kv_connector_extra_config "
                        "nixl_progress_delay_us; -1 = NIXL's busy loop)")
    p.add_argument("--hosts", action="store_true",
                   help="P, D and the router+Prometheus each on a host of its own (network namespaces; root)")
    p.add_argument("--serve", action="store_true", help="keep everything up after the report until Ctrl-C")
    p.add_argument("--requests", type=int, default=3, help="requests sent one by one")
    p.add_argument("--batch", type=int, default=8, help="requests sent concurrently afterwards")
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--workdir", type=Path, default=WORKDIR, help="logs, Prometheus data")
    p.add_argument("--no-preview", action="store_true",
                   help="do not render the dashboard preview (<workdir>/preview/)")
    return p.parse_args(argv)


def _sigterm(*_: Any) -> None:
    raise KeyboardInterrupt


def run(stack: Stack, args: argparse.Namespace, clock: Clock) -> int:
    """Requests, checks and report; returns the number of failed checks."""
    assert stack.router is not None and stack.prefill is not None and stack.decode is not None
    assert stack.prometheus is not None
    prom, fork = stack.prometheus, args.connector == "fork"
    t_start = time.time()
    seq = drive.run(stack.router.url, stack.prefill.url, drive.make_prompts(args.requests),
                    prefix="demo-seq", max_tokens=args.max_tokens)
    clock(f"{len(seq)} requests one by one: {sum(o.ok for o in seq)}/{len(seq)} "
          "equal the single-engine reference")
    batch = drive.run(stack.router.url, stack.prefill.url, drive.make_prompts(args.batch, seed=11),
                      prefix="demo-batch", max_tokens=args.max_tokens, concurrency=args.batch)
    clock(f"{len(batch)} concurrent requests: {sum(o.ok for o in batch)}/{len(batch)} equal the reference")
    outcomes = seq + batch
    failed = 0
    for o in outcomes:
        if not o.ok:
            failed += 1
            print(f"  MISMATCH {o.request_id}: {o.error or f'got {o.tokens}, reference {o.reference}'}")
    t_sent = time.time()
    wait_until(lambda: (prom.value(f'min(timestamp(up{{job=~"{JOB}|{ROUTER_JOB}"}}))') or 0) > t_sent + 1.5,
               "Prometheus to scrape after the last request", 60, 0.25)
    p_data, d_data = report.samples(stack.prefill.metrics()), report.samples(stack.decode.metrics())
    data = p_data + d_data
    clock("report (engines' /metrics, Prometheus API, traces)")

    if stack.network is not None:
        net = stack.network
        section("Hosts (network namespaces on bridge " + net.bridge + ")",
                [f"{h.name:8} {h.address}  ({h.netns})" for h in net.hosts.values()]
                + [f"machine  {net.machine_address}  (this process, trace receiver)",
                   f"P side channel {stack.prefill.side_channel}, "
                   f"D side channel {stack.decode.side_channel}"])
    hs = report.handshake_lines(data, stack.decode.log())
    section("Handshakes (vLLM /metrics of both engines)", hs)
    if fork:
        name = "vllm:nixl_handshakes_total"
        d_to_p_full = report.total(data, name, direction="d_to_p", notif_agents_only="false")
        d_to_p = report.total(data, name, direction="d_to_p")
        if d_to_p == 0 or d_to_p_full:
            failed += 1
            print("  CHECK FAILED: D->P handshakes must all be notification-only")
        section("Descriptors", report.descriptor_lines(data))
        source, lines = report.phase_lines(stack.spans(), prom, JOB)
        section(f"Handshake phases ({source})", lines)
    section("KV pushes", report.push_lines(p_data, d_data, outcomes))
    if fork:
        lines = []
        for tag, server in (("P", stack.prefill), ("D", stack.decode)):
            seen = report.wait_witness(server)
            lines.append(seen.line(tag))
            failed += not seen.agrees()
        section("NIXL's own counters beside the engines' (NIXL's exporter, joined by "
                "vllm:nixl_push_agent_info)", lines)
    router, router_failed = report.router_lines(report.samples(stack.router.metrics()), prom, ROUTER_JOB,
                                                sent=len(outcomes))
    failed += router_failed
    section("Router (its /metrics; p50/p95: Prometheus, within buckets)", router)
    if fork and stack.receiver is not None:
        splits = list(report.wait_splits(stack.spans, outcomes, 30).values())
        means = report.ttft_dashboard_means(prom, JOB, SERVED_MODEL)
        lines, ttft_failed = report.ttft_lines(splits, means)
        failed += ttft_failed + (len(splits) < len(outcomes))
        section(f"Where TTFT goes (dashboard row over the last hour; {len(splits)} of {len(outcomes)} "
                "requests' traces)", lines)
    rules, firing = report.rule_lines(prom)
    failed += firing
    section("Prometheus rules (dashboards/rules)", rules)

    first = seq[0] if seq else batch[0]
    if stack.receiver is not None:  # every span received, for a closer look
        report.wait_trace(stack.spans, first.trace_id, fork)
        (args.workdir / "spans.json").write_text(json.dumps(stack.spans()))
    if stack.receiver is None:
        section("Trace", [f"trace id {first.trace_id}: open it in your tracing UI ({args.otlp_endpoint})"])
    else:
        spans = report.wait_trace(stack.spans, first.trace_id, fork)
        complete = report.trace_complete(spans, first.trace_id, fork)
        failed += not complete
        section(f"One request's trace ({first.request_id}, trace id {first.trace_id}"
                f"{'' if complete else ', INCOMPLETE'})", report.span_tree(spans, first.trace_id))
    ex = report.prometheus_exemplars(prom, t_start - 5, time.time())
    if not ex:
        section("Exemplars", ["none stored by Prometheus (no exemplars on the engines' /metrics)"])
    else:
        known = {s["trace_id"] for s in stack.spans()}
        resolved = [(name, tid) for name, tid in ex if tid in known] or ex
        name, tid = resolved[0]
        lines = [f"{len(ex)} exemplar(s) in Prometheus; {name} -> trace {tid}"]
        if stack.receiver is not None:
            lines += report.span_tree(stack.spans(), tid) or ["(trace not received)"]
        section("An exemplar resolved to its trace (Prometheus /api/v1/query_exemplars)", lines)

    if fork and not args.no_preview:
        data_panels = preview.query_panels(prom, t_start - 10, time.time(), f"{JOB}|{ROUTER_JOB}",
                                           SERVED_MODEL)
        data_panels[preview.SOURCE_KEY] = "real vllm serve P/D (make demo)"
        out = args.workdir / "preview"
        out.mkdir(parents=True, exist_ok=True)
        (out / preview.DATA_NAME).write_text(json.dumps(data_panels))
        path = preview.render(data_panels, out / preview.OUT.name)
        print()
        clock(f"rendered the dashboard preview from this Prometheus: {_shown(path)} "
              f"(`make preview` renders it into {_shown(preview.OUT)})")
    return failed


def _shown(path: Path) -> Path:
    """`path` relative to the checkout when it is inside it."""
    return path.relative_to(REPO) if path.is_relative_to(REPO) else path


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    clock = Clock()
    signal.signal(signal.SIGTERM, _sigterm)
    delay = None if args.nixl_progress_delay_us < 0 else args.nixl_progress_delay_us
    if args.hosts and (reason := unavailable_reason()) is not None:
        print(f"--hosts needs network namespaces, which this machine cannot make: {reason}. "
              "Run as root, or without --hosts.", file=sys.stderr)
        return 2
    stack = Stack(args.workdir, connector=args.connector, otlp_endpoint=args.otlp_endpoint, progress=clock,
                  hosts=args.hosts,
                  nixl_progress_delay_us=delay)
    clock(f"starting the real deployment ({args.connector} connector); logs in {args.workdir}")
    rc = 0
    try:
        stack.start()
        failed = run(stack, args, clock)
        rc = 1 if failed else 0
        clock(f"{'all checks passed' if not failed else f'{failed} check(s) FAILED'}")
        if args.serve:
            assert stack.router and stack.prefill and stack.decode and stack.prometheus
            section("Serving until Ctrl-C", [
                f"router      {stack.router.url}/v1/completions  (token-id prompts, model {SERVED_MODEL!r})",
                f"P /metrics  {stack.prefill.url}/metrics",
                f"D /metrics  {stack.decode.url}/metrics",
                f"Prometheus  {stack.prometheus.url}  (add it as a Grafana datasource)",
                f"traces      {stack.otlp_endpoint}"])
            while True:
                time.sleep(3600)
    except KeyboardInterrupt:
        print()
        clock("interrupted")
        rc = 130 if not args.serve else rc
    except Exception as exc:
        clock(f"FAILED: {type(exc).__name__}: {exc}")
        rc = 1
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not stop the teardown
        n = len(stack.processes) + (stack.prometheus is not None)
        stack.close()
        clock(f"stopped the {n} processes this demo started (by pid); logs stay in {args.workdir}")
    return rc


if __name__ == "__main__":
    sys.exit(main())

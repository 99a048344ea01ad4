"""CPU time per pushed request: stock vs fork (tracing off) vs fork (tracing on).

Latency medians on a 2-core machine with several engine processes cannot resolve a
few percent; CPU time can. Four P/D pairs run at once: stock connector, fork with
tracing off, fork with tracing on (always-on sampler, batch export over OTLP/gRPC to
a local receiver), and a second stock pair as an A/A control (the spread two
identical pairs show). Each round pushes `--requests` requests through each pair in
rotating order and reads the user+system CPU time of both engine processes before
and after, by thread: the engine loop's main thread (which also serves the harness's
commands), vLLM's push writer and handshake threads, the OTLP exporter, and "native"
for NIXL/UCX/gloo threads. Reported: median CPU per request over rounds, [min-max]
spread, and ratios to stock, for the whole processes and per thread.

Harness engines let NIXL's progress thread sleep between polls (harness/nixl_progress.py):
with NIXL's default busy loop each engine process spins one core whatever it does,
and that spin, not the push path, would be measured.

    python -m benchmarks.cpu_cost [--rounds 7] [--requests 400] [--batch 50]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from collections import defaultdict
from typing import Any

from connector.testing.otlp import OtlpGrpcReceiver
from harness import PushHarness
from harness.config import FORK, STOCK


def _diff(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before.get(k, 0.0) for k in after}


def cpu_cost_bench(rounds: int, requests: int, batch: int) -> dict[str, Any]:
    rx = OtlpGrpcReceiver()
    variants = {
        "stock": dict(connector=STOCK, tracing=None),
        "fork-off": dict(connector=FORK, tracing=None),
        "fork-on": dict(connector=FORK, tracing={"endpoint": rx.endpoint, "protocol": "grpc"}),
        "stock-AA": dict(connector=STOCK, tracing=None),  # A/A control: a second stock pair
    }
    pairs: dict[str, PushHarness] = {}
    per_req: dict[str, list[float]] = {v: [] for v in variants}
    threads: dict[str, dict[str, list[float]]] = {v: defaultdict(list) for v in variants}
    try:
        for name, kw in variants.items():
            pairs[name] = PushHarness.pd(workdir=tempfile.mkdtemp(prefix=f"bench-cpu-{name}-"),
                                         num_blocks=2 * batch + 8, **kw).start()
            assert pairs[name].push(20).ok  # warm-up: handshakes, first connections
        names = list(variants)
        for r in range(rounds):
            order = names[r % len(names):] + names[:r % len(names)]
            for name in order:
                h = pairs[name]
                before = [h[e].call("thread_cpu") for e in ("P", "D")]
                for _ in range(requests // batch):
                    h._written.clear()  # reuse the same blocks: the cache is small on purpose
                    h["P"]._next_block = h["D"]._next_block = 0
                    report = h.push(batch, verify=False)
                    assert not report.failed, report
                after = [h[e].call("thread_cpu") for e in ("P", "D")]
                spent = [_diff(a, b) for a, b in zip(after, before)]
                n = (requests // batch) * batch
                per_req[name].append(sum(sum(s.values()) for s in spent) / n)
                for side, s in zip(("P", "D"), spent):
                    for comm, sec in s.items():
                        threads[name][f"{side}:{comm}"].append(sec / n)
    finally:
        for h in pairs.values():
            h.stop()
        rx.close()
    med = {n: statistics.median(v) for n, v in per_req.items()}
    print(f"\n== CPU time per pushed request (P+D engine processes, user+system), {rounds} rounds x "
          f"{requests} requests per variant, rotating order; median [min-max]")
    for name, values in per_req.items():
        print(f"{name:>9}: {med[name] * 1e6:8.1f} us [{min(values) * 1e6:.1f}-{max(values) * 1e6:.1f}]"
              f"   x stock {med[name] / med['stock']:.3f}")
    print("per thread (median us/request, threads above 5 us in any variant):")
    keys = sorted({k for t in threads.values() for k in t})
    for key in keys:
        vals = {n: statistics.median(threads[n][key]) * 1e6 if threads[n].get(key) else 0.0
                for n in variants}
        if max(vals.values()) >= 5:
            print(f"  {key:<34} " + "  ".join(
                f"{n} {v:7.1f}" + (f" ({v / vals['stock']:.2f}x)" if vals["stock"] and n != "stock" else "")
                for n, v in vals.items()))
    return {"per_request_us": {n: v * 1e6 for n, v in med.items()},
            "ratio_to_stock": {n: med[n] / med["stock"] for n in med}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--batch", type=int, default=50)
    args = ap.parse_args(argv)
    cpu_cost_bench(args.rounds, args.requests, args.batch)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

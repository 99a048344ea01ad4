"""Push latency when the trace back-end is down or slow, next to tracing off, with an A/A control.

Telemetry must never slow the push: spans leave through the SDK's batch processor,
off the push's threads. Three pairs of fork P/D harnesses, each pair alive at once
with batches pushed through its two harnesses in alternating order: exporting
OTLP/gRPC to a port nothing listens on vs tracing off; exporting OTLP/HTTP to a
receiver that takes `--slow-s` per export vs tracing off; and tracing off vs tracing
off (the A/A control: its ratio is the noise floor). Per pair: the ratio of median
push latency (registration handed to D's worker -> D reports the KV landed), and the
median [min-max] of the per-batch ratios; and what D's span ledger counted.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from benchmarks.common import BenchRun, rank_context
from harness import PushHarness
from harness.config import FORK
from harness.otlp_receiver import OtlpHttpReceiver
from harness.ports import free_port


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--requests", type=int, default=80, help="requests per harness and pair")
    ap.add_argument("--batches", type=int, default=8)
    ap.add_argument("--slow-s", type=float, default=2.0, help="seconds the slow receiver takes per export")


def _interleaved(harnesses: dict[str, PushHarness], requests: int,
                 batches: int) -> dict[str, list[list[float]]]:
    """Push batches through each harness in alternating order; latencies per batch."""
    per_batch = max(1, requests // batches)
    lat: dict[str, list[list[float]]] = {name: [] for name in harnesses}
    for h in harnesses.values():  # the first push pays the handshakes; not measured
        assert h.push(1).ok
    names = list(harnesses)
    for i in range(batches):
        for name in names if i % 2 == 0 else names[::-1]:
            report = harnesses[name].push(per_batch)
            assert report.ok, report
            lat[name].append(list(report.latencies_s.values()))
    return lat


def _pair(a: tuple[str, dict], b: tuple[str, dict], requests: int, batches: int, ctx: Any) -> dict[str, Any]:
    """Median latency (ms) of each harness of a pair, the per-batch ratios a/b, D's ledgers."""
    (name_a, kw_a), (name_b, kw_b) = a, b
    blocks = 2 * requests + 16
    with PushHarness.pd(num_blocks=blocks, ctx=ctx, **kw_a) as ha, \
            PushHarness.pd(num_blocks=blocks, ctx=ctx, **kw_b) as hb:
        lat = _interleaved({name_a: ha, name_b: hb}, requests, batches)
        ledgers = {name: h["D"].call("span_ledger") for name, h in ((name_a, ha), (name_b, hb))}
    med = {name: statistics.median(x for batch in v for x in batch) * 1e3 for name, v in lat.items()}
    per_batch = [statistics.median(x) / statistics.median(y)
                 for x, y in zip(lat[name_a], lat[name_b], strict=True)]
    return {"a": name_a, "b": name_b, "a_ms": med[name_a], "b_ms": med[name_b],
            "ratio": med[name_a] / med[name_b], "batch_ratio": statistics.median(per_batch),
            "batch_min": min(per_batch), "batch_max": max(per_batch),
            "ledgers": ledgers}


def run(args: argparse.Namespace, bench: BenchRun) -> dict[str, Any]:
    off = ("off", {"connector": FORK})
    down = {"endpoint": f"http://127.0.0.1:{free_port()}", "protocol": "grpc"}
    slow = OtlpHttpReceiver(delay_s=args.slow_s)
    pairs: dict[str, tuple[str, tuple[str, dict], tuple[str, dict]]] = {
        "down": ("OTLP endpoint down / tracing off", ("down", {"connector": FORK, "tracing": down}), off),
        "slow": (f"OTLP receiver slow ({args.slow_s:g} s per export) / tracing off",
                 ("slow", {"connector": FORK, "tracing": {"endpoint": slow.endpoint,
                                                          "protocol": "http/protobuf"}}), off),
        "aa": ("A/A control: tracing off / tracing off",
               ("A", {"connector": FORK}), ("B", {"connector": FORK})),
    }
    rows: dict[str, dict[str, Any]] = {}
    ctx = rank_context(bench.logs)
    try:
        for key, (label, a, b) in pairs.items():
            t = time.monotonic()
            rows[key] = {"label": label, **_pair(a, b, args.requests, args.batches, ctx)}
            bench.say(f"{label}: ratio {rows[key]['ratio']:.3f} ({time.monotonic() - t:.1f} s)")
    finally:
        slow.close()
    print(f"\nPush latency with a faulty trace back-end: medians over {args.requests} requests per harness, "
          f"{args.batches} interleaved batches, both harnesses of a pair alive at once; per batch: the "
          "median [min-max] of the batches' median ratios")
    for r in rows.values():
        print(f"{r['label']:<52}: {r['a_ms']:7.2f} ms vs {r['b_ms']:7.2f} ms  ratio {r['ratio']:.3f}; "
              f"per batch {r['batch_ratio']:.3f} [{r['batch_min']:.3f}-{r['batch_max']:.3f}]")
    spread = abs(rows["aa"]["ratio"] - 1)
    print(f"A/A spread: {spread * 100:.1f}% (differences below it are noise)")
    for key in ("down", "slow"):
        print(f"D's span ledger with the {key} back-end: {rows[key]['ledgers'][key]}")
    return {"requests": args.requests, "batches": args.batches, "slow_s": args.slow_s, "pairs": rows,
            "aa_spread": spread}

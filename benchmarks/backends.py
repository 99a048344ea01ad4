"""Push latency when the trace back-end is down or slow, next to tracing off.

Three side-by-side pairs (both harnesses of a pair alive, batches interleaved, as
in `benchmarks.run`): fork exporting OTLP/gRPC to a port nothing listens on vs
tracing off; fork exporting OTLP/HTTP to a receiver that takes `slow_s` per export
vs tracing off; and an A/A control (tracing off vs tracing off) whose ratio is the
noise floor. Printed as ratios of median push latency, with the A/A spread.

    python -m benchmarks.run --backends [--requests 80] [--batches 8]
"""

from __future__ import annotations

from typing import Any

from benchmarks.run import _interleaved, latency_summary, print_ratio_rows
from harness import PushHarness
from harness.config import FORK
from harness.otlp_receiver import OtlpHttpReceiver
from harness.runner import free_port


def _pair(a: tuple[str, dict], b: tuple[str, dict], requests: int, batches: int,
          blocks: int) -> dict[str, float]:
    (name_a, kw_a), (name_b, kw_b) = a, b
    with PushHarness.pd(num_blocks=blocks, **kw_a) as ha, PushHarness.pd(num_blocks=blocks, **kw_b) as hb:
        lat = _interleaved({name_a: ha, name_b: hb}, requests, batches)
        spans = {name: h["D"].call("span_ledger") for name, h in ((name_a, ha), (name_b, hb))}
    out: dict[str, Any] = dict(latency_summary(lat, name_a, name_b))
    out.update({f"{name}_ledger": led for name, led in spans.items()})
    return out


def backends_bench(requests: int, batches: int, slow_s: float = 2.0) -> dict[str, float]:
    blocks = 2 * requests + 16
    off = ("off", {"connector": FORK})
    down = {"endpoint": f"http://127.0.0.1:{free_port()}", "protocol": "grpc"}
    slow = OtlpHttpReceiver(delay_s=slow_s)
    try:
        r_down = _pair(("down", {"connector": FORK, "tracing": down}), off, requests, batches, blocks)
        r_slow = _pair(("slow", {"connector": FORK, "tracing": {
            "endpoint": slow.endpoint, "protocol": "http/protobuf"}}), off, requests, batches, blocks)
        r_aa = _pair(("A", {"connector": FORK}), ("B", {"connector": FORK}), requests, batches, blocks)
    finally:
        slow.close()
    rows = [
        ("OTLP endpoint down / tracing off", "down", "off", r_down),
        (f"OTLP receiver slow ({slow_s:.0f} s per export) / tracing off", "slow", "off", r_slow),
        ("A/A control: tracing off / tracing off", "A", "B", r_aa),
    ]
    print(f"\n== push latency with a faulty trace back-end, medians over {requests} requests "
          f"per engine, {batches} interleaved batches, each pair alive at once")
    ratios = print_ratio_rows(rows, 52)
    spread = abs(r_aa["A"] / r_aa["B"] - 1)
    print(f"A/A spread: {spread * 100:.1f}% (differences below it are noise)")
    for name, res in (("down", r_down), ("slow", r_slow)):
        print(f"D's spans with the {name} back-end: {res[f'{name}_ledger']}")
    return ratios

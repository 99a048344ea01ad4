"""Benchmarks: what notification-only saves, and what our telemetry costs.

1. D->P handshake, fork (notification-only) vs stock (full, heartbeat path to a
   PP=1 producer), against the same large prefill engine, alternating rounds in one
   run: median wall time and RSS growth per handshake, and their ratios.
2. Push-flow latency, fork with tracing exported over OTLP/gRPC vs stock, both
   harnesses alive at once and batches interleaved: median per request and ratio.

    python -m benchmarks.run [--layers 32] [--blocks 2048] [--rounds 7] [--requests 40]
    python -m benchmarks.run --backends   # trace back-end down/slow vs off (benchmarks.backends)
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

from harness import PushHarness
from harness.config import FORK, STOCK, EngineSpec
from harness.otlp_receiver import OtlpGrpcReceiver
from harness.runner import free_port, quiet_engine_logs


def handshake_bench(layers: int, blocks: int, rounds: int) -> dict[str, float]:
    work = tempfile.mkdtemp(prefix="bench-hs-")
    # One KV head keeps P's cache at layers x blocks x 8 KiB; the decode engines'
    # own caches are small (a full D->P handshake sizes its lists by P's blocks).
    common = dict(num_layers=layers, num_kv_heads=1, workdir=work)
    specs = [
        EngineSpec(name="P", engine_id="bench-prefill", kv_role="kv_producer",
                   side_channel_port=free_port(), connector=FORK, num_blocks=blocks, **common),
        EngineSpec(name="F", engine_id="bench-fork-decode", kv_role="kv_consumer",
                   side_channel_port=free_port(), connector=FORK, num_blocks=64, **common),
        EngineSpec(name="S", engine_id="bench-stock-decode", kv_role="kv_consumer",
                   side_channel_port=free_port(), connector=STOCK, num_blocks=64, **common),
    ]
    samples: dict[str, list[dict]] = {"F": [], "S": []}
    first: dict[str, dict] = {}
    with PushHarness(specs) as h:
        target = h["P"].address
        for name in ("F", "S"):  # warm-up: first connection to P pays UCX set-up
            first[name] = h[name].call("timed_handshake", target, timeout=180)
            h[name].call("forget", target["engine_id"])
        for i in range(rounds):
            order = ("F", "S") if i % 2 == 0 else ("S", "F")
            for name in order:
                samples[name].append(h[name].call("timed_handshake", target, timeout=180))
                h[name].call("forget", target["engine_id"])
    descs = layers * blocks
    med = {n: statistics.median(s["seconds"] for s in v) for n, v in samples.items()}
    # Later rounds reuse memory the allocator kept from the first one, so RSS growth
    # is only meaningful for each engine's first handshake (one sample each).
    rss = {n: first[n]["rss_delta"] for n in first}
    assert all(s["dst_handles"] == 0 for s in samples["F"]), "fork D->P must not prepare descriptors"
    assert all(s["dst_handles"] == 1 for s in samples["S"]), "stock heartbeat D->P is full"
    print(f"\n== D->P handshake against one P with {layers} layers x {blocks} blocks "
          f"({descs} descriptors per full remote list), {rounds} alternating rounds")
    print(f"fork (notification-only): median {med['F'] * 1e3:8.2f} ms; first handshake RSS "
          f"+{rss['F'] / 2**20:7.2f} MiB")
    print(f"stock (full)            : median {med['S'] * 1e3:8.2f} ms; first handshake RSS "
          f"+{rss['S'] / 2**20:7.2f} MiB")
    print(f"ratio stock/fork time   : {med['S'] / med['F']:.2f}x")
    return {"fork_ms": med["F"] * 1e3, "stock_ms": med["S"] * 1e3, "ratio": med["S"] / med["F"],
            "fork_rss_mib": rss["F"] / 2**20, "stock_rss_mib": rss["S"] / 2**20}


def _interleaved(harnesses: dict[str, PushHarness], requests: int,
                 batches: int) -> dict[str, list[list[float]]]:
    """Push batches through each harness in alternating order; latencies per harness,
    batch by batch."""
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


def latency_summary(lat: dict[str, list[list[float]]], a: str, b: str) -> dict[str, float]:
    """Median latency (ms) of each over all its requests, and the spread of a/b over the
    interleaved batches: the median, min and max of the per-batch median ratios."""
    out = {name: statistics.median(x for batch in v for x in batch) * 1e3 for name, v in lat.items()}
    ratios = [statistics.median(x) / statistics.median(y) for x, y in zip(lat[a], lat[b], strict=True)]
    out.update(batch_ratio=statistics.median(ratios), batch_min=min(ratios), batch_max=max(ratios))
    return out


def print_ratio_rows(rows: list[tuple[str, str, str, dict[str, float]]], width: int) -> dict[str, float]:
    """One line per (label, a, b, `latency_summary` of the pair): medians, their ratio and
    the per-batch spread; returns label -> ratio of medians."""
    ratios = {}
    for label, a, b, r in rows:
        ratios[label] = r[a] / r[b]
        print(f"{label:{width}s}: {r[a]:7.2f} ms vs {r[b]:7.2f} ms  ratio {ratios[label]:.3f}; per batch "
              f"{r['batch_ratio']:.3f} [{r['batch_min']:.3f}-{r['batch_max']:.3f}]")
    return ratios


def _pair(a: tuple[str, dict], b: tuple[str, dict], requests: int, batches: int,
          blocks: int) -> dict[str, float]:
    """Latencies of two harnesses alive at once, batches interleaved (`latency_summary`)."""
    (name_a, kw_a), (name_b, kw_b) = a, b
    with PushHarness.pd(num_blocks=blocks, **kw_a) as ha, PushHarness.pd(num_blocks=blocks, **kw_b) as hb:
        lat = _interleaved({name_a: ha, name_b: hb}, requests, batches)
        for h in (ha, hb):
            for engine in ("P", "D"):
                h[engine].call("spans")  # flush any batch span processor before stopping
    return latency_summary(lat, name_a, name_b)


def push_bench(requests: int, batches: int) -> dict[str, float]:
    """Three side-by-side pairs: fork vs stock, fork traced vs untraced, and an A/A control."""
    blocks = 2 * requests + 16
    receiver = OtlpGrpcReceiver()
    tracing = {"endpoint": receiver.endpoint, "protocol": "grpc"}
    try:
        vs_stock = _pair(("fork", {"connector": FORK}), ("stock", {"connector": STOCK}),
                         requests, batches, blocks)
        traced = _pair(("traced", {"connector": FORK, "tracing": tracing}),
                       ("off", {"connector": FORK}), requests, batches, blocks)
        control = _pair(("A", {"connector": FORK}), ("B", {"connector": FORK}), requests, batches, blocks)
        time.sleep(1.0)
        spans = len(receiver.snapshot())
    finally:
        receiver.close()
    rows = [
        ("fork (tracing off) / stock", "fork", "stock", vs_stock),
        ("fork OTLP/gRPC traced / fork tracing off", "traced", "off", traced),
        ("A/A control: fork / fork", "A", "B", control),
    ]
    print(f"\n== push flow latency (registration handed to D's worker -> D reports the KV landed), "
          f"medians over {requests} requests per engine pair, {batches} interleaved batches; "
          "each pair runs with both harnesses alive; per batch: the median [min-max] of the "
          "batches' median ratios")
    ratios = print_ratio_rows(rows, 42)
    print(f"spans exported by the traced pair: {spans}")
    return ratios


def step_bench(rounds: int = 5, steps: int = 2000) -> dict[str, float]:
    """Cost of one idle engine-loop step (start_load_kv + get_transfer_results + stats),
    and of each connector call in it."""
    samples: dict[str, list[float]] = {"fork": [], "stock": []}
    parts: dict[str, list[dict[str, float]]] = {"fork": [], "stock": []}
    with PushHarness.pd(connector=FORK) as fork, PushHarness.pd(connector=STOCK) as stock:
        pair = [("fork", fork), ("stock", stock)]
        for h in (fork, stock):
            assert h.push(2).ok
        for i in range(rounds):
            for name, h in pair if i % 2 == 0 else pair[::-1]:
                samples[name].extend(h[e].call("step_cost", steps) for e in ("P", "D"))
                parts[name].extend(h[e].call("step_parts", steps) for e in ("P", "D"))
    return _step_report(f"idle engine-loop step (worker start_load_kv + get_transfer_results + stats), "
                        f"median of {rounds} rounds x {steps} steps per engine", samples, parts)


def _step_report(title: str, samples: dict[str, list[float]],
                 parts: dict[str, list[dict[str, float]]]) -> dict[str, float]:
    """Print fork vs stock step medians and the per-call table; the medians in us."""
    med = {n: statistics.median(v) * 1e6 for n, v in samples.items()}
    print(f"\n== {title}")
    print(f"fork {med['fork']:.2f} us vs stock {med['stock']:.2f} us  ratio {med['fork'] / med['stock']:.2f} "
          f"(+{med['fork'] - med['stock']:.2f} us per step)")
    print("per connector call (median us):")
    for call in parts["fork"][0]:
        f, s = (statistics.median(p[call] for p in parts[n]) * 1e6 for n in ("fork", "stock"))
        print(f"  {call:<24} fork {f:6.2f}  stock {s:6.2f}  +{f - s:5.2f}")
    return med


def step_ab_bench(rounds: int = 8, steps: int = 3000) -> dict[str, float]:
    """The same idle step in one pair of fork engines, their classes swapped for vLLM's
    stock ones between rounds (`harness/stock_swap.py`): no pair offset in the difference."""
    samples: dict[str, list[float]] = {"fork": [], "stock": []}
    parts: dict[str, list[dict[str, float]]] = {"fork": [], "stock": []}
    with PushHarness.pd(connector=FORK) as h:
        assert h.push(2).ok
        for i in range(rounds):
            for name in ("fork", "stock") if i % 2 == 0 else ("stock", "fork"):
                h.stock_mode(name == "stock")
                samples[name].extend(h[e].call("step_cost", steps) for e in ("P", "D"))
                parts[name].extend(h[e].call("step_parts", steps) for e in ("P", "D"))
        h.stock_mode(False)
    return _step_report(f"the same idle step in one process, fork vs its stock swap, median of {rounds} "
                        f"alternating rounds x {steps} steps per engine", samples, parts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--blocks", type=int, default=16384)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--requests", type=int, default=80)
    parser.add_argument("--skip-push", action="store_true")
    parser.add_argument("--skip-handshake", action="store_true")
    parser.add_argument("--batches", type=int, default=8)
    parser.add_argument("--backends", action="store_true",
                        help="only: push latency with the trace back-end down or slow (benchmarks.backends)")
    args = parser.parse_args(argv)
    quiet_engine_logs("bench-run-logs-")
    if args.backends:
        from benchmarks.backends import backends_bench

        backends_bench(args.requests, args.batches)
        return 0
    if not args.skip_handshake:
        handshake_bench(args.layers, args.blocks, args.rounds)
    if not args.skip_push:
        push_bench(args.requests, args.batches)
    step_bench()
    step_ab_bench()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

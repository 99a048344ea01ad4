"""Benchmarks: what notification-only saves, and what our telemetry costs.

1. D->P handshake, fork (notification-only) vs stock (full, heartbeat path to a
   PP=1 producer), against the same large prefill engine, alternating rounds in one
   run: median wall time and RSS growth per handshake, and their ratios.
2. Push-flow latency, fork with tracing exported over OTLP/gRPC vs stock, both
   harnesses alive at once and batches interleaved: median per request and ratio.

    python -m benchmarks.run [--layers 32] [--blocks 2048] [--rounds 7] [--requests 40]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

from connector.testing.otlp import OtlpGrpcReceiver
from harness import PushHarness
from harness.config import FORK, STOCK, EngineSpec
from harness.runner import free_port


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


def push_bench(requests: int, batches: int) -> dict[str, float]:
    receiver = OtlpGrpcReceiver()
    per_batch = max(1, requests // batches)
    lat: dict[str, list[float]] = {"fork": [], "stock": []}
    blocks = 2 * requests + 16
    try:
        fork = PushHarness.pd(connector=FORK, num_blocks=blocks,
                              tracing={"endpoint": receiver.endpoint, "protocol": "grpc"})
        stock = PushHarness.pd(connector=STOCK, num_blocks=blocks)
        with fork, stock:
            for h in (fork, stock):  # first push pays the handshakes; not measured
                assert h.push(1).ok
            for i in range(batches):
                pair = [("fork", fork), ("stock", stock)]
                order = pair if i % 2 == 0 else pair[::-1]
                for name, h in order:
                    report = h.push(per_batch)
                    assert report.ok, report
                    lat[name].extend(report.latencies_s.values())
            fork["P"].call("spans")
            time.sleep(1.0)
        spans = len(receiver.snapshot())
    finally:
        receiver.close()
    med = {n: statistics.median(v) for n, v in lat.items()}
    print(f"\n== push flow, {len(lat['fork'])} requests per connector in {batches} interleaved batches "
          "(registration handed to D's worker -> D reports the KV landed)")
    print(f"fork + OTLP tracing : median {med['fork'] * 1e3:7.2f} ms ({spans} spans exported)")
    print(f"stock               : median {med['stock'] * 1e3:7.2f} ms")
    print(f"ratio fork/stock    : {med['fork'] / med['stock']:.3f}")
    return {"fork_ms": med["fork"] * 1e3, "stock_ms": med["stock"] * 1e3,
            "ratio": med["fork"] / med["stock"], "spans": spans}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--blocks", type=int, default=16384)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--requests", type=int, default=40)
    parser.add_argument("--skip-push", action="store_true")
    parser.add_argument("--batches", type=int, default=4)
    args = parser.parse_args(argv)
    handshake_bench(args.layers, args.blocks, args.rounds)
    if not args.skip_push:
        push_bench(args.requests, args.batches)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

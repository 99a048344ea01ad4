"""What one D->P handshake costs by P's KV cache size: notification-only (fork) vs full (stock).

Stock vLLM does a full handshake when a heartbeat reaches a PP=1 producer first: it
prepares a descriptor list over all of P's KV blocks that push mode never uses. The
fork's D->P handshake is notification-only. Per size (layers x blocks per layer): one
fork prefill P with that cache, a fork decoder F and a stock decoder S take turns
(alternating order) doing a heartbeat-style handshake with P, forgetting P after
each. Per decoder: median wall time, the descriptors it asked NIXL to prepare
(counted by the harness's NIXL call log, not by the connector), and the RSS growth of
its first handshake (later ones reuse what the allocator kept); F's phases come from
its own handshake records. The cache has one KV head of dimension `--head-dim`
(4: 1 KiB per block and layer), so descriptor counts are a real model's while P's
cache fits in memory.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

from benchmarks.common import BenchRun, caption, plt, rank_context
from harness import PushHarness
from harness.config import FORK, STOCK, EngineSpec
from harness.poll import wait_until
from harness.ports import free_port

DEFAULT_SIZES = "32x8192,32x32768,80x8192,80x32768"


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--sizes", default=DEFAULT_SIZES,
                    help=f"P's cache sizes, LAYERSxBLOCKS, comma-separated (default {DEFAULT_SIZES})")
    ap.add_argument("--rounds", type=int, default=5, help="measured handshakes per decoder and size")
    ap.add_argument("--head-dim", type=int, default=4)


def _sizes(text: str) -> list[tuple[int, int]]:
    return [(int(a), int(b)) for a, b in (s.lower().split("x") for s in text.split(","))]


def _specs(layers: int, blocks: int, head_dim: int, work: str) -> list[EngineSpec]:
    common = dict(num_layers=layers, num_kv_heads=1, head_dim=head_dim, workdir=work)
    tag = f"{layers}x{blocks}"
    return [
        EngineSpec(name="P", engine_id=f"hs-{tag}-prefill", kv_role="kv_producer",
                   side_channel_port=free_port(), connector=FORK, num_blocks=blocks, **common),
        EngineSpec(name="F", engine_id=f"hs-{tag}-fork-decode", kv_role="kv_consumer",
                   side_channel_port=free_port(), connector=FORK, num_blocks=64, **common),
        EngineSpec(name="S", engine_id=f"hs-{tag}-stock-decode", kv_role="kv_consumer",
                   side_channel_port=free_port(), connector=STOCK, num_blocks=64, **common),
    ]


def handshake_records(h: PushHarness, engine: str, n: int, timeout_s: float = 60.0) -> list[dict[str, Any]]:
    """The next `n` handshake records `engine` reports through its connector stats."""
    got: list[dict[str, Any]] = []

    def enough() -> bool:
        got.extend(r for s in h.stats(engine) for r in s.get("handshakes", []))
        return len(got) >= n

    wait_until(enough, f"{n} handshake records from {engine}", timeout_s, interval_s=0.05,
               last=lambda: f"{len(got)} records")
    return got


def size_rounds(h: PushHarness, layers: int, blocks: int, rounds: int) -> dict[str, Any]:
    """F and S take turns handshaking with P; the first handshake of each gives RSS growth."""
    seconds: dict[str, list[float]] = {"F": [], "S": []}
    descriptors: dict[str, list[int]] = {"F": [], "S": []}
    first: dict[str, dict[str, Any]] = {}
    target = h["P"].address
    h.stats("F")
    for i in range(rounds + 1):
        for name in ("F", "S") if i % 2 == 0 else ("S", "F"):
            res = h[name].call("timed_handshake", target, timeout=600)
            h[name].call("forget", target["engine_id"])
            if i == 0:
                first[name] = res
                continue
            seconds[name].append(res["seconds"])
            descriptors[name].append(res["descriptors"])
    records = handshake_records(h, "F", rounds + 1)[1:]
    phases = sorted({p for r in records for p in r["phases"]})
    med = {n: statistics.median(v) * 1e3 for n, v in seconds.items()}
    return {"layers": layers, "blocks": blocks,
            "fork_ms": med["F"], "stock_ms": med["S"], "stock_over_fork": med["S"] / med["F"],
            "fork_spread_ms": [min(seconds["F"]) * 1e3, max(seconds["F"]) * 1e3],
            "stock_spread_ms": [min(seconds["S"]) * 1e3, max(seconds["S"]) * 1e3],
            "fork_descriptors": max(descriptors["F"]), "stock_descriptors": max(descriptors["S"]),
            "fork_saved_descriptors": max((r.get("saved_descriptors", 0) for r in records), default=0),
            "fork_notif_only": all(r["notif_only"] for r in records),
            "fork_phases_ms": {p: statistics.median(r["phases"].get(p, 0.0) for r in records) * 1e3
                               for p in phases},
            "fork_first_rss_mib": first["F"]["rss_delta"] / 2**20,
            "stock_first_rss_mib": first["S"]["rss_delta"] / 2**20}


def run(args: argparse.Namespace, bench: BenchRun) -> dict[str, Any]:
    work = str(bench.work)
    rows = []
    for layers, blocks in _sizes(args.sizes):  # one P per size: its cache is the big part
        t = time.monotonic()
        with PushHarness(_specs(layers, blocks, args.head_dim, work), ctx=rank_context(bench.logs)) as h:
            bench.say(f"{layers} layers x {blocks} blocks: P, fork D and stock D up in "
                      f"{time.monotonic() - t:.1f} s")
            t = time.monotonic()
            row = size_rounds(h, layers, blocks, args.rounds)
            rows.append(row)
            bench.say(f"{layers} x {blocks}: fork {row['fork_ms']:.1f} ms, stock {row['stock_ms']:.1f} ms "
                      f"({args.rounds} rounds each, {time.monotonic() - t:.1f} s)")
    print(f"\nD->P handshake by P's cache size, medians of {args.rounds} alternating rounds "
          f"(descriptors: prepared for P's blocks, from the NIXL call log)")
    print(f"{'layers x blocks':>16} {'fork ms':>8} {'stock ms':>9} {'stock/fork':>10} "
          f"{'descriptors fork / stock':>25} {'first RSS fork / stock':>23}")
    for r in rows:
        print(f"{r['layers']:>7} x {r['blocks']:>6} {r['fork_ms']:>8.1f} {r['stock_ms']:>9.1f} "
              f"{r['stock_over_fork']:>9.2f}x {r['fork_descriptors']:>11} / {r['stock_descriptors']:<11} "
              f"{r['fork_first_rss_mib']:>+8.1f} / {r['stock_first_rss_mib']:+.1f} MiB")
    for r in rows:
        phases = ", ".join(f"{p} {ms:.1f}" for p, ms in r["fork_phases_ms"].items())
        print(f"  fork phases at {r['layers']} x {r['blocks']} (ms): {phases}")
    return {"rounds": args.rounds, "head_dim": args.head_dim, "sizes": rows}


def chart(result: dict[str, Any], path: Path) -> None:
    pyplot = plt()
    rows = result["sizes"]
    fig, ax = pyplot.subplots(figsize=(7, 4))
    x = range(len(rows))
    ax.bar([i - 0.2 for i in x], [r["fork_ms"] for r in rows], 0.4, label="fork (notification-only)")
    ax.bar([i + 0.2 for i in x], [r["stock_ms"] for r in rows], 0.4, label="stock (full)")
    ax.set_xticks(list(x), [f"{r['layers']} x {r['blocks']}" for r in rows])
    ax.set_xlabel("P's KV cache (layers x blocks)")
    ax.set_ylabel("D->P handshake, median ms")
    ax.set_title(f"D->P handshake by P's cache size ({caption(result)})", fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    pyplot.close(fig)

"""Scale: D->P handshake full vs notification-only at real model sizes, and one D against M producers.

1. Sizes. For layers in {32, 80} x blocks per layer in {8192, 32768}: one fork
   prefill P with that cache, a fork decoder F and a stock decoder S, alternating
   rounds of a heartbeat-style D->P handshake (F: notification-only; S: full, the
   upstream heartbeat path to a PP=1 producer). Per size: median wall time of each,
   F's phase medians (from its own handshake records), S's descriptor preparation
   share, and RSS growth of each decoder's first handshake. The cache uses one KV
   head of dimension 4 (1 KiB per block and layer), so the descriptor counts are
   those of a real model while P's cache fits in a few GiB.
2. Producers. One fork and one stock decoder and M fork prefills (M in {1, 4, 16});
   each decoder handshakes with all M at once: time until the last is done, and the largest
   `queue_wait` phase (vLLM runs handshakes one at a time on its one-thread
   executor, so the M-th waits for the M-1 before it), fork and stock decoders side
   by side.

Writes a JSON file and a PNG chart next to it (paths printed); engine logs go to
files in the same directory.

    python -m benchmarks.scale [--rounds 3] [--out .cache/bench] [--smoke]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from harness import PushHarness
from harness.config import FORK, STOCK, EngineSpec
from harness.ports import free_port
from harness.runner import LOG_DIR_ENV

SIZES = [(32, 8192), (32, 32768), (80, 8192), (80, 32768)]
PRODUCERS = [1, 4, 16]
SMOKE_SIZES = [(2, 512)]
SMOKE_PRODUCERS = [1, 2]
HEAD_DIM = 4  # with one KV head and float32: 1 KiB per block and layer


def _say(msg: str, t0: float) -> None:
    print(f"  [{time.monotonic() - t0:6.1f} s] {msg}", flush=True)


def _handshake_records(h: PushHarness, engine: str, n: int, timeout_s: float = 60.0) -> list[dict]:
    out: list[dict] = []
    deadline = time.monotonic() + timeout_s
    while len(out) < n and time.monotonic() < deadline:
        out += [r for s in h.stats(engine) for r in s.get("handshakes", [])]
        time.sleep(0.05)
    return out


def _specs(layers: int, p_blocks: list[int], work: str, tag: str) -> list[EngineSpec]:
    """Fork prefills P0.. (one per entry of `p_blocks`), a fork decoder F and a stock decoder S."""
    common = dict(num_layers=layers, num_kv_heads=1, head_dim=HEAD_DIM, workdir=work)
    specs = [EngineSpec(name=f"P{i}", engine_id=f"scale-{tag}-p{i}", kv_role="kv_producer",
                        side_channel_port=free_port(), connector=FORK, num_blocks=b, **common)
             for i, b in enumerate(p_blocks)]
    return [
        *specs,
        EngineSpec(name="F", engine_id=f"scale-{tag}-fork-decode", kv_role="kv_consumer",
                   side_channel_port=free_port(), connector=FORK, num_blocks=64, **common),
        EngineSpec(name="S", engine_id=f"scale-{tag}-stock-decode", kv_role="kv_consumer",
                   side_channel_port=free_port(), connector=STOCK, num_blocks=64, **common)]


def size_rounds(h: PushHarness, layers: int, blocks: int, rounds: int, t0: float) -> dict[str, Any]:
    """F and S take turns handshaking with P0 (`blocks` per layer); round 0 gives RSS growth."""
    samples: dict[str, list[float]] = {"F": [], "S": []}
    first: dict[str, dict[str, Any]] = {}
    target = h["P0"].address
    h.stats("F")
    for i in range(rounds + 1):
        for name in ("F", "S") if i % 2 == 0 else ("S", "F"):
            res = h[name].call("timed_handshake", target, timeout=300)
            if i == 0:
                first[name] = res
            else:
                samples[name].append(res["seconds"])
            h[name].call("forget", target["engine_id"])
    records = _handshake_records(h, "F", rounds + 1)
    measured = records[1:] or records
    names = {phase for rec in measured for phase in rec["phases"]}
    phases = {p: statistics.median(r["phases"].get(p, 0.0) for r in measured) * 1e3 for p in sorted(names)}
    med = {n: statistics.median(v) * 1e3 for n, v in samples.items()}
    row = {"layers": layers, "blocks": blocks, "descriptors_per_list": layers * blocks,
           "fork_ms": med["F"], "stock_ms": med["S"], "stock_over_fork": med["S"] / med["F"],
           "fork_spread_ms": [min(samples["F"]) * 1e3, max(samples["F"]) * 1e3],
           "stock_spread_ms": [min(samples["S"]) * 1e3, max(samples["S"]) * 1e3],
           "fork_phases_ms": phases,
           "fork_first_rss_mib": first["F"]["rss_delta"] / 2**20,
           "stock_first_rss_mib": first["S"]["rss_delta"] / 2**20,
           "fork_saved_descriptors": records[-1]["saved_descriptors"] if records else None}
    _say(f"{layers} x {blocks}: fork {med['F']:.1f} ms, stock {med['S']:.1f} ms", t0)
    return row


def producer_rounds(h: PushHarness, ms: list[int], rounds: int, t0: float) -> list[dict[str, Any]]:
    """F and S each handshake with the first M prefills at once, for each M."""
    targets = [h[f"P{i}"].address for i in range(max(ms))]
    for name in ("F", "S"):  # warm-up: first UCX connections
        h[name].call("timed_handshakes", targets, timeout=600)
        for t in targets:
            h[name].call("forget", t["engine_id"])
    h.stats("F")
    rows = []
    for m in ms:
        wall: dict[str, list[float]] = {"F": [], "S": []}
        queue_max: list[float] = []
        for i in range(rounds):
            for name in ("F", "S") if i % 2 == 0 else ("S", "F"):
                wall[name].append(h[name].call("timed_handshakes", targets[:m], timeout=600)["seconds"])
                for t in targets[:m]:
                    h[name].call("forget", t["engine_id"])
            recs = _handshake_records(h, "F", m)
            queue_max.append(max((r["phases"].get("queue_wait", 0.0) for r in recs), default=0.0))
        row = {"producers": m, "fork_all_done_ms": statistics.median(wall["F"]) * 1e3,
               "stock_all_done_ms": statistics.median(wall["S"]) * 1e3,
               "fork_max_queue_wait_ms": statistics.median(queue_max) * 1e3}
        rows.append(row)
        _say(f"M={m}: all done fork {row['fork_all_done_ms']:.1f} ms, stock "
             f"{row['stock_all_done_ms']:.1f} ms; fork max queue_wait "
             f"{row['fork_max_queue_wait_ms']:.1f} ms", t0)
    return rows


def full_run(rounds: int, work: str, t0: float) -> dict[str, Any]:
    sizes = []
    for layers, blocks in SIZES:  # one P per size: its cache is the big part
        with PushHarness(_specs(layers, [blocks], work, f"{layers}x{blocks}")) as h:
            _say(f"{layers} layers x {blocks} blocks: engines up", t0)
            sizes.append(size_rounds(h, layers, blocks, rounds, t0))
    with PushHarness(_specs(2, [64] * max(PRODUCERS), work, "m")) as h:
        _say(f"{max(PRODUCERS)} producers and 2 decoders up", t0)
        producers = producer_rounds(h, PRODUCERS, rounds, t0)
    return {"sizes": sizes, "producers": producers}


def smoke_run(work: str, t0: float) -> dict[str, Any]:
    """Both parts on one set of four small engines (CI: it runs, no thresholds)."""
    (layers, blocks), = SMOKE_SIZES
    with PushHarness(_specs(layers, [blocks] + [64] * (max(SMOKE_PRODUCERS) - 1), work, "smoke")) as h:
        _say("smoke engines up", t0)
        return {"sizes": [size_rounds(h, layers, blocks, 1, t0)],
                "producers": producer_rounds(h, SMOKE_PRODUCERS, 1, t0)}


def chart(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    sizes = result["sizes"]
    labels = [f"{r['layers']}L x {r['blocks'] // 1024}k" for r in sizes]
    x = range(len(sizes))
    a.bar([i - 0.2 for i in x], [r["fork_ms"] for r in sizes], 0.4, label="fork (notification-only)")
    a.bar([i + 0.2 for i in x], [r["stock_ms"] for r in sizes], 0.4, label="stock (full)")
    a.set_xticks(list(x), labels)
    a.set_ylabel("D->P handshake, median ms")
    a.set_title("Handshake by P's cache size")
    a.legend()
    prods = result["producers"]
    ms = [r["producers"] for r in prods]
    b.plot(ms, [r["fork_all_done_ms"] for r in prods], "o-", label="fork: all done")
    b.plot(ms, [r["stock_all_done_ms"] for r in prods], "s-", label="stock: all done")
    b.plot(ms, [r["fork_max_queue_wait_ms"] for r in prods], "^--", label="fork: max queue_wait")
    b.set_xlabel("producers one decoder handshakes with at once")
    b.set_ylabel("ms (median)")
    b.set_title("One D, M producers")
    b.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def print_tables(result: dict[str, Any]) -> None:
    print("\n== D->P handshake by P's cache size (median of rounds; fork phases in ms)")
    print(f"{'layers x blocks':>16} {'descs/list':>10} {'fork ms':>9} {'stock ms':>9} {'stock/fork':>10} "
          f"{'RSS fork':>9} {'RSS stock':>10}  fork phases")
    for r in result["sizes"]:
        ph = " ".join(f"{k}={v:.1f}" for k, v in r["fork_phases_ms"].items() if v >= 0.05)
        print(f"{r['layers']:>7} x {r['blocks']:>6} {r['descriptors_per_list']:>10} {r['fork_ms']:>9.1f} "
              f"{r['stock_ms']:>9.1f} {r['stock_over_fork']:>9.2f}x {r['fork_first_rss_mib']:>7.1f}Mi "
              f"{r['stock_first_rss_mib']:>8.1f}Mi  {ph}")
    print("\n== One decoder, M producers at once (median ms)")
    print(f"{'M':>3} {'fork all done':>14} {'stock all done':>15} {'fork max queue_wait':>20}")
    for r in result["producers"]:
        print(f"{r['producers']:>3} {r['fork_all_done_ms']:>14.1f} {r['stock_all_done_ms']:>15.1f} "
              f"{r['fork_max_queue_wait_ms']:>20.1f}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=".cache/bench")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, M in {1, 2}: checks it runs")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault(LOG_DIR_ENV, str(out / "engine-logs"))
    Path(os.environ[LOG_DIR_ENV]).mkdir(parents=True, exist_ok=True)
    print(f"engine logs: {os.environ[LOG_DIR_ENV]}", flush=True)
    t0 = time.monotonic()
    work = tempfile.mkdtemp(prefix="bench-scale-")
    rounds = 1 if args.smoke else args.rounds
    result: dict[str, Any] = {"rounds": rounds, "head_dim": HEAD_DIM,
                              **(smoke_run(work, t0) if args.smoke else full_run(rounds, work, t0))}
    print_tables(result)
    stem = "scale-smoke" if args.smoke else "scale"
    (out / f"{stem}.json").write_text(json.dumps(result, indent=1))
    chart(result, out / f"{stem}.png")
    print(f"\nwrote {out / f'{stem}.json'} and {out / f'{stem}.png'} ({time.monotonic() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

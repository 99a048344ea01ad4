"""The first request to a new decoder: P's blocks finished -> D has the KV, early P->D handshake vs upstream.

Upstream P starts its full P->D handshake (descriptors for all of D's blocks) only at
the WRITE, so the first request from a new D pays prefill + handshake + WRITE in
series. The fork starts it when D's PUSH_REG arrives, overlapping the prefill.

Engines: one fork D with `--d-blocks` blocks per layer, a fork P and a stock P. Each
round, per P (alternating order): P forgets D (vLLM's TTL eviction path, so the next
request is a first one again), D registers a request, P's prefill takes
`--prefill-ms`, P finishes, and the time from P's finish to D's finished receive is
measured (both on the machine's monotonic clock). Then the same for a request to the
already-connected D (steady state: must not change). Bytes are verified each time.
"""

from __future__ import annotations

import argparse
import secrets
import statistics
import time
from typing import Any

from benchmarks.common import BenchRun, rank_context
from harness import PushHarness
from harness.config import FORK, STOCK, EngineSpec
from harness.poll import wait_until
from harness.ports import free_port

PRODUCERS = {"F": "fork", "S": "stock"}


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--d-blocks", type=int, default=4096, help="D's blocks per layer")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--prefill-ms", type=float, default=300.0)


def _one(h: PushHarness, prefill: str, prefill_s: float, forget: bool) -> float:
    """One request through P `prefill` to D; seconds from P's finish to D's receive."""
    p, d = h[prefill], h["D"]
    if forget:
        p.call("forget", d.info["engine_id"])
    base = f"cmpl-{secrets.token_hex(6)}"
    p_id, d_id = f"{base}-{secrets.token_hex(4)}", f"{base}-{secrets.token_hex(4)}"
    p_blocks, d_blocks = p.allocate(2), d.allocate(2)
    p.call("fill", p_blocks, 7)
    d.call("register", d_id, d_blocks, p.address, p_id, False)
    time.sleep(prefill_s)  # the prefill (the benchmark's model of time, not a synchronisation)
    t_finish = p.call("now")
    p.call("finish", p_id, p_blocks, 30.0)
    done = wait_until(lambda: d.call("results", [d_id])["finished_recving"].get(d_id),
                      f"{d_id} received through {prefill}", 120, interval_s=0.002)
    if p.call("digest", p_blocks) != d.call("digest", d_blocks):
        raise RuntimeError(f"{prefill}: bytes differ")
    return done - t_finish


def run(args: argparse.Namespace, bench: BenchRun) -> dict[str, Any]:
    work = str(bench.work)
    common = dict(num_layers=args.layers, num_kv_heads=1, workdir=work)
    # D's blocks are what P's full handshake prepares descriptors for; P's own cache is small.
    p_blocks = 4 * args.rounds + 16
    specs = [
        EngineSpec(name="F", engine_id="first-fork-prefill", kv_role="kv_producer",
                   side_channel_port=free_port(), connector=FORK, num_blocks=p_blocks, **common),
        EngineSpec(name="S", engine_id="first-stock-prefill", kv_role="kv_producer",
                   side_channel_port=free_port(), connector=STOCK, num_blocks=p_blocks, **common),
        EngineSpec(name="D", engine_id="first-decode", kv_role="kv_consumer",
                   side_channel_port=free_port(), connector=FORK, num_blocks=args.d_blocks, **common),
    ]
    prefill_s = args.prefill_ms / 1e3
    samples: dict[str, dict[str, list[float]]] = {"first": {"F": [], "S": []}, "steady": {"F": [], "S": []}}
    t = time.monotonic()
    with PushHarness(specs, ctx=rank_context(bench.logs)) as h:
        bench.say(f"fork P, stock P and D up in {time.monotonic() - t:.1f} s")
        for name in PRODUCERS:  # warm-up: D->P connection and UCX set-up, not measured
            _one(h, name, 0.0, forget=False)
        for i in range(args.rounds):
            t = time.monotonic()
            for name in ("F", "S") if i % 2 == 0 else ("S", "F"):
                samples["first"][name].append(_one(h, name, prefill_s, forget=True))
                samples["steady"][name].append(_one(h, name, prefill_s, forget=False))
            fork, stock = samples["first"]["F"][-1], samples["first"]["S"][-1]
            bench.say(f"round {i + 1}/{args.rounds}: first request fork {fork * 1e3:.1f} ms, "
                      f"stock {stock * 1e3:.1f} ms ({time.monotonic() - t:.1f} s)")
    out: dict[str, Any] = {"rounds": args.rounds, "layers": args.layers, "d_blocks": args.d_blocks,
                           "prefill_ms": args.prefill_ms}
    print(f"\nFirst request to a new D: P finished -> D has the KV ({args.layers} layers x {args.d_blocks} "
          f"D blocks in P's full handshake; prefill {args.prefill_ms:.0f} ms; {args.rounds} alternating "
          f"rounds, medians [min-max])")
    for kind, by_p in samples.items():
        f, s = (statistics.median(by_p[n]) * 1e3 for n in ("F", "S"))
        out.update({f"{kind}_fork_ms": f, f"{kind}_stock_ms": s,
                    f"{kind}_fork_spread_ms": [min(by_p["F"]) * 1e3, max(by_p["F"]) * 1e3],
                    f"{kind}_stock_spread_ms": [min(by_p["S"]) * 1e3, max(by_p["S"]) * 1e3]})
        print(f"{kind:>6}: fork {f:8.2f} ms [{min(by_p['F']) * 1e3:.1f}-{max(by_p['F']) * 1e3:.1f}]   "
              f"stock {s:8.2f} ms [{min(by_p['S']) * 1e3:.1f}-{max(by_p['S']) * 1e3:.1f}]   "
              f"stock/fork {s / f:5.2f}x")
    return out

"""First request to a new decoder: P's blocks finished -> D has the KV, fork vs stock.

Upstream P starts its full P->D handshake (descriptors for all of D's blocks) only at
the WRITE, so the first request from a new D pays prefill + handshake + WRITE in
series. The fork starts it when D's PUSH_REG arrives, overlapping the prefill.

Set-up (real engines): one fork D with `--d-blocks` blocks per layer, a fork P and a
stock P. Each round, per P (alternating order): P forgets D (vLLM's TTL eviction
path, so the next request is a "first" one again), D registers a request, P's
prefill runs for `--prefill-ms`, P finishes, and we time P's finish -> D's
finished_recving (both clocks are the machine's monotonic clock). Then the same for
a request to the already-connected D (steady state, must be unchanged).

    python -m benchmarks.first_request [--rounds 7] [--d-blocks 4096] [--layers 8] [--prefill-ms 300]
"""

from __future__ import annotations

import argparse
import secrets
import statistics
import tempfile
import time
from typing import Any

from harness import PushHarness
from harness.config import FORK, STOCK, EngineSpec
from harness.runner import free_port, quiet_engine_logs


def _one(h: PushHarness, prefill: str, prefill_s: float, forget: bool) -> float:
    p, d = h[prefill], h["D"]
    if forget:
        p.call("forget", d.info["engine_id"])
    base = f"cmpl-{secrets.token_hex(6)}"
    p_id, d_id = f"{base}-{secrets.token_hex(4)}", f"{base}-{secrets.token_hex(4)}"
    p_blocks, d_blocks = p.allocate(2), d.allocate(2)
    p.call("fill", p_blocks, 7)
    d.call("register", d_id, d_blocks, p.address, p_id, False)
    time.sleep(prefill_s)  # the prefill (a benchmark's model of time, not a synchronisation)
    t_finish = p.call("now")
    p.call("finish", p_id, p_blocks, 30.0)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        done = d.call("results")["finished_recving"]
        if d_id in done:
            if p.call("digest", p_blocks) != d.call("digest", d_blocks):
                raise RuntimeError(f"{prefill}: bytes differ")
            return done[d_id] - t_finish
        time.sleep(0.002)
    raise RuntimeError(f"{prefill}: push did not complete")


def first_request_bench(rounds: int, d_blocks: int, layers: int, prefill_ms: float) -> dict[str, Any]:
    work = tempfile.mkdtemp(prefix="bench-first-")
    common = dict(num_layers=layers, num_kv_heads=1, workdir=work)
    # D's blocks are what P's full handshake prepares descriptors for; P's own cache is small.
    specs = [
        EngineSpec(name="F", engine_id="first-fork-prefill", kv_role="kv_producer",
                   side_channel_port=free_port(), connector=FORK, num_blocks=4 * rounds + 16, **common),
        EngineSpec(name="S", engine_id="first-stock-prefill", kv_role="kv_producer",
                   side_channel_port=free_port(), connector=STOCK, num_blocks=4 * rounds + 16, **common),
        EngineSpec(name="D", engine_id="first-decode", kv_role="kv_consumer",
                   side_channel_port=free_port(), connector=FORK, num_blocks=d_blocks, **common),
    ]
    prefill_s = prefill_ms / 1e3
    first: dict[str, list[float]] = {"F": [], "S": []}
    steady: dict[str, list[float]] = {"F": [], "S": []}
    with PushHarness(specs) as h:
        for name in ("F", "S"):  # warm-up: D->P connection and UCX set-up, not measured
            _one(h, name, 0.0, forget=False)
        for i in range(rounds):
            for name in ("F", "S") if i % 2 == 0 else ("S", "F"):
                first[name].append(_one(h, name, prefill_s, forget=True))
                steady[name].append(_one(h, name, prefill_s, forget=False))
    med = {k: {n: statistics.median(v) for n, v in d.items()} for k, d in
           (("first", first), ("steady", steady))}
    spread = {k: {n: (min(v), max(v)) for n, v in d.items()} for k, d in
              (("first", first), ("steady", steady))}
    print(f"\n== First request to a new D: P finished -> D has the KV ({layers} layers x "
          f"{d_blocks} D blocks = {layers * d_blocks} descriptors in P's full handshake; "
          f"prefill {prefill_ms:.0f} ms; {rounds} alternating rounds, medians [min-max])")
    for kind in ("first", "steady"):
        f, s = med[kind]["F"], med[kind]["S"]
        (flo, fhi), (slo, shi) = spread[kind]["F"], spread[kind]["S"]
        print(f"{kind:>6}: fork {f * 1e3:8.2f} ms [{flo * 1e3:.1f}-{fhi * 1e3:.1f}]   "
              f"stock {s * 1e3:8.2f} ms [{slo * 1e3:.1f}-{shi * 1e3:.1f}]   stock/fork {s / f:5.2f}x")
    return {"first_fork_ms": med["first"]["F"] * 1e3, "first_stock_ms": med["first"]["S"] * 1e3,
            "steady_fork_ms": med["steady"]["F"] * 1e3, "steady_stock_ms": med["steady"]["S"] * 1e3}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--d-blocks", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--prefill-ms", type=float, default=300.0)
    args = ap.parse_args(argv)
    quiet_engine_logs("bench-first-logs-")
    first_request_bench(args.rounds, args.d_blocks, args.layers, args.prefill_ms)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""CPU time per pushed request, fork vs stock, in the same engine processes.

`cpu_cost` compares a stock pair of engine processes with fork pairs. Two pairs started
alike can differ by 10-20% for their whole life (its A/A pair), so it resolves about
+-5% after 20 minutes. Here each fork pair also runs vLLM's stock code paths: between
rounds its engines swap the fork's classes and wrappers for vLLM's own
(`harness/stock_swap.py`), so a stock round and a fork round run in the very same
processes, threads and memory, and their ratio has no pair offset in it.

Pairs: the fork with tracing off, and with tracing on (always-on sampler, batch export
over OTLP/gRPC to a local receiver, flushed at the end of every round, stock rounds
included). Each session starts the pairs afresh; each pair then runs `--rounds` round
pairs, stock and fork in alternating order (ABBA), `--requests` requests each, while
the other pairs are frozen (SIGSTOP). Reported per pair: the median of the per-round
ratios fork / stock with [min-max], the same for wall time, and CPU by thread.

    python -m benchmarks.cpu_ab [--sessions 2] [--rounds 8] [--requests 300] [--pairs off,on]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections import defaultdict
from typing import Any

from benchmarks.cpu_cost import _diff, _spread, push_batches
from connector.testing.otlp import OtlpGrpcReceiver
from harness import PushHarness
from harness.config import FORK
from harness.runner import LOG_DIR_ENV

_SDK_DEFAULT_DELAY = {"schedule_delay_ms": 5000}
PAIRS: dict[str, dict[str, Any]] = {
    "off": {},
    "on": {"tracing": {**_SDK_DEFAULT_DELAY}},  # always-on sampler (the SDK's default)
    "on-10%": {"tracing": {**_SDK_DEFAULT_DELAY, "sampler": "parentbased_traceidratio",
                           "sampler_arg": "0.1"}},
}


def _set_mode(h: PushHarness, stock: bool) -> None:
    for e in ("P", "D"):
        name = h[e].call("stock_mode", stock)
        expected = "NixlPushConnectorWorker" if stock else "ObservedPushWorker"
        assert name == expected, f"{e} runs {name}, not {expected}"


def _round(h: PushHarness, traced: bool, requests: int, batch: int) -> tuple[float, float, dict]:
    """CPU seconds per request (both engines), wall seconds per request, CPU by thread."""
    before = [h[e].call("thread_cpu") for e in ("P", "D")]
    t0 = time.perf_counter()
    push_batches(h, requests, batch)
    if traced:
        for e in ("P", "D"):
            h[e].call("spans")  # force_flush: the round's spans leave within the round
    wall = time.perf_counter() - t0
    after = [h[e].call("thread_cpu") for e in ("P", "D")]
    n = (requests // batch) * batch
    threads = {f"{side}:{k}": v / n for side, a, b in zip(("P", "D"), after, before)
               for k, v in _diff(a, b).items()}
    return sum(threads.values()), wall / n, threads


def cpu_ab_bench(sessions: int, rounds: int, requests: int, batch: int,
                 names: list[str]) -> dict[str, Any]:
    rx = OtlpGrpcReceiver()
    ratios: dict[str, list[float]] = {n: [] for n in names}
    wall_ratios: dict[str, list[float]] = {n: [] for n in names}
    cpu: dict[str, dict[str, list[float]]] = {n: {"stock": [], "fork": []} for n in names}
    threads: dict[str, dict[str, dict[str, list[float]]]] = {
        n: {"stock": defaultdict(list), "fork": defaultdict(list)} for n in names}
    session_medians: dict[str, list[float]] = {n: [] for n in names}
    t0 = time.perf_counter()
    try:
        for session in range(sessions):
            pairs: dict[str, PushHarness] = {}
            try:
                for name in names[session % len(names):] + names[:session % len(names)]:
                    kw = dict(PAIRS[name])
                    if "tracing" in kw:
                        kw["tracing"] = {"endpoint": rx.endpoint, "protocol": "grpc", **kw["tracing"]}
                    pairs[name] = PushHarness.pd(
                        workdir=tempfile.mkdtemp(prefix=f"bench-ab-{name}-"), connector=FORK,
                        num_blocks=2 * batch + 8, **kw).start()
                    h = pairs[name]
                    assert h.push(20).ok  # warm-up: handshakes, first connections
                    for stock in (True, False):  # one unmeasured round of each mode
                        _set_mode(h, stock)
                        push_batches(h, requests, batch)
                    h.pause()
                print(f"  session {session + 1}: {len(pairs)} pairs up "
                      f"({time.perf_counter() - t0:.0f} s)", flush=True)
                for r in range(rounds):
                    for name in names[r % len(names):] + names[:r % len(names)]:
                        h = pairs[name]
                        h.resume()
                        got: dict[bool, tuple[float, float, dict]] = {}
                        for stock in ((True, False) if r % 2 == 0 else (False, True)):  # ABBA
                            _set_mode(h, stock)
                            got[stock] = _round(h, "tracing" in PAIRS[name], requests, batch)
                        h.pause()
                        ratios[name].append(got[False][0] / got[True][0])
                        wall_ratios[name].append(got[False][1] / got[True][1])
                        for stock, mode in ((True, "stock"), (False, "fork")):
                            cpu[name][mode].append(got[stock][0])
                            for k, v in got[stock][2].items():
                                threads[name][mode][k].append(v)
                    print(f"  session {session + 1}, round {r + 1}/{rounds}: " + ", ".join(
                        f"{n} x{ratios[n][-1]:.3f}" for n in names), flush=True)
                for name in names:
                    session_medians[name].append(statistics.median(ratios[name][-rounds:]))
            finally:
                for h in pairs.values():
                    h.stop()
    finally:
        rx.close()
    print(f"\n== CPU per pushed request, fork / stock in the same processes (P+D, all threads), "
          f"{sessions} sessions x {rounds} round pairs x {requests} requests")
    print(f"{'pair':>7}  {'stock us':>9}  {'fork us':>9}  {'fork/stock: median [min-max]':>30}  "
          f"{'wall fork/stock':>22}  per session")
    for name in names:
        print(f"{name:>7}  {statistics.median(cpu[name]['stock']) * 1e6:9.1f}  "
              f"{statistics.median(cpu[name]['fork']) * 1e6:9.1f}  {_spread(ratios[name]):>30}  "
              f"{_spread(wall_ratios[name]):>22}  "
              + " ".join(f"{m:.3f}" for m in session_medians[name]))
    print("per thread (median us/request, stock -> fork):")
    for name in names:
        keys = sorted(set(threads[name]["stock"]) | set(threads[name]["fork"]))
        parts = []
        for k in keys:
            s = statistics.median(threads[name]["stock"].get(k) or [0.0]) * 1e6
            f = statistics.median(threads[name]["fork"].get(k) or [0.0]) * 1e6
            if max(s, f) >= 5:
                parts.append(f"{k} {s:.0f}->{f:.0f}")
        print(f"  {name}: " + ", ".join(parts))
    print(f"total {time.perf_counter() - t0:.0f} s")
    return {"ratio": {n: statistics.median(r) for n, r in ratios.items()},
            "ratio_spread": {n: [min(r), max(r)] for n, r in ratios.items()},
            "wall_ratio": {n: statistics.median(r) for n, r in wall_ratios.items()},
            "stock_us": {n: statistics.median(cpu[n]["stock"]) * 1e6 for n in names},
            "fork_us": {n: statistics.median(cpu[n]["fork"]) * 1e6 for n in names}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sessions", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=8, help="round pairs (stock + fork) per session")
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--batch", type=int, default=50)
    ap.add_argument("--pairs", default="off,on", help=f"comma-separated subset of {', '.join(PAIRS)}")
    args = ap.parse_args(argv)
    names = [n for n in args.pairs.split(",") if n]
    unknown = [n for n in names if n not in PAIRS]
    if unknown or not names:
        ap.error(f"pairs come from {', '.join(PAIRS)}; got {unknown or names}")
    os.environ.setdefault(LOG_DIR_ENV, tempfile.mkdtemp(prefix="bench-ab-logs-"))
    print(f"engine logs: {os.environ[LOG_DIR_ENV]}", flush=True)
    cpu_ab_bench(args.sessions, args.rounds, args.requests, args.batch, names)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

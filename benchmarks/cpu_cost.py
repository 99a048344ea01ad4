"""CPU time per pushed request: stock vs fork (tracing off) vs fork (tracing on).

Latency medians on a 2-core machine with several engine processes cannot resolve a
few percent; CPU time can. P/D pairs run at once: stock connector, fork with tracing
off, fork with tracing on (always-on sampler, batch export over OTLP/gRPC to a local
receiver), fork with a parent-based 1-in-10 sampler and with nothing sampled (what the
tracing path costs when spans are dropped), and a second stock pair as an A/A control.
Each round pushes `--requests` requests through each pair in rotating order and reads
the CPU time of both engine processes before and after, per thread, from the
scheduler's nanosecond run-time counters (`/proc/.../schedstat`).

Reported, per variant: median CPU per request over rounds with [min-max], the median
of per-round ratios to that round's stock figure (paired, so slow drift of the machine
cancels), and a "net" figure: the harness's engines step at 1 kHz and NIXL's progress
threads poll while a round runs, CPU that grows with wall time rather than with
requests, so each pair's idle CPU rate (measured before the rounds) times the round's
wall time is subtracted.

Harness engines let NIXL's progress thread sleep between polls (harness/nixl_progress.py)
and freeze their start-up heap for the garbage collector as vLLM's engine core does:
without either, the busy loop and ~300 ms full collections, not the push path, were
measured.

    python -m benchmarks.cpu_cost [--rounds 7] [--requests 400] [--batch 50] [--variants stock,fork-off,...]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections import defaultdict
from typing import Any

from connector.testing.otlp import OtlpGrpcReceiver
from harness import PushHarness
from harness.config import FORK, STOCK
from harness.runner import LOG_DIR_ENV


def _diff(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before.get(k, 0.0) for k in after}


VARIANTS: dict[str, dict[str, Any]] = {
    "stock": dict(connector=STOCK),
    "fork-off": dict(connector=FORK),
    "fork-on": dict(connector=FORK, tracing={}),  # always-on sampler (the SDK default)
    # Parent-based 1-in-10: what "spans cost work only when sampled" buys.
    "fork-on-10%": dict(connector=FORK, tracing={"sampler": "parentbased_traceidratio",
                                                 "sampler_arg": "0.1"}),
    # Tracing set up but nothing sampled: what the machinery costs without spans.
    "fork-on-0%": dict(connector=FORK, tracing={"sampler": "parentbased_always_off"}),
    "stock-AA": dict(connector=STOCK),  # A/A control: a second stock pair
}


def _idle_rate(h: PushHarness, seconds: float = 3.0) -> float:
    """CPU seconds per second both engines use with nothing to do but stay active
    (a ping every 100 ms keeps their loops at the stepping rate of a round)."""
    before = [sum(h[e].call("thread_cpu").values()) for e in ("P", "D")]
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for e in ("P", "D"):
            h[e].call("now")
        time.sleep(0.1)  # the pace of the pings, not a synchronisation
    elapsed = time.perf_counter() - t0
    after = [sum(h[e].call("thread_cpu").values()) for e in ("P", "D")]
    return (sum(after) - sum(before)) / elapsed


def cpu_cost_bench(rounds: int, requests: int, batch: int,
                   names: list[str] | None = None) -> dict[str, Any]:
    rx = OtlpGrpcReceiver()
    names = names or list(VARIANTS)
    pairs: dict[str, PushHarness] = {}
    per_req: dict[str, list[float]] = {v: [] for v in names}
    net: dict[str, list[float]] = {v: [] for v in names}  # minus the time-proportional part
    wall: dict[str, list[float]] = {v: [] for v in names}
    idle_rate: dict[str, float] = {}
    ratios: dict[str, list[float]] = {v: [] for v in names}  # per round, to that round's stock
    threads: dict[str, dict[str, list[float]]] = {v: defaultdict(list) for v in names}
    try:
        for name in names:
            kw = dict(VARIANTS[name])
            if "tracing" in kw:
                kw["tracing"] = {"endpoint": rx.endpoint, "protocol": "grpc", **kw["tracing"]}
            pairs[name] = PushHarness.pd(workdir=tempfile.mkdtemp(prefix=f"bench-cpu-{name}-"),
                                         num_blocks=2 * batch + 8, **kw).start()
            assert pairs[name].push(20).ok  # warm-up: handshakes, first connections
        for name in names:  # the CPU both engines burn per second of an active but empty loop
            idle_rate[name] = _idle_rate(pairs[name])
        for r in range(rounds):
            order = names[r % len(names):] + names[:r % len(names)]
            this_round: dict[str, float] = {}
            for name in order:
                h = pairs[name]
                before = [h[e].call("thread_cpu") for e in ("P", "D")]
                t0 = time.perf_counter()
                for _ in range(requests // batch):
                    h._written.clear()  # reuse the same blocks: the cache is small on purpose
                    h["P"]._next_block = h["D"]._next_block = 0
                    report = h.push(batch, verify=False)
                    assert not report.failed, report
                elapsed = time.perf_counter() - t0
                after = [h[e].call("thread_cpu") for e in ("P", "D")]
                spent = [_diff(a, b) for a, b in zip(after, before)]
                n = (requests // batch) * batch
                this_round[name] = sum(sum(s.values()) for s in spent) / n
                per_req[name].append(this_round[name])
                wall[name].append(elapsed / n)
                net[name].append(this_round[name] - idle_rate[name] * elapsed / n)
                for side, s in zip(("P", "D"), spent):
                    for comm, sec in s.items():
                        threads[name][f"{side}:{comm}"].append(sec / n)
            if "stock" in this_round:
                for name, value in this_round.items():
                    ratios[name].append(value / this_round["stock"])
            print(f"  round {r + 1}/{rounds}: " + ", ".join(
                f"{n} {v * 1e6:.0f} us" for n, v in this_round.items()), flush=True)
    finally:
        for h in pairs.values():
            h.stop()
        rx.close()
    med = {n: statistics.median(v) for n, v in per_req.items()}
    print(f"\n== CPU time per pushed request (P+D engine processes, scheduler run time by thread), "
          f"{rounds} rounds x {requests} requests per variant, rotating order")
    print(f"{'variant':>12}  {'median us [min-max]':>26}  x stock: median of per-round ratios [min-max]")
    for name, values in per_req.items():
        rr = ratios[name]
        ratio = (f"{statistics.median(rr):.3f} [{min(rr):.3f}-{max(rr):.3f}]" if rr else "-")
        print(f"{name:>12}  {med[name] * 1e6:8.1f} [{min(values) * 1e6:7.1f}-{max(values) * 1e6:7.1f}]"
              f"  {ratio}")
    print("time-proportional part (engine loops stepping at 1 kHz, NIXL progress threads polling): "
          "idle CPU of both engines, and wall time per request; net = CPU - idle rate x wall")
    for name in names:
        print(f"{name:>12}  idle {idle_rate[name] * 1e3:6.1f} ms/s  wall "
              f"{statistics.median(wall[name]) * 1e6:7.1f} us/request  net "
              f"{statistics.median(net[name]) * 1e6:7.1f} us/request  x stock "
              f"{statistics.median(net[name]) / statistics.median(net['stock']):.3f}")
    print("per thread (median us/request, threads above 5 us in any variant):")
    keys = sorted({k for t in threads.values() for k in t})
    for key in keys:
        vals = {n: statistics.median(threads[n][key]) * 1e6 if threads[n].get(key) else 0.0
                for n in names}
        if max(vals.values()) >= 5:
            print(f"  {key:<28} " + "  ".join(f"{n} {v:6.1f}" for n, v in vals.items()))
    return {"per_request_us": {n: v * 1e6 for n, v in med.items()},
            "net_per_request_us": {n: statistics.median(v) * 1e6 for n, v in net.items()},
            "idle_cpu_per_s": idle_rate,
            "ratio_to_stock": {n: statistics.median(r) for n, r in ratios.items() if r},
            "ratio_spread": {n: [min(r), max(r)] for n, r in ratios.items() if r}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--batch", type=int, default=50)
    ap.add_argument("--variants", default=",".join(VARIANTS),
                    help=f"comma-separated subset of {', '.join(VARIANTS)} (stock is the baseline)")
    args = ap.parse_args(argv)
    names = [n for n in args.variants.split(",") if n]
    os.environ.setdefault(LOG_DIR_ENV, tempfile.mkdtemp(prefix="bench-cpu-logs-"))
    print(f"engine logs: {os.environ[LOG_DIR_ENV]}", flush=True)
    unknown = [n for n in names if n not in VARIANTS]
    if unknown or "stock" not in names:
        ap.error(f"variants must include stock and come from {', '.join(VARIANTS)}; got {unknown or names}")
    cpu_cost_bench(args.rounds, args.requests, args.batch, names)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

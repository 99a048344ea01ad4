"""CPU time per pushed request: stock vs fork (tracing off) vs fork (tracing on).

Latency medians on a 2-core machine with several engine processes cannot resolve a
few percent; CPU time can. P/D pairs run at once: stock connector, fork with tracing
off, fork with tracing on (always-on sampler, batch export over OTLP/gRPC to a local
receiver, flushed at the end of each round), the same with the SDK's span objects instead
of our lean spans, fork with a parent-based 1-in-10 sampler and with nothing sampled (what the
tracing path costs when spans are dropped), and a second stock pair as an A/A control.
Each round pushes `--requests` requests through each pair in rotating order and reads
the CPU time of both engine processes before and after, per thread, from the
scheduler's nanosecond run-time counters (`/proc/.../schedstat`). While one pair is
measured, every other pair's processes are frozen (SIGSTOP), so their loops and NIXL
progress threads do not compete with it for the two cores.

One pair's processes can sit several percent above or below an identical pair's for
their whole life (an A/A ratio of 0.80 in one run, 0.93 in another), so the whole set
of pairs is started afresh for each of `--sessions`, in an order that rotates, and the
rounds of all sessions are pooled.

Reported, per variant: median CPU per request over rounds with [min-max], the median
of per-round ratios to that round's stock figure (paired, so slow drift of the machine
cancels; with the A/A pair, the mean of both stock pairs), each session's median, and
a "net" figure: the harness's engines step at 1 kHz and NIXL's progress
threads poll while a round runs, CPU that grows with wall time rather than with
requests, so each pair's idle CPU rate (measured before the rounds) times the round's
wall time is subtracted.

Harness engines let NIXL's progress thread sleep between polls (the fork's
`nixl_progress_delay_us` seam, around stock and fork alike) and freeze their start-up
heap for the garbage collector as vLLM's engine core does:
without either, the busy loop and ~300 ms full collections, not the push path, were
measured.

    python -m benchmarks.cpu_cost [--sessions 3] [--rounds 5] [--requests 400] [--batch 50]
        [--variants stock,fork-off,...]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections import defaultdict
from typing import Any

from harness import PushHarness
from harness.config import FORK, STOCK
from harness.otlp_receiver import OtlpGrpcReceiver
from harness.runner import quiet_engine_logs


def _diff(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before.get(k, 0.0) for k in after}


# Tracing variants export with the SDK's default schedule (5 s; the harness's tests use
# 200 ms) and are flushed at the end of each round, so each round's spans are exported,
# in batches of up to 512, within the round that made them.
_SDK_DEFAULT_DELAY = {"schedule_delay_ms": 5000}
VARIANTS: dict[str, dict[str, Any]] = {
    "stock": dict(connector=STOCK),
    "fork-off": dict(connector=FORK),
    "fork-on": dict(connector=FORK, tracing={**_SDK_DEFAULT_DELAY}),  # always-on sampler (SDK default)
    # The same with the SDK's own span objects (lean spans off): what lean_span.py saves.
    "fork-on-sdk": dict(connector=FORK, tracing={**_SDK_DEFAULT_DELAY, "lean_spans": "0"}),
    # Parent-based 1-in-10: what "spans cost work only when sampled" buys.
    "fork-on-10%": dict(connector=FORK, tracing={**_SDK_DEFAULT_DELAY, "sampler": "parentbased_traceidratio",
                                                 "sampler_arg": "0.1"}),
    # Tracing set up but nothing sampled: what the machinery costs without spans.
    "fork-on-0%": dict(connector=FORK, tracing={**_SDK_DEFAULT_DELAY, "sampler": "parentbased_always_off"}),
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


def _session(rx: OtlpGrpcReceiver, session: int, rounds: int, requests: int, batch: int,
             names: list[str], out: dict[str, Any]) -> None:
    """Fresh engine processes for every variant, started in an order that rotates with
    the session, then `rounds` rounds of `requests` per pair in rotating order."""
    pairs: dict[str, PushHarness] = {}
    start_order = names[session % len(names):] + names[:session % len(names)]
    try:
        for name in start_order:
            kw = dict(VARIANTS[name])
            if "tracing" in kw:
                kw["tracing"] = {"endpoint": rx.endpoint, "protocol": "grpc", **kw["tracing"]}
            pairs[name] = PushHarness.pd(workdir=tempfile.mkdtemp(prefix=f"bench-cpu-{name}-"),
                                         num_blocks=2 * batch + 8, **kw).start()
            assert pairs[name].push(20).ok  # warm-up: handshakes, first connections
        for name in names:  # an unmeasured round: the first one after start-up ran 10-25% high
            push_batches(pairs[name], requests, batch)
        # From here on only the pair being measured runs: the others are frozen, so their
        # loops and NIXL progress threads do not share the two cores with it.
        for h in pairs.values():
            h.pause()
        idle_rate = {name: _measured_alone(pairs[name], _idle_rate) for name in names}
        for name in names:
            out["idle_rate"][name].append(idle_rate[name])
        for r in range(rounds):
            order = names[r % len(names):] + names[:r % len(names)]
            this_round: dict[str, float] = {}
            this_net: dict[str, float] = {}
            for name in order:
                h = pairs[name]
                h.resume()
                before = [h[e].call("thread_cpu") for e in ("P", "D")]
                t0 = time.perf_counter()
                push_batches(h, requests, batch)
                if "tracing" in VARIANTS[name]:
                    for e in ("P", "D"):
                        h[e].call("spans")  # force_flush: this round's spans leave in this round
                elapsed = time.perf_counter() - t0
                after = [h[e].call("thread_cpu") for e in ("P", "D")]
                h.pause()
                spent = [_diff(a, b) for a, b in zip(after, before)]
                n = (requests // batch) * batch
                this_round[name] = sum(sum(s.values()) for s in spent) / n
                this_net[name] = this_round[name] - idle_rate[name] * elapsed / n
                out["per_req"][name].append(this_round[name])
                out["wall"][name].append(elapsed / n)
                out["net"][name].append(this_net[name])
                for side, s in zip(("P", "D"), spent):
                    for comm, sec in s.items():
                        out["threads"][name][f"{side}:{comm}"].append(sec / n)
            base, base_net = _baseline(this_round), _baseline(this_net)
            for name in names:
                out["ratios"][name].append(this_round[name] / base)
                out["net_ratios"][name].append(this_net[name] / base_net)
                out["session_ratios"][name][session].append(this_round[name] / base)
            print(f"  session {session + 1}, round {r + 1}/{rounds}: " + ", ".join(
                f"{n} {v * 1e6:.0f} us" for n, v in this_round.items()), flush=True)
    finally:
        for h in pairs.values():
            h.stop()


def _measured_alone(h: PushHarness, measure: Any) -> Any:
    h.resume()
    try:
        return measure(h)
    finally:
        h.pause()


def push_batches(h: PushHarness, requests: int, batch: int, bulk: bool = False) -> None:
    """`requests` unverified pushes in batches, into the same blocks (the cache is small on purpose)."""
    for _ in range(requests // batch):
        h.reuse_blocks("P", "D")
        report = h.push(batch, verify=False, bulk=bulk)
        assert not report.failed, report


def _baseline(values: dict[str, float]) -> float:
    """This round's stock figure: the mean of both stock pairs when the A/A pair runs."""
    stocks = [values[n] for n in ("stock", "stock-AA") if n in values]
    return sum(stocks) / len(stocks)


def _spread(values: list[float]) -> str:
    return f"{statistics.median(values):.3f} [{min(values):.3f}-{max(values):.3f}]"


def cpu_cost_bench(rounds: int, requests: int, batch: int, names: list[str] | None = None,
                   sessions: int = 3) -> dict[str, Any]:
    """Per variant: CPU per request and its ratio to stock, over `sessions` sets of fresh
    engine processes (one pair's processes can sit several percent above or below an
    identical pair's for their whole life, so pairs are restarted and pooled)."""
    rx = OtlpGrpcReceiver()
    names = names or list(VARIANTS)
    out: dict[str, Any] = {
        key: {v: [] for v in names} for key in ("per_req", "net", "wall", "ratios", "net_ratios",
                                                 "idle_rate")}
    out["threads"] = {v: defaultdict(list) for v in names}
    out["session_ratios"] = {v: [[] for _ in range(sessions)] for v in names}
    t0 = time.perf_counter()
    try:
        for session in range(sessions):
            _session(rx, session, rounds, requests, batch, names, out)
            print(f"  session {session + 1}/{sessions} done ({time.perf_counter() - t0:.0f} s)",
                  flush=True)
    finally:
        rx.close()
    per_req, ratios = out["per_req"], out["ratios"]
    both = "stock-AA" in names
    print(f"\n== CPU time per pushed request (P+D engine processes, scheduler run time by thread), "
          f"{sessions} sessions x {rounds} rounds x {requests} requests per variant, rotating order")
    print("   x stock: per-round ratio to that round's stock figure"
          + (" (mean of the two stock pairs)" if both else "") + ", median [min-max] over all rounds;"
          " then each session's median")
    print(f"{'variant':>12}  {'median us [min-max]':>26}  {'x stock':>22}  {'net x stock':>22}  per session")
    for name in names:
        values = per_req[name]
        sessions_txt = " ".join(f"{statistics.median(s):.3f}" for s in out["session_ratios"][name] if s)
        print(f"{name:>12}  {statistics.median(values) * 1e6:8.1f} [{min(values) * 1e6:7.1f}-"
              f"{max(values) * 1e6:7.1f}]  {_spread(ratios[name]):>22}  "
              f"{_spread(out['net_ratios'][name]):>22}  {sessions_txt}")
    if both:
        aa = [a / s for a, s in zip(per_req["stock-AA"], per_req["stock"])]
        print(f"A/A (stock-AA / stock, per round): {_spread(aa)}")
    print("time-proportional part (engine loops stepping at 1 kHz, NIXL progress threads polling): "
          "idle CPU of both engines, and wall time per request; net = CPU - idle rate x wall")
    for name in names:
        print(f"{name:>12}  idle {statistics.median(out['idle_rate'][name]) * 1e3:6.1f} ms/s  wall "
              f"{statistics.median(out['wall'][name]) * 1e6:7.1f} us/request  net "
              f"{statistics.median(out['net'][name]) * 1e6:7.1f} us/request")
    print("per thread (median us/request, threads above 5 us in any variant):")
    threads = out["threads"]
    keys = sorted({k for t in threads.values() for k in t})
    for key in keys:
        vals = {n: statistics.median(threads[n][key]) * 1e6 if threads[n].get(key) else 0.0
                for n in names}
        if max(vals.values()) >= 5:
            print(f"  {key:<28} " + "  ".join(f"{n} {v:6.1f}" for n, v in vals.items()))
    print(f"total {time.perf_counter() - t0:.0f} s")
    return {"per_request_us": {n: statistics.median(v) * 1e6 for n, v in per_req.items()},
            "net_per_request_us": {n: statistics.median(v) * 1e6 for n, v in out["net"].items()},
            "ratio_to_stock": {n: statistics.median(r) for n, r in ratios.items()},
            "net_ratio_to_stock": {n: statistics.median(r) for n, r in out["net_ratios"].items()},
            "ratio_spread": {n: [min(r), max(r)] for n, r in ratios.items()}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sessions", type=int, default=3,
                    help="sets of fresh engine processes (pair-to-pair offsets average out)")
    ap.add_argument("--rounds", type=int, default=5, help="rounds per session")
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--batch", type=int, default=50)
    ap.add_argument("--variants", default=",".join(VARIANTS),
                    help=f"comma-separated subset of {', '.join(VARIANTS)} (stock is the baseline)")
    args = ap.parse_args(argv)
    names = [n for n in args.variants.split(",") if n]
    quiet_engine_logs("bench-cpu-logs-")
    unknown = [n for n in names if n not in VARIANTS]
    if unknown or "stock" not in names:
        ap.error(f"variants must include stock and come from {', '.join(VARIANTS)}; got {unknown or names}")
    cpu_cost_bench(args.rounds, args.requests, args.batch, names, args.sessions)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

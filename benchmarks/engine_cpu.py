"""What the fork costs the engines per request against stock vLLM, thread by thread, on real `vllm serve`.

Per round, a fresh P/D pair per variant, one after the other in alternating order,
tracing off: the fork as users run it (`fork`: the KV check on every request, the
default), the fork with the KV check off (`fork-nocheck`: what the rest of the fork
costs), and stock vLLM's push connector (`stock`, built under the same two host
settings: `benchmarks/stock_connector.py`). P and D are each pinned to their own core,
behind the project's router. After `--warmup` requests, every pair of a round serves
the same `--requests` requests (the same prompts, 64-480 tokens, `--max-tokens`
tokens, at `--concurrency`), and the CPU of every thread of both engines is read from
/proc before and after (the scheduler's run time, read from outside: the read costs
the engines nothing). Each thread is then named: by its Python thread name where it
has one (`py-spy dump`, once, after the requests), else as a native thread (NIXL's and
UCX's, torch's), and grouped by engine, process (API server, EngineCore, worker) and
role (main, push writer, handshakes, side channel, idle poll, ...).

Reported, per variant against stock and per group: CPU per request, the median over
rounds of each and of the per-round differences, and the wall time of the same
requests. The pairs of one round run back to back, so a per-round difference is the
figure to read; each round's is printed. Figures, not checks.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import re
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

from benchmarks.common import BenchRun, cpu_delta, thread_cpu
from benchmarks.overhead import Pair, py_spy
from demo import drive
from demo.model import random_checkpoint
from demo.stack import MODEL_CACHE
from harness.otlp_receiver import OtlpGrpcReceiver

PROMPT_LENGTHS = (64, 160, 256, 352, 480, 96, 224, 128)  # tokens (max_model_len 512 with 12 out)

# What runs: name -> (connector, its kv-transfer-config overrides). Stock is the baseline.
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "fork": ("fork", {}),
    "fork-nocheck": ("fork", {"kv_connector_extra_config": {"kv_verify_ratio": 0}}),  # KV check off
    "stock": ("stock", {}),
}

# Python thread name (digits folded) -> role; the first pattern that matches wins.
ROLES: tuple[tuple[str, str], ...] = (
    (r"^MainThread$", "main"),
    (r"^nixl-push-writer$", "push writer"),
    (r"^nixl-idle-poll$", "idle poll (fork)"),
    (r"handshake", "handshakes"),
    (r"_nixl_handshake_listener", "side channel"),
)


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--rounds", type=int, default=4, help="rounds of one fork and one stock pair")
    ap.add_argument("--requests", type=int, default=120, help="measured requests per pair")
    ap.add_argument("--warmup", type=int, default=8, help="requests before the measured ones")
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=12)
    ap.add_argument("--variants", default=",".join(VARIANTS),
                    help=f"comma-separated, of {', '.join(VARIANTS)} (stock is the baseline)")


def _python_threads(spy: str, pid: int) -> dict[int, str]:
    """Native thread id -> Python thread name, from one `py-spy dump` (empty if it cannot read)."""
    try:
        out = subprocess.run([spy, "dump", "--json", "--nonblocking", "-p", str(pid)], capture_output=True,
                             text=True, timeout=60, check=True).stdout
        return {int(t["os_thread_id"]): str(t["thread_name"]) for t in json.loads(out)
                if t.get("os_thread_id") is not None}
    except (subprocess.SubprocessError, ValueError, KeyError, TypeError):
        return {}


def role(python_name: str | None) -> str:
    """A thread's role from its Python name (None: a native thread with no Python frame)."""
    if python_name is None:
        return "native (NIXL/UCX, torch)"
    for pattern, name in ROLES:
        if re.search(pattern, python_name):
            return name
    return "other Python: " + re.sub(r"\d+", "N", python_name)


def _process_kind(pid: int, server_pid: int) -> str:
    if pid == server_pid:
        return "API server"
    with contextlib.suppress(OSError):
        comm = Path(f"/proc/{pid}/comm").read_text().strip()
        if "EngineCor" in comm:
            return "EngineCore"
        return "worker" if "Worker" in comm else comm
    return "gone"


def _prompts(seed: int, n: int) -> list[list[int]]:
    lengths = [PROMPT_LENGTHS[i % len(PROMPT_LENGTHS)] for i in range(n)]
    return [drive.make_prompts(1, seed=seed * 100_003 + i, lengths=(length,))[0]
            for i, length in enumerate(lengths)]


def _send_all(url: str, prompts: list[list[int]], tag: str,
              args: argparse.Namespace) -> tuple[int, list[float]]:
    """Every prompt once through the router at `--concurrency`, untraced (the router
    samples): (failed, latencies of those answered)."""
    results = drive.concurrently(url, prompts, prefix=tag, max_tokens=args.max_tokens,
                                 concurrency=args.concurrency, traced=False)
    latencies = [took for out, took in results if not out.error]
    return len(results) - len(latencies), latencies


def measure(pair: Pair, spy: str, args: argparse.Namespace, rnd: int, tag: str) -> dict[str, Any]:
    """The measured requests on a started pair: CPU per request by group, wall time, latencies."""
    assert pair.router is not None
    url = pair.router.url
    failed_warm, _ = _send_all(url, _prompts(10_000 + rnd, args.warmup), f"{tag}-warm", args)
    kinds: dict[int, tuple[str, str]] = {}
    for pid, label in pair.processes().items():  # (label "P:<comm>" or "D:<comm>")
        engine = label[0]
        kinds[pid] = (engine, _process_kind(pid, pair.servers[engine == "D"].pid))
    cpu0, t0 = thread_cpu(kinds), time.monotonic()
    failed, latencies = _send_all(url, _prompts(rnd, args.requests), tag, args)
    wall = time.monotonic() - t0
    cpu = cpu_delta(cpu0, thread_cpu(kinds))
    names: dict[int, str] = {}
    unnamed = []  # processes py-spy could not read: their threads other than the main one count as native
    for pid in kinds:
        found = _python_threads(spy, pid)
        names.update(found or {pid: "MainThread"})  # (a process's main thread has its pid as thread id)
        if not found:
            unnamed.append(f"{kinds[pid][0]} {kinds[pid][1]}")
    n = max(args.requests - failed, 1)
    groups: collections.Counter[str] = collections.Counter()
    for (pid, tid), seconds in cpu.items():
        engine, kind = kinds[pid]
        groups[f"{engine} {kind}: {role(names.get(tid))}"] += seconds
        groups[f"{engine} total"] += seconds
    return {"requests": args.requests, "failed": failed + failed_warm, "wall_s": wall, "unnamed": unnamed,
            "latency_p50_ms": statistics.median(latencies) * 1e3 if latencies else None,
            "ms_per_request": {g: s / n * 1e3 for g, s in sorted(groups.items())}}


def run(args: argparse.Namespace, bench: BenchRun) -> dict[str, Any]:
    variants = [v for v in args.variants.split(",") if v]
    unknown = set(variants) - set(VARIANTS)
    if unknown or "stock" not in variants or len(variants) < 2:
        raise SystemExit(f"--variants: stock and at least one of {', '.join(VARIANTS)}")
    spy = py_spy()
    model = random_checkpoint(MODEL_CACHE)
    runs: list[dict[str, Any]] = []
    rx = OtlpGrpcReceiver()  # (Pair wants an endpoint; mode "off" gives the engines none)
    try:
        for rnd in range(args.rounds):
            for variant in variants if rnd % 2 == 0 else variants[::-1]:
                where = bench.dir / f"round{rnd}-{variant}"
                t = time.monotonic()
                connector, overrides = VARIANTS[variant]
                pair = Pair(where, connector, "off", model, rx.endpoint, kv_overrides=overrides)
                try:
                    pair.start()
                    bench.say(f"round {rnd + 1} {variant}: P and D vllm serve and router up in "
                              f"{time.monotonic() - t:.0f} s (logs in {where})")
                    row = {"round": rnd, "variant": variant, **measure(pair, spy, args, rnd, f"r{rnd}")}
                finally:
                    pair.stop()
                runs.append(row)
                per = row["ms_per_request"]
                bench.say(f"round {rnd + 1} {variant}: {args.requests} requests in {row['wall_s']:.1f} s, "
                          f"P {per.get('P total', 0):.1f} ms and D {per.get('D total', 0):.1f} ms "
                          "CPU per request" + (f", {row['failed']} failed" if row["failed"] else "")
                          + (f"; py-spy named no thread of {', '.join(row['unnamed'])} (counted native)"
                             if row["unnamed"] else ""))
    finally:
        rx.close()
    tables = {v: summarize(runs, v) for v in variants if v != "stock"}
    for variant, table in tables.items():
        _print(variant, table, runs, args, bench)
    # What the KV check alone costs: the fork as it ships against the fork with it off.
    check = summarize(runs, "fork", "fork-nocheck") if {"fork", "fork-nocheck"} <= set(variants) else []
    if check:
        _print("fork", check, runs, args, bench, "fork-nocheck")
    return {"requests": args.requests, "rounds": args.rounds, "concurrency": args.concurrency,
            "max_tokens": args.max_tokens, "variants": {v: VARIANTS[v] for v in variants}, "runs": runs,
            "against_stock": tables, "kv_check": check}


def summarize(runs: list[dict[str, Any]], variant: str, baseline: str = "stock") -> list[dict[str, Any]]:
    """Per group: medians of `variant` and `baseline` over rounds and of the per-round
    difference (the keys say `stock` for the baseline, whichever it is)."""
    groups = sorted({g for r in runs for g in r["ms_per_request"]},
                    key=lambda g: (g.split()[0], "total" not in g, g))
    by_round: dict[int, dict[str, dict[str, Any]]] = collections.defaultdict(dict)
    for r in runs:
        by_round[r["round"]][r["variant"]] = r
    pairs = [(v[variant], v[baseline]) for v in by_round.values() if variant in v and baseline in v]
    out = []
    for g in [*groups, "wall"]:
        def value(row: dict[str, Any], group: str = g) -> float:
            if group == "wall":
                return row["wall_s"] * 1e3 / row["requests"]
            return row["ms_per_request"].get(group, 0.0)
        ours = [value(a) for a, _ in pairs]
        stock = [value(b) for _, b in pairs]
        diffs = [f - s for f, s in zip(ours, stock)]
        out.append({"group": "wall time per request" if g == "wall" else g,
                    "ms": statistics.median(ours) if ours else 0.0,
                    "stock_ms": statistics.median(stock) if stock else 0.0,
                    "diff_ms": statistics.median(diffs) if diffs else 0.0,
                    "diff_pct": [100 * d / s if s else 0.0 for d, s in zip(diffs, stock)],
                    "diff_min_ms": min(diffs, default=0.0), "diff_max_ms": max(diffs, default=0.0),
                    "rounds_higher": sum(d > 0 for d in diffs), "rounds": len(diffs)})
    return out


def _print(variant: str, table: list[dict[str, Any]], runs: list[dict[str, Any]], args: argparse.Namespace,
           bench: BenchRun, baseline: str = "stock") -> None:
    print(f"\nEngine CPU per request, {variant} against {baseline}, {bench.date[:10]}, "
          f"commit {bench.commit}: {args.rounds} rounds x {args.requests} requests "
          f"({args.concurrency} clients, {args.max_tokens} tokens), tracing off; medians over rounds, "
          "ms per request; per-round difference in %")
    print(f"{'group':<50} {variant:>12} {baseline:>12} {'difference':>10} {'(min..max)':>16} {'higher':>6}"
          "  per round")
    for row in table:
        whole = "total" in row["group"] or "wall" in row["group"]
        if max(row["ms"], row["stock_ms"]) < 0.05 and not whole:
            continue
        rounds = " ".join(f"{p:+.1f}%" for p in row["diff_pct"]) if whole else ""
        print(f"{row['group']:<50} {row['ms']:>12.2f} {row['stock_ms']:>12.2f} {row['diff_ms']:>+10.2f} "
              f"({row['diff_min_ms']:+.2f}..{row['diff_max_ms']:+.2f}) {row['rounds_higher']:>3}/"
              f"{row['rounds']}  {rounds}")
    failed = sum(r["failed"] for r in runs)
    if failed:
        print(f"  {failed} requests failed over all pairs (their CPU is counted, the request is not)")

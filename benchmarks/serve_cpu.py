"""CPU time per request on real `vllm serve`: stock vs fork (tracing off) vs fork (tracing on).

`benchmarks.cpu_cost` measures the connector alone: harness engines without a model,
where a pushed request costs ~1.8 ms of CPU and every microsecond of ours shows. This
one measures what a user's engines pay: P/D pairs of real `vllm serve` (API server,
engine core, worker; the tiny random-weight Llama, `--enforce-eager`), each behind its
own router, all up at once:

- `stock`: vLLM's own connector (`benchmarks.stock_connector`: built under the same
  NIXL poll delay and CPU containment as the fork, nothing else of ours);
- `stock-AA`: a second stock pair, the A/A control;
- `fork-off`: the fork, tracing off;
- `fork-on`: the fork with our spans exported over OTLP/gRPC to a local receiver
  (always-on sampler, SDK-default batch schedule). The endpoint is given through
  `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`, not `--otlp-traces-endpoint`, so vLLM's own
  request spans stay off and only ours are measured.

Each round sends `--requests` requests (fresh random prompts of 33-130 tokens, `--concurrency`
at a time) through each pair in rotating order and reads the CPU time (user+system,
every process of both engines) before and after. Ratios are per round against the mean
of the two stock pairs, reported as the median over rounds with [min-max]; pairs are
started afresh for each of `--sessions`.

    python -m benchmarks.serve_cpu [--sessions 2] [--rounds 4] [--requests 250]
        [--concurrency 4] [--max-tokens 4]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from demo import drive
from demo.engines import PROGRESS_DELAY_US, RouterProcess, VllmServer, session_pids
from demo.model import random_checkpoint
from demo.stack import MODEL_CACHE
from harness.otlp_receiver import OtlpGrpcReceiver

STOCK_MODULE = {"kv_connector_module_path": "benchmarks.stock_connector",
                "kv_connector_extra_config": {"nixl_progress_delay_us": PROGRESS_DELAY_US}}
VARIANTS = ("stock", "stock-AA", "fork-off", "fork-on")
_HZ = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pids: list[int]) -> float:
    """User+system CPU seconds of these processes so far (all their threads)."""
    total = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])  # utime + stime of the process (all threads)
    return total / _HZ


class Pair:
    """One P and one D `vllm serve` and their router."""

    def __init__(self, variant: str, workdir: Path, model: Path, otlp: str):
        connector = "stock" if variant.startswith("stock") else "fork"
        kw: dict[str, Any] = {"connector": connector, "model": model}
        if connector == "stock":
            kw["kv_overrides"] = STOCK_MODULE
        if variant == "fork-on":
            kw["extra_env"] = {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": otlp}
        workdir.mkdir(parents=True, exist_ok=True)
        self.variant = variant
        self.prefill = VllmServer(workdir, name="prefill", kv_role="kv_producer",
                                  engine_id=f"{variant}-prefill", cpu=0, **kw)
        self.decode = VllmServer(workdir, name="decode", kv_role="kv_consumer",
                                 engine_id=f"{variant}-decode", cpu=1, **kw)
        self.router: RouterProcess | None = None
        self.workdir = workdir

    def wait_ready(self) -> None:
        self.prefill.wait_healthy()
        self.decode.wait_healthy()
        self.router = RouterProcess(self.workdir, [self.prefill], [self.decode])
        self.router.wait_ready()

    def pids(self) -> list[int]:
        return session_pids(self.prefill.pid) + session_pids(self.decode.pid)

    def stop(self) -> None:
        for proc in (self.router, self.decode, self.prefill):
            if proc is not None:
                proc.stop()


def _send(pair: Pair, n: int, concurrency: int, max_tokens: int, seed: int) -> int:
    """`n` requests through the pair's router; returns how many failed."""
    prompts = drive.make_prompts(n, seed=seed, lengths=(40, 72, 100, 33, 130, 64))
    assert pair.router is not None
    url = pair.router.url

    def one(i: int) -> bool:
        out = drive.disaggregated(url, prompts[i], f"{pair.variant}-{seed}-{i}", max_tokens, timeout_s=120)
        return bool(out.error) or not out.tokens  # (a random model may stop early: still served)

    with ThreadPoolExecutor(concurrency) as pool:
        return sum(pool.map(one, range(n)))


def _session(index: int, args: argparse.Namespace, model: Path, otlp: str,
             rows: dict[str, list[float]], ratios: dict[str, list[float]],
             cores: dict[str, list[float]], log: Any) -> None:
    order = VARIANTS[index % len(VARIANTS):] + VARIANTS[:index % len(VARIANTS)]
    root = Path(tempfile.mkdtemp(prefix=f"serve-cpu-{index}-", dir=args.workdir))
    t0 = time.monotonic()
    pairs = [Pair(v, root / v, model, otlp) for v in order]
    try:
        threads = [threading.Thread(target=p.wait_ready) for p in pairs]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        log(f"session {index + 1}: {len(pairs)} pairs up in {time.monotonic() - t0:.0f} s "
            f"(logs under {root})")
        for p in pairs:  # warm-up: handshakes, first-request paths, caches
            _send(p, 20, args.concurrency, args.max_tokens, seed=-1)
        for r in range(args.rounds):
            per_request: dict[str, float] = {}
            rotated = pairs[r % len(pairs):] + pairs[:r % len(pairs)]
            for p in rotated:
                pids = p.pids()
                before, w0 = cpu_seconds(pids), time.monotonic()
                failed = _send(p, args.requests, args.concurrency, args.max_tokens,
                               seed=1000 * index + 10 * r + VARIANTS.index(p.variant))
                cpu = cpu_seconds(pids) - before
                per_request[p.variant] = cpu / args.requests
                if failed:
                    log(f"  {p.variant}: {failed} of {args.requests} requests failed")
                wall = time.monotonic() - w0
                cores[p.variant].append(cpu / wall)
                log(f"  round {r + 1} {p.variant:9s} {cpu / args.requests * 1e3:7.2f} ms CPU/request "
                    f"({wall:.1f} s, {cpu / wall:.2f} cores busy)")
            base = (per_request["stock"] + per_request["stock-AA"]) / 2
            for v, value in per_request.items():
                rows[v].append(value)
                ratios[v].append(value / base)
    finally:
        for p in pairs:
            p.stop()


def serve_cpu_bench(args: argparse.Namespace, log: Any = print) -> dict[str, dict[str, float]]:
    model = random_checkpoint(MODEL_CACHE)
    rows: dict[str, list[float]] = {v: [] for v in VARIANTS}
    ratios: dict[str, list[float]] = {v: [] for v in VARIANTS}
    cores: dict[str, list[float]] = {v: [] for v in VARIANTS}
    rx = OtlpGrpcReceiver()
    try:
        for s in range(args.sessions):
            _session(s, args, model, rx.endpoint, rows, ratios, cores, log)
        spans = len(rx.snapshot())
    finally:
        rx.close()
    out = {}
    log(f"\nCPU per request on real vllm serve ({args.sessions} sessions x {args.rounds} rounds x "
        f"{args.requests} requests per pair, {args.concurrency} at a time, {args.max_tokens} tokens); "
        f"{spans} spans received from fork-on")
    log(f"{'variant':10s} {'CPU/request':>12s}  x stock (per-round median [min-max])  cores busy in a round")
    for v in VARIANTS:
        med = statistics.median(ratios[v])
        out[v] = {"cpu_ms": statistics.median(rows[v]) * 1e3, "ratio": med,
                  "min": min(ratios[v]), "max": max(ratios[v])}
        out[v]["cores"] = statistics.median(cores[v])
        log(f"{v:10s} {out[v]['cpu_ms']:9.2f} ms  {med:.3f} [{min(ratios[v]):.3f}-{max(ratios[v]):.3f}]"
            f"  {out[v]['cores']:.2f}")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sessions", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--requests", type=int, default=250)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--workdir", type=Path, default=Path(".cache/bench/serve-cpu"))
    args = ap.parse_args(argv)
    args.workdir.mkdir(parents=True, exist_ok=True)
    print(f"engine logs under {args.workdir.resolve()}")
    t0 = time.monotonic()
    serve_cpu_bench(args)
    print(f"done in {time.monotonic() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

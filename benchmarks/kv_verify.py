"""What the KV check costs: the digest's time per MiB of KV; engine CPU and TTFT on real `vllm serve`.

Part 1, `digest` (in this process, torch on the CPU): the time of one digest of a
request's KV, as P computes it before a WRITE and D after the KV landed (the same
function), median of `--repeats`, for two shapes: the demo's tiny Llama (2 layers, 2
KV heads of 32 channels, fp32) at its prompt sizes, and a Llama-3.1-8B shape (32
layers, 8 KV heads of 128 channels, bf16, TP1) at an 8k-token prompt. Blocks of 16
tokens, K and V packed in a block's content, as vLLM lays a layer out.

Part 2, `serve` (paired on real `vllm serve`): a fresh P/D pair of the fork per
`kv_verify_ratio` (P and D each pinned to its own core, the project's router, the
demo's model), a steady stream of `--concurrency` clients with fresh prompts; over a
window of `--seconds`, the CPU of every thread of both engines from /proc and each
request's latency (non-streamed, `--max-tokens` tokens: TTFT plus a few decode
steps). The pairs run one after the other in alternating order over `--rounds`
rounds; medians over rounds. Figures, not checks.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import BenchRun, cpu_delta, thread_cpu
from benchmarks.overhead import PROMPT_LENGTHS, Stream
from connector.integrity.digest import digest
from demo.engines import RouterProcess, VllmServer, session_pids
from demo.model import random_checkpoint
from demo.stack import MODEL_CACHE
from harness.poll import wait_until

BLOCK = 16
# (name, layers, kv heads, channels per head (K and V: twice this), dtype, prompt tokens)
SHAPES = (
    ("demo tiny Llama, 64 tokens", 2, 2, 32, torch.float32, 64),
    ("demo tiny Llama, 130 tokens", 2, 2, 32, torch.float32, 130),
    ("Llama-3.1-8B shape, 8k tokens", 32, 8, 128, torch.bfloat16, 8192),
)


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--parts", default="digest,serve", help="comma-separated: digest, serve")
    ap.add_argument("--repeats", type=int, default=5, help="digests per shape (median)")
    ap.add_argument("--ratios", default="0,0.01,0.1,1", help="kv_verify_ratio of each pair")
    ap.add_argument("--rounds", type=int, default=2, help="rounds over the ratios (alternating order)")
    ap.add_argument("--seconds", type=int, default=30, help="measurement window per pair")
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=20, help="requests before the window")


# ------------------------------------------------------------------- part 1
def digest_times(repeats: int, bench: BenchRun) -> list[dict[str, Any]]:
    rows = []
    for name, layers, heads, channels, dtype, tokens in SHAPES:
        blocks = -(-tokens // BLOCK)
        gen = torch.Generator().manual_seed(1)
        caches = [(layer, torch.randn((blocks + 8, heads, BLOCK, 2 * channels), generator=gen).to(dtype))
                  for layer in range(layers)]
        ids = list(range(4, 4 + blocks))
        mib = blocks * heads * BLOCK * 2 * channels * caches[0][1].element_size() * layers / 2**20
        digest(caches, ids, head0=0)  # (weights built and cached, as after a first request)
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            digest(caches, ids, head0=0)
            times.append(time.perf_counter() - t)
        median = statistics.median(times)
        rows.append({"shape": name, "layers": layers, "kv_heads": heads, "channels": channels,
                     "dtype": str(dtype).removeprefix("torch."), "tokens": tokens, "kv_mib": round(mib, 3),
                     "digest_ms": median * 1e3, "ms_per_mib": median * 1e3 / mib})
        bench.say(f"digest, {name}: {mib:.2f} MiB of KV in {median * 1e3:.2f} ms "
                  f"({median * 1e3 / mib:.2f} ms per MiB; median of {repeats})")
    return rows


# ------------------------------------------------------------------- part 2
class TimedStream(Stream):
    """The overhead benchmark's client stream, with each request's latency kept."""

    def __init__(self, *args: Any, **kwargs: Any):
        self.latencies: list[float] = []
        super().__init__(*args, **kwargs)

    def send(self, prompt: list[int], request_id: str) -> bool:
        t = time.perf_counter()
        ok = super().send(prompt, request_id)
        if ok:
            self.latencies.append(time.perf_counter() - t)
        return ok


def serve_pair(workdir: Path, ratio: float, model: Path, args: argparse.Namespace,
               bench: BenchRun) -> dict[str, Any]:
    extra = {"kv_connector_extra_config": {"kv_verify_ratio": ratio}}
    servers: list[VllmServer] = []
    router = None
    t = time.monotonic()
    try:
        for name, role, cpu in (("prefill", "kv_producer", 0), ("decode", "kv_consumer", 1)):
            servers.append(VllmServer(workdir, name=name, kv_role=role, engine_id=f"verify{ratio}-{name}",
                                      cpu=cpu, model=model, connector="fork", kv_overrides=extra))
        for server in servers:
            server.wait_healthy()
        router = RouterProcess(workdir, servers[:1], servers[1:], None)
        router.wait_ready()
        bench.say(f"ratio {ratio}: P and D vllm serve and router up in {time.monotonic() - t:.0f} s "
                  f"(logs in {workdir})")
        pids = [pid for server in servers for pid in session_pids(server.pid)]
        stream = TimedStream(router.url, args.concurrency, args.max_tokens, f"verify{ratio}")
        try:
            warm = args.warmup + args.concurrency
            wait_until(lambda: stream.done >= warm, f"{warm} warm-up requests", 600, interval_s=0.2)
            n0, lat0, cpu0, t0 = stream.done, len(stream.latencies), thread_cpu(pids), time.monotonic()
            time.sleep(args.seconds)  # the measurement window itself
            cpu, window = cpu_delta(cpu0, thread_cpu(pids)), time.monotonic() - t0
            requests, latencies = stream.done - n0, stream.latencies[lat0:]
        finally:
            stream.stop()
    finally:
        if router is not None:
            router.stop()
        for server in reversed(servers):
            server.stop()
    n = max(requests, 1)
    return {"ratio": ratio, "requests": requests, "window_s": window,
            "cpu_ms_per_request": sum(cpu.values()) / n * 1e3,
            "latency_p50_ms": statistics.median(latencies) * 1e3 if latencies else None}


Rows = list[dict[str, Any]]


def serve_rows(args: argparse.Namespace, bench: BenchRun) -> tuple[Rows, Rows]:
    """(medians per ratio, every pair's figures)."""
    ratios = [float(r) for r in args.ratios.split(",") if r]
    model = random_checkpoint(MODEL_CACHE)
    runs: list[dict[str, Any]] = []
    for rnd in range(args.rounds):
        for ratio in ratios if rnd % 2 == 0 else ratios[::-1]:
            row = serve_pair(bench.dir / f"round{rnd}-ratio{ratio}", ratio, model, args, bench)
            runs.append({"round": rnd, **row})
            bench.say(f"round {rnd + 1}, ratio {ratio}: {row['requests']} requests in "
                      f"{row['window_s']:.0f} s, {row['cpu_ms_per_request']:.2f} ms engine CPU per request, "
                      "latency p50 "
                      f"{row['latency_p50_ms']:.0f} ms")
    rows = []
    for ratio in ratios:
        mine = [r for r in runs if r["ratio"] == ratio]
        rows.append({"ratio": ratio, "rounds": len(mine),
                     "cpu_ms_per_request": statistics.median(r["cpu_ms_per_request"] for r in mine),
                     "latency_p50_ms": statistics.median(r["latency_p50_ms"] for r in mine),
                     "requests": sum(r["requests"] for r in mine)})
    return rows, runs


def run(args: argparse.Namespace, bench: BenchRun) -> dict[str, Any]:
    parts = set(args.parts.split(","))
    result: dict[str, Any] = {"block_size": BLOCK, "prompt_lengths": PROMPT_LENGTHS}
    if "digest" in parts:
        result["digest"] = digest_times(args.repeats, bench)
    if "serve" in parts:
        result["serve"], result["serve_runs"] = serve_rows(args, bench)
        off = next((r for r in result["serve"] if r["ratio"] == 0), None)
        print("\nkv_verify_ratio | engine CPU per request (ms) | vs off | latency p50 (ms) | vs off")
        for r in result["serve"]:
            vs = (f"{100 * (r['cpu_ms_per_request'] / off['cpu_ms_per_request'] - 1):+.1f}%",
                  f"{100 * (r['latency_p50_ms'] / off['latency_p50_ms'] - 1):+.1f}%") if off else ("", "")
            print(f"{r['ratio']:>15} | {r['cpu_ms_per_request']:27.2f} | {vs[0]:>6} | "
                  f"{r['latency_p50_ms']:16.0f} | {vs[1]:>6}")
    return result

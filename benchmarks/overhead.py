"""Telemetry overhead on real `vllm serve`: the engines' CPU per request and the connector's share of it.

The goal measured: the connector's own work is at most 0.2% of the engines' CPU per
request with tracing off, and at most 0.5% with every request traced by the SDK.

Per mode and connector, a fresh P/D pair of real `vllm serve` (tiny random-weight
Llama, `--enforce-eager`, P on core 0 and D on core 1) behind the project's router
takes a steady stream of requests (`--concurrency` clients, fresh prompts, no
`traceparent`: the router makes the sampling decision). Over a window of `--seconds`,
py-spy samples every process of both engines (API server, engine core, workers) while
their threads' CPU is read from /proc. A sample is the connector's when the innermost
frame that belongs to the connector, to vLLM or to NIXL is the connector's (`OWNERS`:
what the connector calls counts for it, vLLM's work below one of its overrides does
not); each thread's share of such samples times that thread's CPU is the connector's
CPU, and its sum over both engines divided by their CPU is the connector's share. Also
reported: every sample with any `connector/` frame on its stack (an upper bound: the
overrides wrap vLLM's loops), vLLM's own nixl connector modules (stock has no
`connector/` frames: its figure, for scale), and OpenTelemetry (any thread).

Modes: `off` (no endpoint anywhere), `traced` (router and engines export OTLP/gRPC to
a local receiver, the SDK's default sampler: every request traced), `sampled` (the
same with OTEL_TRACES_SAMPLER=parentbased_traceidratio, arg 0.1). Stock is vLLM's
own connector built under the fork's two host settings (NIXL poll delay, CPU
containment; `benchmarks/stock_connector.py`), so both run on the same footing.
Needs py-spy (a dev dependency). Figures, not checks.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import importlib.util
import linecache
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import zlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from benchmarks.common import REPO, BenchRun, cpu_delta, thread_cpu
from demo import drive
from demo.engines import PROGRESS_DELAY_US, RouterProcess, VllmServer, session_pids
from demo.model import random_checkpoint
from demo.stack import MODEL_CACHE
from harness.otlp_receiver import OtlpGrpcReceiver
from harness.poll import wait_until

MODES: dict[str, dict[str, str]] = {
    "off": {},
    "traced": {},  # the SDK's default sampler: parent-based, always on
    "sampled": {"OTEL_TRACES_SAMPLER": "parentbased_traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0.1"},
}
CONNECTORS = ("fork", "stock")
PROMPT_LENGTHS = (40, 72, 100, 33, 130, 64)  # tokens; fresh random ids each request
STOCK_OVERRIDES = {"kv_connector_module_path": "benchmarks.stock_connector",
                   "kv_connector_extra_config": {"nixl_progress_delay_us": PROGRESS_DELAY_US}}


def _connector_dirs() -> tuple[str, ...]:
    """Where the project's `connector` package lives (the checkout, or where it is installed)."""
    dirs = {f"{REPO / 'connector'}/"}
    spec = importlib.util.find_spec("connector")
    for location in (spec.submodule_search_locations or []) if spec else []:
        dirs.add(f"{Path(location).resolve()}/")
    return tuple(sorted(dirs))


# Who owns a sample: the owner of its innermost frame that has one (first matching group
# per frame). Frames of anything else (the standard library, OpenTelemetry, ZMQ, torch)
# count for whoever called them, so the connector's share is its own code and what that
# code calls, and never vLLM's work below one of the connector's overrides.
OWNERS: dict[str, tuple[str, ...]] = {
    "connector": _connector_dirs(),
    "vllm_nixl": ("/vllm/distributed/kv_transfer/kv_connector/v1/nixl/",),
    "vllm": ("/vllm/",),
    "nixl": ("/site-packages/nixl",),  # (nixl, nixl_cu12, nixl_cu13: the bindings)
}
# Whole-stack labels: a sample counts when any of its frames matches (they overlap the
# owners). `connector_any` is every sample with a `connector/` frame on its stack: an upper
# bound, since the fork's overrides wrap vLLM's (its push writer's whole loop, for one).
ANY: dict[str, tuple[str, ...]] = {"connector_any": _connector_dirs(), "opentelemetry": ("/opentelemetry/",)}
# The connector's own samples that are telemetry: a frame of its telemetry package, of
# the OpenTelemetry SDK or of prometheus_client on the stack (the counterpart of
# `python -m benchmarks telemetry-cost`, which drives that code alone).
TELEMETRY = ("/connector/telemetry/", "/opentelemetry/", "/prometheus_client/")
# A sample whose innermost line is one of these calls is a thread waiting, off the CPU;
# py-spy's own idle detection misses short timed waits.
_WAITING = re.compile(r"\.acquire\((?!False)|\.poll\(|\.select\(|\.recv\(|\.recv_multipart\(|"
                      r"\.get\(block=True|sleep\(|\.wait\(|next_event\(")


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {', '.join(MODES)}")
    ap.add_argument("--seconds", type=int, default=20, help="py-spy window per pair")
    ap.add_argument("--rate", type=int, default=100, help="py-spy samples per second and thread")
    ap.add_argument("--concurrency", type=int, default=4, help="clients sending requests")
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=20, help="requests before the window (handshakes)")
    ap.add_argument("--connectors", default=",".join(CONNECTORS),
                    help=f"comma-separated, of {', '.join(CONNECTORS)}")


# ---------------------------------------------------------------- attribution
def _where(frame: str) -> tuple[str, int]:
    """(file, line) of a py-spy frame `function (file:line)`; line 0 when there is none."""
    where, _, line = frame.rpartition(" (")[2].rstrip(")").rpartition(":")
    return (where, int(line)) if line.isdigit() else (frame.rpartition(" (")[2], 0)


@functools.lru_cache(maxsize=100_000)
def is_waiting(frame: str) -> bool:
    """Whether a frame's source line is a blocking call (`_WAITING`)."""
    path, line = _where(frame)
    return bool(line) and bool(_WAITING.search(linecache.getline(path, line)))


def owner(paths: list[str]) -> str:
    """The owner (`OWNERS`) of a sample's innermost frame that has one, else "other"."""
    for path in reversed(paths):
        for name, fragments in OWNERS.items():
            if any(fragment in path for fragment in fragments):
                return name
    return "other"


def sample_counts(collapsed: str, waiting: Callable[[str], bool] = is_waiting
                  ) -> dict[int, collections.Counter]:
    """Per native thread id: its running samples (`"all"`), those of each owner (`OWNERS`,
    `"other"`) and of each whole-stack label (`ANY`), and the samples left out as waits
    (`"waiting"`). `collapsed`: py-spy's raw output with `--threads --full-filenames`, one
    `thread (<tid>): <name>;frame;frame ... <count>` line per distinct stack."""
    out: dict[int, collections.Counter] = {}
    for line in collapsed.splitlines():
        stack, _, count = line.rpartition(" ")
        frames = stack.split(";")
        try:
            tid = int(frames[0].split("(", 1)[1].split(")", 1)[0], 0)
            n = int(count)
        except (IndexError, ValueError):
            continue
        counter = out.setdefault(tid, collections.Counter())
        if len(frames) < 2 or waiting(frames[-1]):
            counter["waiting"] += n
            continue
        paths = [_where(frame)[0] for frame in frames[1:]]
        counter["all"] += n
        own = owner(paths)
        counter[own] += n
        if own == "connector" and any(fragment in path for path in paths for fragment in TELEMETRY):
            counter["connector_telemetry"] += n
        for label, fragments in ANY.items():
            if any(fragment in path for path in paths for fragment in fragments):
                counter[label] += n
    return out


def attributed_cpu(counts: Mapping[int, collections.Counter], cpu: Mapping[int, float],
                   labels: Iterable[str]) -> dict[str, float]:
    """CPU seconds per label: each thread's share of the label's samples times the thread's
    CPU (`cpu`: seconds by native thread id). Threads without samples (native threads,
    or never running while sampled) count for no label."""
    out = dict.fromkeys(labels, 0.0)
    for tid, counter in counts.items():
        if counter["all"] and tid in cpu:
            for label in out:
                out[label] += cpu[tid] * counter[label] / counter["all"]
    return out


# ---------------------------------------------------------------- the pair
@contextlib.contextmanager
def _environ(values: Mapping[str, str]) -> Iterator[None]:
    """These variables set in this process while inside (the router copies its environment)."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class Pair:
    """A P and a D `vllm serve` with one connector and tracing mode, and their router."""

    def __init__(self, workdir: Path, connector: str, mode: str, model: Path, otlp: str,
                 kv_overrides: dict[str, Any] | None = None):
        self.workdir, self.connector, self.mode, self.model = workdir, connector, mode, model
        self.kv_overrides = STOCK_OVERRIDES if connector == "stock" else kv_overrides
        self.otlp = otlp if mode != "off" else None
        self.servers: list[VllmServer] = []
        self.router: RouterProcess | None = None

    def start(self) -> None:
        """Start both engines (at once) and, once they are healthy, the router."""
        env = MODES[self.mode]
        kw: dict[str, Any] = {"model": self.model, "connector": self.connector,
                              "otlp_endpoint": self.otlp, "extra_env": dict(env)}
        if self.kv_overrides:
            kw["kv_overrides"] = self.kv_overrides
        self.workdir.mkdir(parents=True, exist_ok=True)
        tag = f"{self.connector}-{self.mode}"
        for name, role, cpu in (("prefill", "kv_producer", 0), ("decode", "kv_consumer", 1)):
            self.servers.append(VllmServer(self.workdir, name=name, kv_role=role,
                                           engine_id=f"{tag}-{name}", cpu=cpu, **kw))
        for server in self.servers:
            server.wait_healthy()
        with _environ(env):
            self.router = RouterProcess(self.workdir, self.servers[:1], self.servers[1:], self.otlp)
        self.router.wait_ready()

    def processes(self) -> dict[int, str]:
        """pid -> "P:<comm>" / "D:<comm>" for every live process of both engines."""
        out = {}
        for role, server in zip(("P", "D"), self.servers):
            for pid in session_pids(server.pid):
                with contextlib.suppress(OSError):
                    out[pid] = f"{role}:{Path(f'/proc/{pid}/comm').read_text().strip()}"
        return out

    def stop(self) -> None:
        """Stop whatever was started, router first (each by pid, with its session)."""
        for proc in (self.router, *reversed(self.servers)):
            if proc is not None:
                proc.stop()


class Stream:
    """`concurrency` clients sending requests through the router until stopped."""

    def __init__(self, url: str, concurrency: int, max_tokens: int, tag: str):
        self.url, self.max_tokens, self.tag = url, max_tokens, tag
        self.done = self.failed = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._pool = ThreadPoolExecutor(concurrency)
        self._futures = [self._pool.submit(self._client, i) for i in range(concurrency)]

    def _client(self, index: int) -> None:
        n = 0
        while not self._stop.is_set():
            n += 1
            [prompt] = drive.make_prompts(1, seed=zlib.crc32(f"{self.tag}-{index}-{n}".encode()),
                                          lengths=(PROMPT_LENGTHS[n % len(PROMPT_LENGTHS)],))
            ok = self.send(prompt, f"{self.tag}-{index}-{n}")
            with self._lock:
                if ok:
                    self.done += 1
                else:
                    self.failed += 1

    def send(self, prompt: list[int], request_id: str) -> bool:
        """One completion through the router, without a `traceparent` (the router samples);
        answered or not (a failure is counted, not raised)."""
        return not drive.disaggregated(self.url, prompt, request_id, self.max_tokens, timeout_s=120,
                                       traced=False).error

    def stop(self) -> None:
        self._stop.set()
        for fut in self._futures:
            fut.result(timeout=300)
        self._pool.shutdown()


def py_spy() -> str:
    """The py-spy executable (the venv's script directory first)."""
    search = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    spy = shutil.which("py-spy", path=search)
    if spy is None:
        raise SystemExit("py-spy is not installed: pip install py-spy")
    return spy


class Sampler:
    """py-spy on every process at once (raw collapsed stacks, per thread, without pausing
    them), from `start()`, which returns once every py-spy samples (attaching to a large
    process takes seconds), to `stop()` (SIGINT: py-spy then writes what it has)."""

    def __init__(self, spy: str, pids: list[int], out: Path, rate: int):
        self.paths = {pid: out / f"{pid}.collapsed.txt" for pid in pids}
        self._logs = {pid: out / f"{pid}.py-spy.log" for pid in pids}
        self._cmd = [spy, "record", "-r", str(rate), "-f", "raw", "--threads", "--nonblocking",
                     "--full-filenames"]
        self._procs: list[subprocess.Popen] = []

    def _sampling(self, pid: int, proc: subprocess.Popen) -> bool:
        """Sampling, or gone (py-spy cannot read every process: it then exits)."""
        return proc.poll() is not None or "Sampling process" in self._logs[pid].read_text(errors="replace")

    def start(self) -> None:
        for pid, path in self.paths.items():
            with open(self._logs[pid], "wb") as log:
                self._procs.append(subprocess.Popen([*self._cmd, "-p", str(pid), "-o", str(path)],
                                                    stdout=log, stderr=subprocess.STDOUT))
        wait_until(lambda: all(self._sampling(pid, proc) for pid, proc in zip(self.paths, self._procs)),
                   "py-spy sampling every engine process", 120, interval_s=0.1)

    def stop(self) -> dict[int, Path]:
        """pid -> its collapsed stacks (processes py-spy could not read have none)."""
        for proc in self._procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
        for proc in self._procs:
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        return {pid: path for pid, path in self.paths.items() if path.exists()}


def measure(pair: Pair, args: argparse.Namespace, spy: str, out: Path, rx: OtlpGrpcReceiver,
            tag: str) -> dict[str, Any]:
    """Steady stream, one py-spy window: CPU per request and the shares (see module doc)."""
    assert pair.router is not None
    processes = pair.processes()
    warm0 = thread_cpu(processes)
    stream = Stream(pair.router.url, args.concurrency, args.max_tokens, tag)
    try:
        warm = args.warmup + args.concurrency
        wait_until(lambda: stream.done >= warm, f"{warm} warm-up requests", 600, interval_s=0.2,
                   last=lambda: f"{stream.done} done, {stream.failed} failed")
        # py-spy only where the warm-up ran (not the resource trackers): fewer samplers to
        # share the cores with the engines, the CPU read still covers every process.
        warm_cpu = cpu_delta(warm0, thread_cpu(processes))
        busy = [pid for pid in processes if sum(v for (p, _), v in warm_cpu.items() if p == pid) > 0.05]
        sampler = Sampler(spy, busy, out, args.rate)
        try:
            sampler.start()
            spans0, n0, failed0 = len(rx.snapshot()), stream.done, stream.failed
            cpu0, t0 = thread_cpu(processes), time.monotonic()
            time.sleep(args.seconds)  # the measurement window itself
            cpu, window = cpu_delta(cpu0, thread_cpu(processes)), time.monotonic() - t0
            requests, failed = stream.done - n0, stream.failed - failed0
            spans = len(rx.snapshot()) - spans0
        finally:
            profiles = sampler.stop()
    finally:
        stream.stop()
    counts: dict[int, collections.Counter] = {}
    for path in profiles.values():
        counts.update(sample_counts(path.read_text()))
    keys = (*OWNERS, "connector_telemetry", "other", *ANY)
    total = sum(cpu.values())
    attributed = attributed_cpu(counts, {tid: s for (_, tid), s in cpu.items()}, keys)
    n = max(requests, 1)
    return {"requests": requests, "failed": failed, "window_s": window, "cpu_s": total,
            "cpu_ms_per_request": total / n * 1e3,
            "sampled_cpu_pct": 100 * sum(cpu.get((pid, tid), 0.0) for pid in processes for tid in counts
                                         if counts[tid]["all"]) / total if total else 0.0,
            "samples": {k: sum(c[k] for c in counts.values()) for k in ("all", "waiting", *keys)},
            "us_per_request": {k: v / n * 1e6 for k, v in attributed.items()},
            "share_pct": {k: 100 * v / total if total else 0.0 for k, v in attributed.items()},
            "spans_per_request": spans / n,
            "cpu_s_by_process": {f"{processes[pid]} ({pid})": sum(v for (p, _), v in cpu.items() if p == pid)
                                 for pid in processes},
            "profiles": sorted(str(p) for p in profiles.values())}


def run(args: argparse.Namespace, bench: BenchRun) -> dict[str, Any]:
    modes = [m for m in args.modes.split(",") if m]
    unknown = set(modes) - set(MODES)
    if unknown:
        raise SystemExit(f"unknown modes {sorted(unknown)}: use {', '.join(MODES)}")
    spy = py_spy()
    model = random_checkpoint(MODEL_CACHE)
    rows: list[dict[str, Any]] = []
    rx = OtlpGrpcReceiver()
    try:
        for i, mode in enumerate(modes):
            chosen = [c for c in CONNECTORS if c in args.connectors.split(",")]
            for connector in chosen if i % 2 == 0 else chosen[::-1]:
                where = bench.dir / f"{mode}-{connector}"
                t = time.monotonic()
                pair = Pair(where, connector, mode, model, rx.endpoint)
                try:
                    pair.start()
                    bench.say(f"{mode} {connector}: P and D vllm serve and router up in "
                              f"{time.monotonic() - t:.0f} s (logs in {where})")
                    t = time.monotonic()
                    row = {"mode": mode, "connector": connector,
                           **measure(pair, args, spy, where, rx, f"{mode}-{connector}")}
                finally:
                    pair.stop()
                rows.append(row)
                share = row["share_pct"]
                bench.say(f"{mode} {connector}: {row['requests']} requests in the {row['window_s']:.0f} s "
                          "window, "
                          f"{row['cpu_ms_per_request']:.2f} ms CPU per request, connector/ "
                          f"{share['connector']:.3f}%, vLLM nixl/ {share['vllm_nixl']:.3f}% "
                          f"({time.monotonic() - t:.0f} s)")
    finally:
        rx.close()
    _print(rows, args, bench)
    return {"window_s": args.seconds, "rate_hz": args.rate, "concurrency": args.concurrency,
            "max_tokens": args.max_tokens, "owners": {k: list(v) for k, v in OWNERS.items()},
            "any": {k: list(v) for k, v in ANY.items()}, "rows": rows}


def _cell(row: dict[str, Any], key: str) -> str:
    return f"{row['share_pct'][key]:.3f}% {row['us_per_request'][key]:.1f} us"


COLUMNS = {"connector": "connector/ (own)", "connector_telemetry": "own telemetry",
           "vllm_nixl": "vLLM nixl/ (own)",
           "opentelemetry": "OpenTelemetry", "connector_any": "any connector/ frame"}


def _print(rows: list[dict[str, Any]], args: argparse.Namespace, bench: BenchRun) -> None:
    print(f"\nTelemetry overhead on real vllm serve, {bench.date[:10]}, commit {bench.commit}: P+D "
          f"engines, {args.concurrency} clients, {args.max_tokens} tokens, py-spy {args.rate} Hz over "
          f"{args.seconds} s per pair. Per column: share of both engines' CPU and CPU us per request; "
          "goal for connector/: <= 0.2% off, <= 0.5% traced")
    print(f"{'mode':<8} {'connector':<9} {'requests':>8} {'CPU ms/req':>10} "
          + " ".join(f"{title:>20}" for title in COLUMNS.values()) + f" {'spans/req':>9}")
    for r in rows:
        cells = " ".join(f"{_cell(r, k):>20}" for k in COLUMNS)
        failed = f"  ({r['failed']} failed)" if r["failed"] else ""
        print(f"{r['mode']:<8} {r['connector']:<9} {r['requests']:>8} {r['cpu_ms_per_request']:>10.2f} "
              f"{cells} {r['spans_per_request']:>9.1f}{failed}")
    print("  own: the innermost connector/ or vLLM frame of a sample is the connector's (what it calls "
          "counts too, vLLM's work below its overrides does not); any connector/ frame: the upper bound "
          "(the fork's push writer wraps vLLM's whole loop). Running samples per row: "
          + ", ".join(f"{r['mode']} {r['connector']} {r['samples']['all']} ({r['samples']['connector']} own, "
                      f"{r['samples']['connector_telemetry']} own telemetry)" for r in rows))

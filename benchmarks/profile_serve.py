"""The fork's own CPU per request on real `vllm serve`, priced as `profile_push` does.

`profile_push` prices the connector's own work on harness engines, where a request
costs ~1.8 ms of CPU and nothing else happens. This does the same for a user's
engines: one P/D pair of real `vllm serve` with the fork (the tiny random-weight
Llama, `--enforce-eager`) behind its router, driven by `--concurrency` clients with
fresh prompts, first with tracing off, then (a fresh pair) exporting our spans over
OTLP/gRPC to a local receiver (always-on sampler; vLLM's own request spans off).

Per pair: a warm-up, then a window of `--seconds` without py-spy that reads every
thread's CPU of every process of both engines (API servers, engine cores) from
`/proc`, then a window of the same load with py-spy sampling each process (pausing it
per sample, so stacks are exact). A sample is ours when the deepest frame of ours, of
vLLM's or of NIXL's is ours (`profile_push._owner`), waits are left out, and a thread's
share of ours times its CPU per request from the first window is the fork's own CPU on
that thread. Prints it per process, with the sample counts behind it.

    pip install py-spy   # not a project dependency
    python -m benchmarks.profile_serve [--seconds 30] [--concurrency 4] [--max-tokens 4]
"""

from __future__ import annotations

import argparse
import contextlib
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from benchmarks.cpu_ab import ProcessClock
from benchmarks.profile_push import own_costs, print_own, py_spy, record, summary
from benchmarks.serve_cpu import Pair, _send
from demo.engines import session_pids
from demo.model import random_checkpoint
from demo.stack import MODEL_CACHE
from harness.otlp_receiver import OtlpGrpcReceiver


def _processes(pair: Pair) -> dict[int, str]:
    """pid -> "engine:process name" for every process of both engines."""
    out = {}
    for role, server in (("P", pair.prefill), ("D", pair.decode)):
        for pid in session_pids(server.pid):
            with contextlib.suppress(OSError):
                out[pid] = f"{role}:{Path(f'/proc/{pid}/comm').read_text().strip()}"
    return out


def _profile(variant: str, args: argparse.Namespace, model: Path, otlp: str, spy: str,
             out: Path, log: Any) -> dict[str, tuple[float, float, int, int]]:
    t0 = time.monotonic()
    pair = Pair(variant, out / variant, model, otlp)
    done = [0]
    stop = threading.Event()
    try:
        pair.wait_ready()
        log(f"{variant}: pair up in {time.monotonic() - t0:.0f} s (logs under {out / variant})")
        _send(pair, 20, args.concurrency, args.max_tokens, seed=-1)  # handshakes, first paths

        def drive() -> None:
            seed = 0
            while not stop.is_set():
                seed += 1
                failed = _send(pair, 4 * args.concurrency, args.concurrency, args.max_tokens, seed)
                done[0] += 4 * args.concurrency - failed

        processes = _processes(pair)
        clock = ProcessClock.of_processes(processes)
        driver = threading.Thread(target=drive, daemon=True)
        driver.start()
        time.sleep(3)  # a benchmark's ramp-up, not a synchronisation
        before, n0 = clock.read_threads(), done[0]
        time.sleep(args.seconds)
        after, n1 = clock.read_threads(), done[0]
        profiles = {(label, pid): out / f"{variant}-{label.replace(':', '-')}-{pid}.collapsed.txt"
                    for pid, label in sorted(processes.items(), key=lambda item: (item[1], item[0]))}
        record(spy, {path: pid for (_, pid), path in profiles.items()}, args.seconds)
        stop.set()
        driver.join(300)
    finally:
        pair.stop()
    requests = n1 - n0
    cpu = {k: after[k] - before.get(k, 0.0) for k in after}
    log(f"{variant}: {requests} requests in the {args.seconds} s window, "
        f"{sum(cpu.values()) / max(requests, 1) * 1e3:.2f} ms CPU per request (both engines)")
    found = [path for path in profiles.values() if path.exists()]  # (py-spy skips non-Python ones)
    for (label, _), path in profiles.items():
        if path in found:
            summary(path, f"{variant} {label}", args.top)
    own = own_costs(found, cpu, requests)
    all_cpu = sum(cpu.values()) / max(requests, 1) * 1e6
    log(f"\n{variant}: the fork's own CPU per request, by process (sample shares x thread CPU):")
    total = print_own(own, min_us=0.0, log=log)
    log(f"  {'both engines':<32} {total:6.1f} us of {all_cpu:.0f} us per request: "
        f"{100 * total / max(all_cpu, 1e-9):.2f}%\n")
    return own


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=int, default=30)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--top", type=int, default=8)
    ap.add_argument("--variants", nargs="+", default=["fork-off", "fork-on"],
                    choices=["fork-off", "fork-on"])
    ap.add_argument("--workdir", type=Path, default=Path(".cache/bench/profile-serve"))
    args = ap.parse_args(argv)
    spy = py_spy()
    args.workdir.mkdir(parents=True, exist_ok=True)
    out = Path(tempfile.mkdtemp(prefix="profile-serve-", dir=args.workdir)).resolve()
    print(f"engine logs and profiles under {out}", flush=True)
    t0 = time.monotonic()
    model = random_checkpoint(MODEL_CACHE)
    rx = OtlpGrpcReceiver()
    try:
        for variant in args.variants:
            _profile(variant, args, model, rx.endpoint, spy, out, lambda m: print(m, flush=True))
        print(f"{len(rx.snapshot())} spans received")
    finally:
        rx.close()
    print(f"done in {time.monotonic() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

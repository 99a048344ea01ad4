"""Where the fork's CPU goes on the push path: py-spy samples of a P/D pair under load.

One fork P/D pair (tracing on: always-on sampler, batch export over OTLP/gRPC to a
local receiver, or off with --no-tracing) pushes requests in a loop while py-spy
samples both engine processes (all threads, idle stacks excluded). Prints, per
process, the share of samples whose stack passes through this project's code
(`connector/`), the top functions of ours by inclusive share, and writes the
collapsed stacks (flame-graph input) next to the engine logs.

    pip install py-spy   # not a project dependency
    python -m benchmarks.profile_push [--seconds 20] [--batch 50] [--no-tracing]
"""

from __future__ import annotations

import argparse
import collections
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from connector.testing.otlp import OtlpGrpcReceiver
from harness import PushHarness
from harness.config import FORK, STOCK
from harness.runner import LOG_DIR_ENV

OURS = "connector/"


def _our_file(frame: str) -> str | None:
    """The project file a py-spy frame `func (path:line)` is in, or None (vLLM's own
    `kv_connector/` paths are not ours: py-spy prints our files relative, theirs under vllm/)."""
    path = frame.rpartition(" (")[2].split(":")[0]
    return path if path.startswith(OURS) else None


def _summary(path: Path, name: str, top: int) -> None:
    total = ours = 0
    by_func: collections.Counter[str] = collections.Counter()
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        n = int(count)
        total += n
        frames = stack.split(";")
        mine = {f"{f.rpartition(' (')[0]} ({path})" for f in frames if (path := _our_file(f))}
        if mine:
            ours += n
        for func in mine:
            by_func[func] += n
    print(f"\n{name}: {total} samples, {100 * ours / max(total, 1):.1f}% with connector/ code on the stack")
    for func, n in by_func.most_common(top):
        print(f"  {100 * n / max(total, 1):5.1f}%  {func}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=int, default=20)
    ap.add_argument("--batch", type=int, default=50)
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--no-tracing", action="store_true")
    ap.add_argument("--sampler", default=None,
                    help="OTEL_TRACES_SAMPLER for the engines, e.g. parentbased_always_off")
    ap.add_argument("--gil", action="store_true",
                    help="sample only the thread holding the GIL (Python CPU, not waits)")
    ap.add_argument("--connector", choices=(FORK, STOCK), default=FORK,
                    help="profile the stock connector instead (a baseline for the same stacks)")
    args = ap.parse_args(argv)
    # The venv's own script directory first: the benchmark may run without the venv on PATH.
    search = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    spy = shutil.which("py-spy", path=search)
    if spy is None:
        raise SystemExit("py-spy is not installed: pip install py-spy")
    out = Path(tempfile.mkdtemp(prefix="profile-push-"))
    os.environ.setdefault(LOG_DIR_ENV, str(out))
    print(f"engine logs and profiles: {out}", flush=True)
    rx = None if args.no_tracing else OtlpGrpcReceiver()
    tracing = None if rx is None else {"endpoint": rx.endpoint, "protocol": "grpc"}
    if tracing is not None and args.sampler:
        tracing["sampler"] = args.sampler
    stop = threading.Event()
    pushed = [0]
    try:
        with PushHarness.pd(connector=args.connector, tracing=tracing, workdir=str(out),
                            num_blocks=2 * args.batch + 8) as h:
            assert h.push(20).ok  # warm-up: handshakes

            def drive() -> None:
                while not stop.is_set():
                    h.reuse_blocks("P", "D")  # the cache is small on purpose
                    report = h.push(args.batch, verify=False)
                    pushed[0] += len(report.requests)

            driver = threading.Thread(target=drive, daemon=True)
            driver.start()
            time.sleep(2)  # a benchmark's ramp-up, not a synchronisation
            profiles = {n: out / f"{n}.collapsed.txt" for n in ("P", "D")}
            procs = [subprocess.Popen([spy, "record", "-p", str(h[n].info["pid"]), "-d", str(args.seconds),
                                       "-f", "raw", "-o", str(p), "-r", "200", "--nonblocking", "--threads"]
                                      + (["--gil"] if args.gil else []),
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                     for n, p in profiles.items()]
            for proc in procs:
                proc.wait()
            stop.set()
            driver.join(120)
    finally:
        if rx is not None:
            rx.close()
    print(f"pushed {pushed[0]} requests while sampling ({'tracing on' if tracing else 'tracing off'})")
    for name, path in profiles.items():
        _summary(path, f"{name} engine", args.top)
    print(f"\ncollapsed stacks: {', '.join(str(p) for p in profiles.values())}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

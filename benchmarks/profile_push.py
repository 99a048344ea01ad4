"""Where the fork's CPU goes on the push path: py-spy samples of a P/D pair under load.

One fork P/D pair (tracing on: always-on sampler, batch export over OTLP/gRPC to a
local receiver, or off with --no-tracing) pushes requests in a loop while py-spy
samples both engine processes (all threads, idle stacks excluded). Prints, per
process, the share of samples whose stack passes through this project's code
(`connector/`), the top functions of ours by inclusive share, and writes the
collapsed stacks (flame-graph input) next to the engine logs.

It also prices the fork's own work per request. Each sample is attributed to whoever
runs at its deepest frame of this project, of vLLM or of the harness: a sample in our
code, or in the standard library or OpenTelemetry called from it, is ours; one in vLLM's
code (NIXL calls included) is vLLM's, even below one of our wrappers. Samples of a
thread waiting (its innermost line a blocking call: a lock, poll, sleep or queue get)
are left out, as the CPU counters leave out that time. Each Python thread's share of
ours among its running samples times that thread's CPU per request (read from
`/proc/<pid>/task/*/schedstat` over a window of the same load just before sampling,
without py-spy's pauses) is the fork's own CPU per request on that thread. It leaves
out what the fork costs indirectly: in this harness every thread's CPU grows with wall
time (loops stepping and polling at 1-10 kHz), so a longer push costs CPU wherever it
waits; `cpu_ab` measures the whole.

    pip install py-spy   # not a project dependency
    python -m benchmarks.profile_push [--seconds 20] [--batch 50] [--bulk] [--no-tracing]
"""

from __future__ import annotations

import argparse
import collections
import linecache
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from benchmarks.cpu_ab import ProcessClock
from harness import PushHarness
from harness.config import FORK, STOCK
from harness.otlp_receiver import OtlpGrpcReceiver
from harness.runner import LOG_DIR_ENV

OURS = "connector/"
# A sample whose innermost line is one of these calls is a thread waiting, off the CPU.
# py-spy cannot tell (with --blocking it pauses every thread, so each looks active), and
# the /proc CPU it is multiplied by counts only running time: counting waits in a
# thread's samples would dilute every share of that thread.
_WAITING = re.compile(r"\.acquire\((?!False)|\.poll\(|\.select\(|\.recv\(|\.get\(block=True|"
                      r"sleep\(|\.wait\(|next_event\(")
_ROOTS = [Path(__file__).resolve().parent.parent, *(Path(p) for p in sys.path if p)]


def _our_file(frame: str) -> str | None:
    """The project file a py-spy frame `func (path:line)` is in, or None (vLLM's own
    `kv_connector/` paths are not ours: py-spy prints our files relative, theirs under vllm/)."""
    path = frame.rpartition(" (")[2].split(":")[0]
    return path if path.startswith(OURS) else None


def _source(frame: str) -> str:
    """The source line a py-spy frame `func (path:line)` points at ('' when not found)."""
    where, _, line = frame.rpartition(" (")[2].rstrip(")").rpartition(":")
    if not line.isdigit():
        return ""
    for root in _ROOTS:
        if (root / where).is_file():
            return linecache.getline(str(root / where), int(line))
    return ""


def _waiting(frames: list[str], cache: dict[str, bool]) -> bool:
    """Whether the sample's innermost line is a blocking call (see `_WAITING`)."""
    leaf = frames[-1]
    if leaf not in cache:
        cache[leaf] = bool(_WAITING.search(_source(leaf)))
    return cache[leaf]


def _owner(frames: list[str]) -> str:
    """Whose code runs in this sample: the deepest frame of ours, vLLM's or the harness's."""
    for frame in reversed(frames):
        where = frame.rpartition(" (")[2]
        if where.startswith(OURS):
            return "ours"
        if where.startswith(("vllm/", "harness/", "nixl")):
            return "theirs"
    return "theirs"


def own_cost(path: Path, cpu: dict[tuple[str, int], float],
              requests: int) -> dict[str, tuple[float, float, int, int]]:
    """Thread name -> (the fork's own CPU per request on it, the thread's CPU per request,
    both in us; samples of ours, running samples) (see module docstring): the share of
    ours among the thread's running samples (waits left out) times its CPU."""
    ours: collections.Counter[int] = collections.Counter()
    total: collections.Counter[int] = collections.Counter()
    cache: dict[str, bool] = {}
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        frames = stack.split(";")
        head = frames[0]  # "thread (<tid>): <name>" or "thread (<tid>)"
        try:
            tid = int(head.split("(", 1)[1].split(")", 1)[0], 0)
        except (IndexError, ValueError):
            continue
        if _waiting(frames, cache):
            continue
        total[tid] += int(count)
        if _owner(frames) == "ours":
            ours[tid] += int(count)
    out: dict[str, tuple[float, float, int, int]] = {}
    for (name, tid), seconds in cpu.items():
        if total[tid]:
            per_request = seconds / max(requests, 1) * 1e6
            own, thread, n_ours, n_total = out.get(name, (0.0, 0.0, 0, 0))
            out[name] = (own + ours[tid] / total[tid] * per_request, thread + per_request,
                         n_ours + ours[tid], n_total + total[tid])
    return out


def own_costs(paths: Iterable[Path], cpu: dict[tuple[str, int], float],
              requests: int) -> dict[str, tuple[float, float, int, int]]:
    """`own_cost` over several processes' profiles; rows of one name are summed."""
    own: dict[str, tuple[float, float, int, int]] = {}
    for path in paths:
        for name, (us, thread, n_ours, n_total) in own_cost(path, cpu, requests).items():
            a, b, c, d = own.get(name, (0.0, 0.0, 0, 0))
            own[name] = (a + us, b + thread, c + n_ours, d + n_total)
    return own


def print_own(own: dict[str, tuple[float, float, int, int]], min_us: float = 0.05,
              log: Any = print) -> float:
    """One line per row of `own_costs` with the sample counts behind it (rows under
    `min_us` left out); returns the total."""
    for name, (us, thread, n_ours, n_total) in sorted(own.items()):
        if us >= min_us:  # (few samples of ours: a rough figure; the sample counts say how rough)
            log(f"  {name:<32} {us:6.1f} us   ({n_ours} of {n_total} running samples ours, "
                f"its threads {thread:.0f} us per request)")
    return sum(v[0] for v in own.values())


def summary(path: Path, name: str, top: int) -> None:
    total = ours = waiting = 0
    by_func: collections.Counter[str] = collections.Counter()
    cache: dict[str, bool] = {}
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        n = int(count)
        frames = stack.split(";")
        if _waiting(frames, cache):
            waiting += n
            continue
        total += n
        mine = {f"{f.rpartition(' (')[0]} ({path})" for f in frames if (path := _our_file(f))}
        if mine:
            ours += n
        for func in mine:
            by_func[func] += n
    print(f"\n{name}: {total} running samples ({waiting} waiting left out), "
          f"{100 * ours / max(total, 1):.1f}% with connector/ code on the stack")
    for func, n in by_func.most_common(top):
        print(f"  {100 * n / max(total, 1):5.1f}%  {func}")


def py_spy() -> str:
    """The py-spy executable (the venv's own script directory first: a benchmark may
    run without the venv on PATH)."""
    search = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    spy = shutil.which("py-spy", path=search)
    if spy is None:
        raise SystemExit("py-spy is not installed: pip install py-spy")
    return spy


def record(spy: str, targets: dict[Path, int], seconds: int, flags: Iterable[str] = ()) -> None:
    """py-spy samples each process (pid) into its path for `seconds`, all at once (raw
    collapsed stacks, 200 Hz, per thread); returns when every one is done."""
    procs = [subprocess.Popen([spy, "record", "-p", str(pid), "-d", str(seconds), "-f", "raw",
                               "-o", str(path), "-r", "200", "--threads", *flags],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
             for path, pid in targets.items()]
    for proc in procs:
        proc.wait()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=int, default=20)
    ap.add_argument("--batch", type=int, default=50)
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--no-tracing", action="store_true")
    ap.add_argument("--bulk", action="store_true", help="one command per engine per batch (as under load)")
    ap.add_argument("--blocking", action="store_true",
                    help="pause the engines for each sample: exact stacks (without it a sample "
                         "can mix two moments' frames), at some cost to the engines")
    ap.add_argument("--sampler", default=None,
                    help="OTEL_TRACES_SAMPLER for the engines, e.g. parentbased_always_off")
    ap.add_argument("--gil", action="store_true",
                    help="sample only the thread holding the GIL (Python CPU, not waits)")
    ap.add_argument("--connector", choices=(FORK, STOCK), default=FORK,
                    help="profile the stock connector instead (a baseline for the same stacks)")
    args = ap.parse_args(argv)
    spy = py_spy()
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
                    report = h.push(args.batch, verify=False, bulk=args.bulk)
                    pushed[0] += len(report.requests)

            clock = ProcessClock(h)  # (asks the engines: before the driver shares their pipes)
            driver = threading.Thread(target=drive, daemon=True)
            driver.start()
            time.sleep(2)  # a benchmark's ramp-up, not a synchronisation
            # Each thread's CPU per request is read over a window without py-spy: its
            # pauses cost the engines' threads CPU of their own (a mostly idle thread
            # woken 200 times a second), which would be priced as the fork's.
            before, pushed_before = clock.read_threads(), pushed[0]
            time.sleep(args.seconds)
            after, pushed_after = clock.read_threads(), pushed[0]
            paused_before, paused_pushed_before = after, pushed_after
            profiles = {n: out / f"{n}.collapsed.txt" for n in ("P", "D")}
            flags = ([] if args.blocking else ["--nonblocking"]) + (["--gil"] if args.gil else [])
            record(spy, {p: h[n].info["pid"] for n, p in profiles.items()}, args.seconds, flags)
            paused_after, paused_pushed_after = clock.read_threads(), pushed[0]
            stop.set()
            driver.join(120)
    finally:
        if rx is not None:
            rx.close()
    print(f"pushed {pushed[0]} requests in all ({'tracing on' if tracing else 'tracing off'})")
    for name, path in profiles.items():
        summary(path, f"{name} engine", args.top)
    requests = pushed_after - pushed_before
    cpu = {k: after[k] - before.get(k, 0.0) for k in after}
    paused_requests = paused_pushed_after - paused_pushed_before
    paused_cpu = sum(paused_after[k] - paused_before.get(k, 0.0) for k in paused_after)
    print(f"CPU per request: {sum(cpu.values()) / max(requests, 1) * 1e6:.0f} us without py-spy "
          f"({requests} requests), {paused_cpu / max(paused_requests, 1) * 1e6:.0f} us while it "
          f"sampled ({paused_requests} requests); the first prices the shares")
    own = own_costs(profiles.values(), cpu, requests)
    python_cpu = sum(v for (name, _), v in cpu.items() if not name.endswith(":native")) / max(requests, 1)
    all_cpu = sum(cpu.values()) / max(requests, 1)
    print(f"\nthe {args.connector} connector's own CPU per request (its code and what it calls, "
          f"from sample shares x thread CPU; {requests} requests in the window):")
    total = print_own(own)
    print(f"  {'all threads':<32} {total:6.1f} us of {all_cpu * 1e6:.0f} us per request "
          f"({python_cpu * 1e6:.0f} us in Python threads): {100 * total / (all_cpu * 1e6):.1f}%")
    print(f"\ncollapsed stacks: {', '.join(str(p) for p in profiles.values())}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

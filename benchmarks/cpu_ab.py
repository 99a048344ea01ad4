"""CPU time per pushed request, fork vs stock, in the same engine processes.

`cpu_cost` compares a stock pair of engine processes with fork pairs. Two pairs started
alike can differ by 10-20% for their whole life (its A/A pair), so it resolves about
+-5% after 20 minutes. Here each fork pair also runs vLLM's stock code paths: before
each batch its engines swap the fork's classes and wrappers for vLLM's own, or back
(`harness/stock_swap.py`), so stock and fork batches run in the very same processes,
threads and memory, with no pair offset between them.

Pairs: the fork with tracing off, and with tracing on (always-on sampler, batch export
over OTLP/gRPC to a local receiver with the SDK's default schedule); `aa`, the A/A
control, alternates alike with both modes stock (its ratio shows the method's own
spread). Each session starts
the pairs afresh; each round then pushes `--batches` batches per mode through one pair
while the other pairs are frozen (SIGSTOP), after one unmeasured batch (the first after a
freeze costs more). Without tracing the mode alternates batch by batch (ABBA, BAAB in odd
rounds). With tracing each mode runs its batches in one block, the fork's block
ending with a flush that it is measured with (its spans leave within it, in batches as
the SDK's processor makes them, rather than a flush per 50 requests), and the blocks'
order alternates from round to round. CPU is read from outside the engines
(`/proc/<pid>/task/*/schedstat`), so measuring costs them nothing. `--bulk` hands each
batch to each engine in one command (one D step registers all of it, one P step
finishes all of it), as under load, instead of one round trip per request.

Reported per pair: the median over rounds of fork / stock CPU with [min-max], the same
for wall time, each session's median, and CPU by thread. In this harness CPU follows
wall time closely (engine loops stepping at 1 kHz, NIXL progress threads and vLLM's
writer polling), so a batch's CPU spreads as widely as its wall time does.

`known` calibrates that: its "fork" mode is stock plus a known CPU cost per request
(`--known-us` at each of four per-request sites: both engines' main threads and push
writers; harness/known_work.py). What the whole CPU makes of it, over the A/A control,
is the price of one microsecond of own work here, and turns the ratio goals into
budgets of own work per request.

    python -m benchmarks.cpu_ab [--sessions 2] [--rounds 8] [--batches 6] [--batch 50]
        [--bulk] [--pairs aa,off,on] [--known-us 25]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from benchmarks.cpu_cost import _SDK_DEFAULT_DELAY, _diff, _spread, push_batches
from harness import PushHarness
from harness.config import FORK
from harness.otlp_receiver import OtlpGrpcReceiver
from harness.runner import quiet_engine_logs

# The known pair's CPU per request and site, in us (four sites). 4 x 25 us stands out of
# a run's spread; 4 x 10 us, about the fork's own work with tracing off, gave a price
# twice the others' in one of two runs.
KNOWN_US = 25.0
KNOWN_SITES = 4

PAIRS: dict[str, dict[str, Any]] = {
    # A/A control: the same alternation, but both modes run vLLM's stock code paths.
    "aa": {"control": True},
    # Calibration: the A/A control with a known CPU cost per request in the "fork" mode
    # (harness/known_work.py: `--known-us` at each of the four per-request sites).
    "known": {"control": True, "known": True},
    "off": {},
    "on": {"tracing": {**_SDK_DEFAULT_DELAY}},  # always-on sampler (the SDK's default)
    "on-10%": {"tracing": {**_SDK_DEFAULT_DELAY, "sampler": "parentbased_traceidratio",
                           "sampler_arg": "0.1"}},
    "on-none": {"tracing": {**_SDK_DEFAULT_DELAY, "sampler": "parentbased_always_off"}},  # nothing sampled
}


class ProcessClock:
    """CPU seconds of processes' threads, read from outside (`/proc/<pid>/task/*/
    schedstat`, nanoseconds), so reading costs the processes nothing. The threads are
    those alive when the clock is made."""

    def __init__(self, h: PushHarness | None = None):
        """Both engines of a harness pair, threads named "engine:Python thread name"
        (threads outside Python: "native")."""
        self._tasks: list[tuple[str, int, Path]] = []
        if h is not None:
            for e in ("P", "D"):
                names = h[e].call("thread_names")
                self._add(h[e].info["pid"], lambda tid, e=e, names=names: f"{e}:{names.get(tid, 'native')}")

    @classmethod
    def of_processes(cls, labels: dict[int, str]) -> ProcessClock:
        """Processes outside the harness (pid -> label): each thread named by its process."""
        clock = cls()
        for pid, label in labels.items():
            clock._add(pid, lambda tid, label=label: label)
        return clock

    def _add(self, pid: int, name_of: Any) -> None:
        with contextlib.suppress(OSError):  # (a process that ended meanwhile is skipped)
            for task in Path(f"/proc/{pid}/task").iterdir():
                tid = int(task.name)
                self._tasks.append((name_of(tid), tid, task / "schedstat"))

    def read(self) -> dict[str, float]:
        """CPU seconds by thread name."""
        out: dict[str, float] = defaultdict(float)
        for (name, _), seconds in self.read_threads().items():
            out[name] += seconds
        return out

    def read_threads(self) -> dict[tuple[str, int], float]:
        """CPU seconds by (name, native thread id)."""
        out: dict[tuple[str, int], float] = {}
        for name, tid, path in self._tasks:
            # (A thread that ended meanwhile is skipped.)
            with contextlib.suppress(OSError, ValueError, IndexError):
                out[(name, tid)] = int(path.read_text().split()[0]) / 1e9
        return out


def _batch(h: PushHarness, clock: ProcessClock, flush: bool, batch: int,
           bulk: bool = False) -> tuple[float, dict]:
    """One measured batch: wall seconds, CPU seconds by thread."""
    h.reuse_blocks("P", "D")
    before = clock.read()
    t0 = time.perf_counter()
    report = h.push(batch, verify=False, bulk=bulk)
    if flush:
        for e in ("P", "D"):
            h[e].call("spans")  # force_flush: the block's spans leave within it
    wall = time.perf_counter() - t0
    after = clock.read()
    assert not report.failed, report
    return wall, _diff(after, before)


def cpu_ab_bench(sessions: int, rounds: int, batches: int, batch: int,
                 names: list[str], bulk: bool = False, known_us: float = KNOWN_US) -> dict[str, Any]:
    """Per pair and round: `batches` batches per mode, the mode alternating batch by
    batch (ABBA), CPU and wall summed per mode; the round's ratio is fork / stock.
    The `known` pair's "fork" mode burns `known_us` at each per-request site."""
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
            clocks: dict[str, ProcessClock] = {}
            try:
                for name in names[session % len(names):] + names[:session % len(names)]:
                    kw = dict(PAIRS[name])
                    kw.pop("control", None)
                    kw.pop("known", None)
                    if "tracing" in kw:
                        kw["tracing"] = {"endpoint": rx.endpoint, "protocol": "grpc", **kw["tracing"]}
                    pairs[name] = h = PushHarness.pd(
                        workdir=tempfile.mkdtemp(prefix=f"bench-ab-{name}-"), connector=FORK,
                        num_blocks=2 * max(batch, 20) + 8, **kw).start()
                    assert h.push(20).ok  # warm-up: handshakes, first connections
                    for stock in (True, False):  # unmeasured batches of each mode
                        h.stock_mode(stock)
                        push_batches(h, 4 * batch, batch)
                    clocks[name] = ProcessClock(h)  # (every thread has started by now)
                    h.pause()
                print(f"  session {session + 1}: {len(pairs)} pairs up "
                      f"({time.perf_counter() - t0:.0f} s)", flush=True)
                for r in range(rounds):
                    for name in names[r % len(names):] + names[:r % len(names)]:
                        h, traced = pairs[name], "tracing" in PAIRS[name]
                        control = PAIRS[name].get("control", False)
                        known = PAIRS[name].get("known", False)
                        h.resume()
                        # One unmeasured batch first: the first batch after a freeze cost
                        # more, and it was always a stock one (the A/A pair read 0.96).
                        # (In stock mode: no spans of it reach the fork's measured flush.)
                        h.stock_mode(True)
                        push_batches(h, batch, batch, bulk)
                        spent = {True: defaultdict(float), False: defaultdict(float)}
                        wall = {True: 0.0, False: 0.0}
                        for i in range(2 * batches):
                            if traced:  # blocks of one mode, ABBA over rounds (see docstring)
                                stock = (i < batches) == (r % 2 == 0)
                                flush = i % batches == batches - 1
                            else:  # ABBA batch by batch: S F F S S F F S ... (F S S F ... in odd rounds)
                                stock, flush = ((i % 4) in (0, 3)) == (r % 2 == 0), False
                            h.stock_mode(stock or control)
                            if known:
                                h.known_work(0.0 if stock else known_us)
                            w, by_thread = _batch(h, clocks[name], flush, batch, bulk)
                            wall[stock] += w
                            for k, v in by_thread.items():
                                spent[stock][k] += v
                        if known:
                            h.known_work(0.0)
                        h.pause()
                        n = batches * batch
                        total = {m: sum(spent[m].values()) / n for m in (True, False)}
                        ratios[name].append(total[False] / total[True])
                        wall_ratios[name].append(wall[False] / wall[True])
                        for stock, mode in ((True, "stock"), (False, "fork")):
                            cpu[name][mode].append(total[stock])
                            for k, v in spent[stock].items():
                                threads[name][mode][k].append(v / n)
                    print(f"  session {session + 1}, round {r + 1}/{rounds}: " + ", ".join(
                        f"{n} x{ratios[n][-1]:.3f}" for n in names), flush=True)
                for name in names:
                    session_medians[name].append(statistics.median(ratios[name][-rounds:]))
            finally:
                for h in pairs.values():
                    h.stop()
    finally:
        rx.close()
    per_round = batches * batch
    print(f"\n== CPU per pushed request, fork / stock in the same processes (P+D, all threads), "
          f"{sessions} sessions x {rounds} rounds x {per_round} requests per mode (untraced: the "
          f"mode alternating every {batch}; traced: a block per mode)" + (", bulk" if bulk else ""))
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
    rate = _known_rate(names, ratios, cpu, known_us) if "known" in names else None
    print(f"total {time.perf_counter() - t0:.0f} s")
    return {"known_rate": rate,
            "ratio": {n: statistics.median(r) for n, r in ratios.items()},
            "ratio_spread": {n: [min(r), max(r)] for n, r in ratios.items()},
            "wall_ratio": {n: statistics.median(r) for n, r in wall_ratios.items()},
            "stock_us": {n: statistics.median(cpu[n]["stock"]) * 1e6 for n in names},
            "fork_us": {n: statistics.median(cpu[n]["fork"]) * 1e6 for n in names}}


def _known_rate(names: list[str], ratios: dict[str, list[float]],
                cpu: dict[str, dict[str, list[float]]], known_us: float) -> float:
    """Print and return what one us of known work per request costs in whole CPU (the
    `known` pair's surcharge over the A/A control's, when it ran), and what that makes
    of the ratio goals and of each fork pair's surcharge."""
    stock_us = statistics.median(cpu["known"]["stock"]) * 1e6
    base = statistics.median(ratios["aa"]) if "aa" in names else 1.0
    added = KNOWN_SITES * known_us
    rate = (statistics.median(ratios["known"]) - base) * stock_us / added
    print(f"known work: {KNOWN_SITES} sites x {known_us:g} us = {added:g} us of CPU per request cost "
          f"{rate * added:.0f} us of whole CPU: x{rate:.2f}"
          + (f" (over the A/A control's {base:.3f})" if "aa" in names else ""))
    if rate > 0:
        for goal in (1.01, 1.03):
            print(f"  a ratio of {goal:.2f} here is {(goal - 1) * stock_us / rate:.0f} us of own work "
                  f"per request on these sites")
        for name in names:
            if name not in ("aa", "known"):
                extra = (statistics.median(ratios[name]) - base) * stock_us
                print(f"  {name}: {extra:.0f} us of whole CPU over the control, as if "
                      f"{extra / rate:.0f} us of own work")
    return rate


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sessions", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=8, help="rounds per session")
    ap.add_argument("--batches", type=int, default=6, help="batches per mode and round")
    ap.add_argument("--batch", type=int, default=50, help="requests per batch")
    ap.add_argument("--bulk", action="store_true",
                    help="each batch in one command per engine (one D step registers it all, "
                         "one P step finishes it all), as under load")
    ap.add_argument("--pairs", default="aa,off,on", help=f"comma-separated subset of {', '.join(PAIRS)}")
    ap.add_argument("--known-us", type=float, default=KNOWN_US,
                    help=f"the known pair's CPU per request at each of its {KNOWN_SITES} sites, in us")
    args = ap.parse_args(argv)
    names = [n for n in args.pairs.split(",") if n]
    unknown = [n for n in names if n not in PAIRS]
    if unknown or not names:
        ap.error(f"pairs come from {', '.join(PAIRS)}; got {unknown or names}")
    quiet_engine_logs("bench-ab-logs-")
    cpu_ab_bench(args.sessions, args.rounds, args.batches, args.batch, names, args.bulk, args.known_us)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

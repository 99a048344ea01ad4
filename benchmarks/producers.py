"""One decoder, M producers, all handshaking at once: how long until all are done, and why.

A decoder that starts talking to M producers at once (a new D joining a pool, or a D
whose peers all restarted) handshakes with all of them together. vLLM 0.32 runs a
worker's handshakes on a one-thread executor, so they queue; whatever the fork does,
this measures it. Engines: M fork producers, a fork decoder F and a stock decoder S
(notification-only vs full D->P handshakes), each decoder taking its turn (alternating
order) to handshake heartbeat-style with the first M producers at once, then forgetting
them. Per M and decoder, medians over rounds:
- all done: from submitting the M handshakes until the last finished;
- largest queue wait: the fork's own `queue_wait` phase (its handshake records), and,
  for both, how long a job waited on the worker's handshake executor (timed by the
  harness around the executor, `harness.instruments.ExecutorClock`), with how many
  ran at once;
- CPU per handshake: CPU seconds the decoder and the M producers spent during the
  call (all their threads, read from /proc), divided by M; and the floor this sets
  on this machine: that CPU spread over all its cores. When "all done" is near the
  floor the handshakes are CPU-bound here, not queued.

All engines share one machine, so a handshake waits for nothing but CPU; a second
pass (`--late-ms`) has every producer answer its side channel that late (the round
trip to another host, or a producer whose busy engine keeps its listener waiting),
the regime where handshakes queued one after the other add up.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path
from typing import Any

from benchmarks.common import BenchRun, caption, cpu_seconds, plt, rank_context
from benchmarks.handshake import handshake_records
from harness import PushHarness
from harness.config import FORK, STOCK, EngineSpec
from harness.ports import free_port

DECODERS = {"F": "fork", "S": "stock"}


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--producers", default="1,4,16", help="values of M, comma-separated (default 1,4,16)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--layers", type=int, default=2, help="each producer's layers")
    ap.add_argument("--blocks", type=int, default=64, help="each producer's blocks per layer")
    ap.add_argument("--late-ms", type=float, default=20.0,
                    help="a second pass with every producer's side channel answering this late "
                         "(0: no second pass)")


def _specs(n: int, layers: int, blocks: int, work: str) -> list[EngineSpec]:
    common = dict(num_layers=layers, num_kv_heads=1, head_dim=4, workdir=work)
    return [
        *(EngineSpec(name=f"P{i}", engine_id=f"prod-p{i}", kv_role="kv_producer",
                     side_channel_port=free_port(), connector=FORK, num_blocks=blocks, **common)
          for i in range(n)),
        EngineSpec(name="F", engine_id="prod-fork-decode", kv_role="kv_consumer",
                   side_channel_port=free_port(), connector=FORK, num_blocks=64, **common),
        EngineSpec(name="S", engine_id="prod-stock-decode", kv_role="kv_consumer",
                   side_channel_port=free_port(), connector=STOCK, num_blocks=64, **common),
    ]


def _round(h: PushHarness, decoder: str, m: int) -> dict[str, Any]:
    """One decoder handshakes with the first `m` producers at once, then forgets them."""
    targets = [h[f"P{i}"].address for i in range(m)]
    pids = [h[decoder].info["pid"], *(h[f"P{i}"].info["pid"] for i in range(m))]
    cpu0 = cpu_seconds(pids)
    res = h[decoder].call("timed_handshakes", targets, timeout=900)
    cpu = cpu_seconds(pids) - cpu0
    for t in targets:
        h[decoder].call("forget", t["engine_id"])
    ex = res["executor"]
    return {"all_done_s": res["seconds"], "cpu_s": cpu,
            "max_executor_wait_s": max(ex["waits_s"]) if ex["waits_s"] else None,
            "executor_jobs": len(ex["waits_s"]), "max_running": ex["max_running"]}


def _median(values: list[Any]) -> float | None:
    got = [v for v in values if v is not None]
    return statistics.median(got) if got else None


def run(args: argparse.Namespace, bench: BenchRun) -> dict[str, Any]:
    ms = [int(m) for m in args.producers.split(",")]
    lates = [0.0, args.late_ms] if args.late_ms else [0.0]
    cores = os.cpu_count() or 1
    work = str(bench.work)
    t = time.monotonic()
    rows: list[dict[str, Any]] = []
    with PushHarness(_specs(max(ms), args.layers, args.blocks, work), ctx=rank_context(bench.logs)) as h:
        bench.say(f"{max(ms)} producers and 2 decoders up in {time.monotonic() - t:.1f} s")
        all_targets = [h[f"P{i}"].address for i in range(max(ms))]
        for name in DECODERS:  # warm-up: the first UCX connections, not measured
            h[name].call("timed_handshakes", all_targets, timeout=900)
            for target in all_targets:
                h[name].call("forget", target["engine_id"])
        bench.say("warm-up handshakes done")
        for late in lates:
            if late:
                for i in range(max(ms)):
                    h[f"P{i}"].call("answer_side_channel_late", late)
            for m in ms:
                t = time.monotonic()
                rows += _measure(h, m, args.rounds, cores, late)
                fork, stock = rows[-2], rows[-1]
                bench.say(f"side channel +{late:g} ms, M={m}: all done fork {fork['all_done_ms']:.1f} ms, "
                          f"stock {stock['all_done_ms']:.1f} ms ({args.rounds} rounds, "
                          f"{time.monotonic() - t:.1f} s)")
    _print(rows, args.rounds, cores)
    return {"rounds": args.rounds, "cores": cores, "layers": args.layers, "blocks": args.blocks,
            "rows": rows}


def _measure(h: PushHarness, m: int, n_rounds: int, cores: int, late: float) -> list[dict[str, Any]]:
    """Both decoders with the first `m` producers, alternating order: one row per connector."""
    rounds: dict[str, list[dict[str, Any]]] = {name: [] for name in DECODERS}
    queue_wait: list[float] = []
    for i in range(n_rounds):
        for name in ("F", "S") if i % 2 == 0 else ("S", "F"):
            if name == "F":
                h.stats("F")  # (records of earlier rounds)
            rounds[name].append(_round(h, name, m))
            if name == "F":
                records = handshake_records(h, "F", m)
                queue_wait.append(max(r["phases"].get("queue_wait", 0.0) for r in records))
    rows = []
    for name, connector in DECODERS.items():
        got = rounds[name]
        cpu = _median([r["cpu_s"] for r in got]) or 0.0
        wait = _median([r["max_executor_wait_s"] for r in got])
        rows.append({"late_ms": late, "producers": m, "connector": connector,
                     "all_done_ms": _median([r["all_done_s"] for r in got]) * 1e3,
                     "max_queue_wait_ms": statistics.median(queue_wait) * 1e3 if name == "F" else None,
                     "max_executor_wait_ms": None if wait is None else wait * 1e3,
                     "executor_jobs": max(r["executor_jobs"] for r in got),
                     "max_running": max(r["max_running"] for r in got),
                     "cpu_ms_per_handshake": cpu / m * 1e3,
                     "cpu_floor_ms": cpu / cores * 1e3})
    return rows


def _print(rows: list[dict[str, Any]], rounds: int, cores: int) -> None:
    print(f"\nOne decoder, M producers at once, medians of {rounds} rounds "
          f"(queue wait: fork's record / harness's executor clock; CPU: decoder + M producers)")
    print(f"{'late ms':>7} {'M':>3} {'connector':<9} {'all done ms':>11} {'largest queue wait ms':>22} "
          f"{'ran at once':>11} {'CPU ms/handshake':>16} {f'{cores}-core floor ms':>17}")
    for r in rows:
        wait = f"{_ms_or_dash(r['max_queue_wait_ms'])} / {_ms_or_dash(r['max_executor_wait_ms'])}"
        print(f"{r['late_ms']:>7g} {r['producers']:>3} {r['connector']:<9} {r['all_done_ms']:>11.1f} "
              f"{wait:>22} {r['max_running'] or '-':>11} {r['cpu_ms_per_handshake']:>16.1f} "
              f"{r['cpu_floor_ms']:>17.1f}")
    if any(r["executor_jobs"] == 0 for r in rows):
        print("  (-: no job seen on the worker's handshake executor; that worker runs handshakes elsewhere)")


def _ms_or_dash(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def chart(result: dict[str, Any], path: Path) -> None:
    pyplot = plt()
    lates = sorted({r["late_ms"] for r in result["rows"]})
    fig, axes = pyplot.subplots(1, len(lates), figsize=(6 * len(lates), 4), squeeze=False)
    colors = {"fork": "tab:blue", "stock": "tab:orange"}
    for ax, late in zip(axes[0], lates, strict=True):
        at = [r for r in result["rows"] if r["late_ms"] == late]
        for connector, marker in (("fork", "o"), ("stock", "s")):
            rows = [r for r in at if r["connector"] == connector]
            ms = [r["producers"] for r in rows]
            ax.plot(ms, [r["all_done_ms"] for r in rows], f"{marker}-", color=colors[connector],
                    label=f"{connector}: all done")
            ax.plot(ms, [r["cpu_floor_ms"] for r in rows], f"{marker}:", color=colors[connector],
                    label=f"{connector}: CPU floor ({result['cores']} cores)")
        fork = [r for r in at if r["connector"] == "fork"]
        ax.plot([r["producers"] for r in fork], [r["max_queue_wait_ms"] for r in fork], "^--",
                color="tab:green", label="fork: largest queue_wait")
        ax.set_xticks(sorted({r["producers"] for r in at}))
        ax.set_xlabel("producers one decoder handshakes with at once")
        ax.set_ylabel("ms (median)")
        ax.set_title(f"side channel answers +{late:g} ms", fontsize=9)
        ax.legend(fontsize=8)
    fig.suptitle(f"One D, M producers ({caption(result)})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    pyplot.close(fig)

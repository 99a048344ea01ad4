"""What does a step cost as the engines hold more? Fork against stock vLLM, side by side.

Two P/D pairs of harness engines (real NIXL on CPU memory, real ZMQ), one with the fork,
one with stock vLLM's connector, started together. On each, state is added in steps and
the engine's own per-step calls (`start_load_kv`, `get_transfer_results`,
`get_kv_connector_stats`: what vLLM's model runner calls on the engine's main thread
every step) are timed on that thread's CPU clock, fork and stock in turn at every size:

- P holding N KV leases (finished prefills no decoder asked for yet; hour-long leases);
- D with N receives waiting for KV (heartbeated, their PUSH_REGs at a P that has no such
  request: they wait);
- D connected to N remote engines.

Per size: the main thread's CPU per step (median of `--steps`), how long vLLM's
`_sending_transfers_lock` was held per step, the CPU of applying one heartbeat that
names every held lease (the fork's writer applies it as it reads it; stock vLLM on its
main thread), and the Python heap per held lease. The goal the fork is held to: at
every size, its CPU per step at most stock's + 10% + 20 us.
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

from benchmarks.common import BenchRun, caption, plt
from harness import PushHarness
from harness.config import FORK, STOCK

GOAL_RATIO, GOAL_SLACK_US = 1.10, 20.0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sizes", default="10,100,1000,10000", help="held leases and waiting receives")
    p.add_argument("--peers", default="1,10,100,1000", help="remote engines known")
    p.add_argument("--steps", type=int, default=40, help="steps timed per round (their median)")
    p.add_argument("--rounds", type=int, default=3,
                   help="rounds per size, fork and stock in turn (the median of the rounds)")


def _pair(connector: str, bench: BenchRun) -> PushHarness:
    return PushHarness.pd(connector=connector, workdir=str(bench.work / connector), num_blocks=64,
                          extra_config={"kv_lease_duration": 3600})


def _within_goal(fork_us: float, stock_us: float) -> bool:
    return fork_us <= stock_us * GOAL_RATIO + GOAL_SLACK_US


def _sweep(bench: BenchRun, pairs: dict[str, PushHarness], what: str, sizes: list[int],
           grow: Any, engine: str, args: argparse.Namespace, extra: Any = None) -> list[dict[str, Any]]:
    rows = []
    have = dict.fromkeys(pairs, 0)
    for size in sizes:
        row: dict[str, Any] = {"size": size}
        for name, h in pairs.items():
            have[name] = grow(h, size - have[name])
            h[engine].call("time_steps", args.steps, timeout=600)  # (settling: not kept)
        rounds: dict[str, list[dict[str, float]]] = {name: [] for name in pairs}
        for _ in range(args.rounds):  # fork and stock in turn, the median of the rounds
            for name, h in pairs.items():
                rounds[name].append(h[engine].call("time_steps", args.steps, timeout=600))
        for name, h in pairs.items():
            row[f"{name}_cpu_us"] = round(statistics.median(r["cpu_us"] for r in rounds[name]), 1)
            row[f"{name}_cpu_mean_us"] = round(statistics.median(r["cpu_mean_us"] for r in rounds[name]), 1)
            row[f"{name}_lock_us"] = round(statistics.median(r["lock_held_us"] for r in rounds[name]), 2)
            if extra is not None:
                row.update({f"{name}_{k}": v for k, v in extra(h).items()})
        row["ratio"] = round(row["fork_cpu_us"] / max(row["stock_cpu_us"], 1e-9), 2)
        row["within_goal"] = _within_goal(row["fork_cpu_us"], row["stock_cpu_us"])
        rows.append(row)
        bench.say(f"{what} {size:>6}: CPU/step fork {row['fork_cpu_us']:8.1f} us, stock "
                  f"{row['stock_cpu_us']:8.1f} us (x{row['ratio']}); lock held fork "
                  f"{row['fork_lock_us']} us, stock {row['stock_lock_us']} us"
                  + ("" if extra is None else "; heartbeat fork "
                     f"{row.get('fork_heartbeat_us')} us, stock {row.get('stock_heartbeat_us')} us"))
    return rows


def run(args: argparse.Namespace, bench: BenchRun) -> dict[str, Any]:
    sizes = [int(x) for x in args.sizes.split(",")]
    peers = [int(x) for x in args.peers.split(",")]
    pairs = {"fork": _pair(FORK, bench), "stock": _pair(STOCK, bench)}
    try:
        bench.say("starting a fork P/D pair and a stock one (harness engines)")
        for h in pairs.values():
            h.start()

        def heartbeat(h: PushHarness) -> dict[str, float]:
            ids = h["P"].call("held_ids")
            return {"heartbeat_us": round(h["P"].call("time_heartbeat", ids, timeout=600), 1)}

        leases = _sweep(bench, pairs, "P leases", sizes,
                        lambda h, n: h["P"].call("hold_leases", n, timeout=600), "P", args,
                        extra=heartbeat)
        memory = {}
        for name, h in pairs.items():  # the heap per held lease, over 1,000 more
            h["P"].call("traced_memory", True)
            h["P"].call("hold_leases", 1000, timeout=600)
            memory[name] = round(h["P"].call("traced_memory", False) / 1000)
        bench.say(f"Python heap per held lease: fork {memory['fork']} B, stock {memory['stock']} B")
        receives = _sweep(bench, pairs, "D receives", sizes,
                          lambda h, n: h["D"].call("wait_receives", n, h["P"].address, timeout=600),
                          "D", args)
        known = _sweep(bench, pairs, "D peers", peers,
                       lambda h, n: h["D"].call("add_peers", n, timeout=600), "D", args)
    finally:
        for h in pairs.values():
            h.stop()
    within = all(r["within_goal"] for rows in (leases, receives, known) for r in rows)
    bench.say(f"goal (fork <= stock x {GOAL_RATIO} + {GOAL_SLACK_US:g} us per step at every size): "
              f"{'met' if within else 'NOT met'}")
    return {"steps": args.steps, "rounds": args.rounds,
            "goal": {"ratio": GOAL_RATIO, "slack_us": GOAL_SLACK_US, "met": within},
            "leases": leases, "receives": receives, "peers": known, "heap_per_lease_bytes": memory}


def chart(result: dict[str, Any], path: Any) -> None:
    pyplot = plt()
    fig, axes = pyplot.subplots(1, 3, figsize=(12, 4))
    for ax, (key, label) in zip(axes, (("leases", "leases P holds"), ("receives", "receives D waits on"),
                                       ("peers", "remote engines D knows"))):
        rows = result[key]
        sizes = [r["size"] for r in rows]
        for name, style in (("fork", "o-"), ("stock", "s--")):
            ax.plot(sizes, [r[f"{name}_cpu_us"] for r in rows], style, label=name)
        ax.set_xscale("log")
        ax.set_ylim(bottom=0)
        ax.set_xlabel(label)
        ax.set_ylabel("main thread CPU per step (us, median)")
        ax.legend()
    fig.suptitle(f"Per-step cost against what the engines hold ({caption(result)})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    pyplot.close(fig)

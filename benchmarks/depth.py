"""P's step time while it holds the KV of a thousand requests queued on D, fork and stock, real `vllm serve`.

The deployment where leases matter most: a decoder that falls behind. Per connector, a
P/D pair of real `vllm serve` behind the project's router (D one sequence at a time,
`--max-num-seqs 1`, kept busy by long local requests queued ahead of the burst; P kept
stepping by requests of its own, as a prefill in production always has work). `--requests` requests go through
the router at once: P prefills each and holds its KV under a lease, D queues them all.
D stays busy for `--hold-s` after P holds them all (longer than a lease, so only D's
heartbeats keep the leases), then is let go and serves the queue.

Reported per connector:
- P's step time with nothing held and while it holds every request's KV: the mean of
  vLLM's own `vllm:inter_token_latency_seconds` on P over each window (P's local
  requests decode one token per engine step, so their inter-token latency is the step);
- what P held (the fork's `vllm:nixl_kv_leases_held`), lease expiries (vLLM's count of
  released leases and the fork's), renewals;
- the requests: answered, and how many prompt tokens D loaded over NIXL
  (`vllm:prompt_tokens_by_source_total{source="external_kv_transfer"}`) against the
  prompt tokens sent: the fork must load every request's KV. Stock's leases expire under
  the queue, and each of its requests then waits `push_registration_timeout` (480 s) on D
  before it is recomputed: its queue is not waited for unless `--drain-stock`.

Opt-in (`make scale`), not in CI: a few minutes per connector. Figures, not checks.
"""

from __future__ import annotations

import argparse
import contextlib
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from benchmarks.common import BenchRun
from benchmarks.overhead import STOCK_OVERRIDES
from connector import settings
from connector.vocabulary import KV_LEASE_EXPIRIES, KV_LEASE_RENEWALS, KV_LEASES_HELD, PUSHES
from connector.vocabulary import VLLM_EXTERNAL_PROMPT_TOKENS as EXTERNAL
from connector.vocabulary import VLLM_KV_EXPIRED_TOTAL as EXPIRED
from demo import drive, report
from demo.stack import EngineOptions, Stack
from harness.poll import wait_until

ITL = "vllm:inter_token_latency_seconds"
BUSY_QUEUED = 8  # more local requests queued on D behind its running one, before the burst (about 40 s each)
PROMPT_HIST = "vllm:request_prompt_tokens"  # vLLM's buckets 1, 2, 5, 10, 20, 50, ... tokens
# P's KV cache: vLLM's CPU backend puts 128 tokens in a block, a block per request here, so the demo's
# 64 MiB (512 blocks) holds about 500; this holds 1,536 beside P's own stepping requests.
P_CACHE = ("--kv-cache-memory-bytes", "192M")
# Longer than P's own stepping requests (16 tokens): told apart in the prompt-length histogram.
PROMPT_TOKENS = 40


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--requests", type=int, default=1000, help="requests queued on D at once")
    ap.add_argument("--connectors", default="fork,stock")
    ap.add_argument("--lease-s", type=float, default=20.0, help="kv_lease_duration on both engines")
    ap.add_argument("--hold-s", type=float, default=30.0,
                    help="how long D stays busy after P holds every request (more than a lease)")
    ap.add_argument("--window-s", type=float, default=15.0, help="P's step-time window with nothing held")
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--drain-stock", action="store_true",
                    help="wait for stock's D to serve its queue (each request whose lease ran out waits "
                         "push_registration_timeout, 480 s)")


def _samples(server: Any) -> list[report.Sample]:
    return report.samples(server.metrics())


def _total(samples: list[report.Sample], name: str, **labels: str) -> float:
    return report.total(samples, name, missing_ok=True, **labels)


def _prefilled(server: Any) -> float | None:
    """Requests P finished with prompts longer than its own stepping requests' (the queued
    requests' prefills: P holds the KV of each); None when P's /metrics did not answer."""
    try:
        s = _samples(server)
    except OSError:  # (P busy prefilling a thousand requests: asked again at the next poll)
        return None
    short = sum(v for n, lab, v in s if n == PROMPT_HIST + "_bucket" and float(lab.get("le", "inf")) == 20.0)
    return _total(s, PROMPT_HIST + "_count") - short


def _itl(server: Any) -> tuple[float, float]:
    """(sum, count) of P's inter-token latency histogram so far."""
    s = _samples(server)
    return _total(s, ITL + "_sum"), _total(s, ITL + "_count")


def _mean_ms(before: tuple[float, float], after: tuple[float, float]) -> float | None:
    n = after[1] - before[1]
    return (after[0] - before[0]) / n * 1e3 if n > 0 else None


def options(connector: str, lease_s: float) -> dict[str, Any]:
    lease = {"kv_connector_extra_config": {"kv_lease_duration": lease_s}}
    return {"connector": connector,
            "kv_overrides": STOCK_OVERRIDES if connector == "stock" else None,
            "prefill": EngineOptions(kv=lease, args=P_CACHE),
            "decode": EngineOptions(kv={**lease, "kv_load_failure_policy": "recompute"},
                                    args=("--max-num-seqs", "1"), max_model_len=4096)}


def one(connector: str, args: argparse.Namespace, bench: BenchRun) -> dict[str, Any]:
    work = bench.dir / connector
    # Stock's requests whose lease ran out wait push_registration_timeout (480 s) on D for KV that will
    # not come: P's figures are taken and the queue is not waited for, unless --drain-stock.
    drain = connector != "stock" or args.drain_stock
    pool: ThreadPoolExecutor | None = None
    t = time.monotonic()
    stack = Stack(work, **options(connector, args.lease_s))
    try:
        stack.start()
        assert stack.prefill is not None and stack.decode is not None and stack.router is not None
        p, d, url = stack.prefill, stack.decode, stack.router.url
        bench.say(f"{connector}: P, D and the router up in {time.monotonic() - t:.0f} s (logs in {work})")
        prompts = drive.make_prompts(args.requests, seed=77, lengths=(PROMPT_TOKENS,))
        with drive.KeepStepping(p.url):
            wait_until(lambda: _itl(p)[1] > 0, "P's local requests to step", 120, 0.5)
            idle0 = _itl(p)
            time.sleep(args.window_s)  # P's step time with nothing held: the window itself
            idle = _mean_ms(idle0, _itl(p))
            p0, d0 = _samples(p), _samples(d)
            outcomes: list[drive.Outcome | None] = [None] * len(prompts)
            with contextlib.ExitStack() as busy:  # D's one slot taken, local requests queued first
                busy.enter_context(drive.Busy(d.url))  # (each runs up to about 40 s here)
                for seed in range(BUSY_QUEUED):
                    busy.enter_context(drive.Busy(d.url, seed=6 + seed, wait=False))
                pool = ThreadPoolExecutor(len(prompts))

                def send(i: int) -> None:
                    outcomes[i] = drive.disaggregated(url, prompts[i], f"depth-{connector}-{i:04d}",
                                                      args.max_tokens, timeout_s=1800)

                prefilled0 = _prefilled(p)
                assert prefilled0 is not None, "P's /metrics did not answer"
                futures = [pool.submit(send, i) for i in range(len(prompts))]
                t = time.monotonic()

                def prefilled() -> float:
                    done = (_prefilled(p) or prefilled0) - prefilled0
                    with contextlib.suppress(OSError):  # (the fork's gauge says it as soon)
                        done = max(done, _total(_samples(p), KV_LEASES_HELD.name))
                    return done

                wait_until(lambda: prefilled() >= len(prompts), f"P to prefill all {len(prompts)} requests",
                           900, 2.0, last=lambda: f"{prefilled():.0f} prefilled")
                bench.say(f"{connector}: P prefilled all {len(prompts)} requests in "
                          f"{time.monotonic() - t:.0f} s; "
                          f"D holds them behind its busy request for {args.hold_s:.0f} s")
                held0, t_hold = _itl(p), time.monotonic()
                held_max = 0.0
                while time.monotonic() - t_hold < args.hold_s:  # the held window; P sampled every 2 s
                    with contextlib.suppress(OSError):
                        held_max = max(held_max, _total(_samples(p), KV_LEASES_HELD.name))
                    time.sleep(2.0)
                held = _mean_ms(held0, _itl(p))
                early = sum(f.done() for f in futures)  # (0: D held the whole queue until let go)
            t = time.monotonic()
            if drain:
                for fut in futures:
                    fut.result()
                bench.say(f"{connector}: D served the queue in {time.monotonic() - t:.0f} s")
        p1, d1 = _samples(p), _samples(d)
    finally:
        stack.close()
        if pool is not None:  # (not drained: the requests end as the router goes)
            pool.shutdown(wait=True, cancel_futures=True)
    done = [o for o in outcomes if o is not None] if drain else []
    errors = [o.error for o in done if o.error]
    sent_tokens = sum(len(x) for x in prompts)
    external = _total(d1, EXTERNAL[0], **EXTERNAL[1]) - _total(d0, EXTERNAL[0], **EXTERNAL[1])
    return {"connector": connector, "requests": len(prompts), "drained": drain,
            "answered": len(done) - len(errors),
            "errors": len(errors), "first_errors": errors[:3], "answered_before_d_let_go": early,
            "p_step_ms_idle": idle, "p_step_ms_holding": held, "leases_held_max": held_max,
            "prompt_tokens_sent": sent_tokens, "prompt_tokens_over_nixl": external,
            "kv_over_nixl_pct": 100 * external / sent_tokens if sent_tokens else 0.0,
            "vllm_expired": _total(p1, EXPIRED) - _total(p0, EXPIRED),
            "fork_expiries": _total(p1, KV_LEASE_EXPIRIES.name + "_total")
            - _total(p0, KV_LEASE_EXPIRIES.name + "_total"),
            "renewals": _total(p1, KV_LEASE_RENEWALS.name + "_total", outcome="renewed")
            - _total(p0, KV_LEASE_RENEWALS.name + "_total", outcome="renewed"),
            "pushes_completed": _total(p1, PUSHES.name + "_total", outcome="completed")
            - _total(p0, PUSHES.name + "_total", outcome="completed")}


def run(args: argparse.Namespace, bench: BenchRun) -> dict[str, Any]:
    if args.hold_s <= args.lease_s:
        raise SystemExit("--hold-s must be longer than --lease-s (only D's heartbeats keep the KV then)")
    rows = [one(c, args, bench) for c in args.connectors.split(",") if c]
    print(f"\nP's step time holding the KV of {args.requests} requests queued on D, {bench.date[:10]}, "
          f"commit {bench.commit}: lease {args.lease_s:.0f} s, D busy {args.hold_s:.0f} s after P held them "
          "all; "
          "P's step = mean inter-token latency of its own requests (vLLM's histogram)")
    print(f"{'connector':<9} {'step, none held':>15} {'step, holding':>13} {'held (max)':>10} "
          f"{'answered':>8} {'KV over NIXL':>12} {'expired (vLLM)':>14} {'renewals':>8}")
    for r in rows:
        def ms(v: float | None) -> str:
            return f"{v:.2f} ms" if v is not None else "-"
        held = f"{r['leases_held_max']:.0f}" if r["connector"] != "stock" else "-"  # (the fork's gauge)
        answered, kv = (f"{r['answered']}", f"{r['kv_over_nixl_pct']:.1f}%") if r["drained"] else ("-", "-")
        print(f"{r['connector']:<9} {ms(r['p_step_ms_idle']):>15} {ms(r['p_step_ms_holding']):>13} "
              f"{held:>10} {answered:>8} {kv:>12} {r['vllm_expired']:>14.0f} {r['renewals']:>8.0f}")
        if not r["drained"]:
            print(f"  {r['connector']}: the queue was not waited for (--drain-stock): D waits "
                  "push_registration_timeout for each request whose lease expired")
        if r["answered_before_d_let_go"]:
            print(f"  {r['connector']}: {r['answered_before_d_let_go']} requests ended before D was let go "
                  "(its busy requests ran out: lower --hold-s)")
        if r["errors"]:
            print(f"  {r['connector']}: {r['errors']} requests failed, e.g. {r['first_errors']}")
    return {"lease_s": args.lease_s, "hold_s": args.hold_s, "max_tokens": args.max_tokens,
            "prompt_tokens": PROMPT_TOKENS, "rows": rows,
            "default_lease_s": settings.lease_s(lambda _key, default=None: default)}


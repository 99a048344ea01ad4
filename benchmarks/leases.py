"""Do requests queued on a decoder keep their KV? A burst on real `vllm serve`, fork vs stock.

The deployment of `make demo` with a short KV lease on both engines (`--lease-s`) and a
decoder that serves one sequence at a time: long local requests keep D busy for
`--busy-leases` leases (then they are cut short) while a burst of disaggregated
requests arrives through the router; P is kept stepping by small requests of its own
(as a production prefill is). The requests wait in D's queue longer than P's lease.
D's heartbeats renew the leases on the fork; upstream they renew nothing and P
releases the KV. Printed per connector: P's lease expiries (vLLM's own
`vllm:nixl_num_kv_expired_reqs` and ours by fate), renewals, prompt tokens that
arrived as KV over NIXL, answers and their latencies.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from typing import Any

from benchmarks.common import BenchRun
from connector.vocabulary import VLLM_EXTERNAL_PROMPT_TOKENS as EXTERNAL
from connector.vocabulary import VLLM_KV_EXPIRED_TOTAL as EXPIRED
from demo import drive, report
from demo.stack import EngineOptions, Stack


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--connectors", default="fork,stock", help="comma-separated: fork, stock")
    p.add_argument("--requests", type=int, default=4, help="disaggregated requests in the burst")
    p.add_argument("--prompt-tokens", type=int, default=200)
    p.add_argument("--lease-s", type=int, default=9, help="kv_lease_duration on both engines")
    p.add_argument("--busy-leases", type=float, default=2.0,
                   help="how many leases D stays busy with its local request")
    p.add_argument("--hosts", action="store_true", help="P, D and the router on hosts of their own")


def _count(server: Any, name: str, **labels: str) -> float:
    return report.total(report.samples(server.metrics()), name, **labels)


def one(connector: str, args: argparse.Namespace, bench: BenchRun) -> dict[str, Any]:
    lease = {"kv_connector_extra_config": {"kv_lease_duration": args.lease_s}}
    stack = Stack(bench.dir / connector, connector=connector, hosts=args.hosts, progress=bench.say,
                  nixl_progress_delay_us=None if connector == "stock" else 100,
                  prefill=EngineOptions(kv=lease),
                  decode=EngineOptions(kv={**lease, "kv_load_failure_policy": "recompute"},
                                       args=("--max-num-seqs", "1"), max_model_len=4096))
    with stack:
        prompts = drive.make_prompts(args.requests, seed=31, lengths=(args.prompt_tokens,))
        before = _count(stack.decode, EXTERNAL[0], **EXTERNAL[1])
        busy_s = args.busy_leases * args.lease_s
        bench.say(f"{connector}: D busy for {busy_s:.0f} s with local requests, "
                  f"then {args.requests} requests through the router")
        with drive.KeepStepping(stack.prefill.url), contextlib.ExitStack() as local:
            for seed in range(3):  # each cut short when D's busy spell ends
                local.enter_context(drive.Busy(stack.decode.url, seed=seed, wait=seed == 0))
            burst = [drive.InBackground(stack.router.url, prompt, f"{connector}-burst-{i:03d}", 8,
                                        timeout_s=busy_s + 4 * args.lease_s)
                     for i, prompt in enumerate(prompts)]
            time.sleep(busy_s)  # the scenario: D's queue holds the burst this long
        results = [(b.join(), b.seconds) for b in burst]
        p, d = report.samples(stack.prefill.metrics()), report.samples(stack.decode.metrics())
        answered = [o for o, _ in results if not o.error]
        out = {
            "answered": len(answered), "requests": len(results),
            "latency_s": [round(t, 2) for _, t in results],
            "median_latency_s": round(statistics.median(t for _, t in results), 2),
            "vllm_expired": report.total(p, EXPIRED),
            "expiries_by_fate": {lab.get("fate"): v for n, lab, v in p
                                 if n == "vllm:nixl_kv_lease_expiries_total" and v},
            "renewed": report.total(p, "vllm:nixl_kv_lease_renewals_total", outcome="renewed"),
            "heartbeats_sent": report.total(d, "vllm:nixl_heartbeats_total", outcome="sent"),
            "kv_tokens": report.total(d, EXTERNAL[0], **EXTERNAL[1]) - before,
            "prompt_tokens": sum(len(x) for x in prompts),
            "receive_failures": {lab.get("reason"): v for n, lab, v in d
                                 if n == "vllm:nixl_receive_failures_total" and v},
        }
    bench.say(f"{connector}: {out['answered']}/{out['requests']} answered, P expired "
              f"{out['vllm_expired']:.0f} lease(s), {out['kv_tokens']:.0f} of {out['prompt_tokens']} "
              f"prompt tokens arrived as KV")
    return out


def run(args: argparse.Namespace, bench: BenchRun) -> dict[str, Any]:
    results = {c: one(c, args, bench) for c in args.connectors.split(",")}
    print()
    print(f"{'':28}" + "".join(f"{c:>12}" for c in results))
    rows = (("answered", lambda r: f"{r['answered']}/{r['requests']}"),
            ("P leases expired (vLLM)", lambda r: f"{r['vllm_expired']:.0f}"),
            ("heartbeat renewals on P", lambda r: f"{r['renewed']:.0f}"),
            ("prompt tokens as KV", lambda r: f"{r['kv_tokens']:.0f}/{r['prompt_tokens']}"),
            ("median latency (s)", lambda r: f"{r['median_latency_s']:.1f}"))
    for label, cell in rows:
        print(f"{label:28}" + "".join(f"{cell(r):>12}" for r in results.values()))
    print()
    return {"settings": {k: getattr(args, k) for k in ("requests", "prompt_tokens", "lease_s",
                                                       "busy_leases", "hosts")},
            "connectors": results}

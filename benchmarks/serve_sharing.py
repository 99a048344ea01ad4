"""Two real `vllm serve` engines on one CPU host: what the CPU pin and NIXL's spin cost.

For each variant, in rotating order, a fresh `make demo` stack (P and D `vllm serve`
with the fork, router, Prometheus, OTLP receiver) is started, left idle for a few
seconds (CPU cores both engines use while idle), then sent `--requests` requests one
by one with a client timeout of `--timeout` seconds. Variants: `kv_transfer_cpu_affinity`
`contain` (the fork's default) or `upstream` (vLLM's pin to the last core of each NUMA
node kept), each with `nixl_progress_delay_us` 100 (`make demo`'s) or unset (NIXL's
busy loop).

    python -m benchmarks.serve_sharing [--repeats 2] [--requests 4] [--timeout 45]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

from benchmarks.serve_cpu import cpu_seconds
from demo import drive
from demo.engines import PROGRESS_DELAY_US, session_pids
from demo.stack import Stack

VARIANTS: list[tuple[str, int | None]] = [("contain", PROGRESS_DELAY_US), ("contain", None),
                                          ("upstream", PROGRESS_DELAY_US), ("upstream", None)]
IDLE_S = 8.0


def _one(workdir: Path, policy: str, delay: int | None, requests: int, timeout_s: float,
         seed: int) -> dict[str, Any]:
    stack = Stack(workdir, nixl_progress_delay_us=delay,
                  kv_overrides={"kv_connector_extra_config": {"kv_transfer_cpu_affinity": policy}})
    out: dict[str, Any] = {"policy": policy, "delay": delay}
    try:
        stack.start()
        assert stack.prefill is not None and stack.decode is not None and stack.router is not None
        pids = session_pids(stack.prefill.pid) + session_pids(stack.decode.pid)
        before, t0 = cpu_seconds(pids), time.monotonic()
        time.sleep(IDLE_S)  # the measurement itself: CPU used over this idle window
        out["idle_cores"] = (cpu_seconds(pids) - before) / (time.monotonic() - t0)
        latencies: list[float | None] = []
        for i, prompt in enumerate(drive.make_prompts(requests, seed=seed)):
            t = time.monotonic()
            o = drive.disaggregated(stack.router.url, prompt, f"sharing-{seed}-{i}", 6, timeout_s=timeout_s)
            latencies.append(None if o.error else time.monotonic() - t)
        out["latencies"] = latencies
    finally:
        stack.close()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--timeout", type=float, default=45.0)
    ap.add_argument("--workdir", type=Path, default=Path(".cache/bench/serve-sharing"))
    args = ap.parse_args(argv)
    print(f"engine logs under {args.workdir.resolve()}")
    t_all = time.monotonic()
    results: list[dict[str, Any]] = []
    for r in range(args.repeats):
        for k in range(len(VARIANTS)):
            policy, delay = VARIANTS[(k + r) % len(VARIANTS)]
            t0 = time.monotonic()
            res = _one(args.workdir / f"{r}-{policy}-{delay}", policy, delay, args.requests,
                       args.timeout, seed=100 * r + k)
            results.append(res)
            lat = ", ".join("timeout" if x is None else f"{x:.2f}" for x in res["latencies"])
            print(f"[{time.monotonic() - t_all:6.0f}s] {policy:8s} delay={delay}: idle "
                  f"{res['idle_cores']:.2f} cores, requests (s): {lat} ({time.monotonic() - t0:.0f} s)")
    print(f"\n{'cpu affinity':12s} {'NIXL poll delay':16s} {'idle cores':>10s} {'ok':>6s} "
          f"{'median s':>9s} {'max s':>6s}")
    for policy, delay in VARIANTS:
        rows = [x for x in results if x["policy"] == policy and x["delay"] == delay]
        lats = [v for x in rows for v in x["latencies"]]
        done = [v for v in lats if v is not None]
        print(f"{policy:12s} {str(delay) + ' us' if delay else 'busy loop':16s} "
              f"{statistics.median(x['idle_cores'] for x in rows):10.2f} {len(done):>3d}/{len(lats):<2d} "
              f"{statistics.median(done) if done else float('nan'):9.2f} "
              f"{max(done) if done else float('nan'):6.2f}")
    print(f"done in {time.monotonic() - t_all:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

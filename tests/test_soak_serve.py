"""Soak on real `vllm serve` under CPU pressure (opt-in: `make soak`, or SOAK=1).

The deployment of `make demo` (router, P and D with the fork, tracing on into the
local OTLP receiver, Prometheus), plus one busy-looping process per core beside it.
Requests go through the router in concurrent waves (the shape that once left D legs
reaching D after P's 30 s lease, and the requests waiting for D's 480 s watchdog).
Every request must end within REQUEST_DEADLINE_S, far below that watchdog: with the
single-engine reference output, or with an error; and every KV load that did not
come over NIXL must be counted on /metrics with a reason.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from connector.vocabulary import VLLM_KV_EXPIRED_TOTAL
from demo import drive, report
from demo.stack import Stack

pytestmark = [
    pytest.mark.real, pytest.mark.serve, pytest.mark.prometheus, pytest.mark.timeout(3600),
    pytest.mark.skipif(os.environ.get("SOAK") != "1", reason="opt-in soak: SOAK=1 (make soak)"),
]

WAVES = int(os.environ.get("SOAK_WAVES", "8"))
WAVE_SIZE = int(os.environ.get("SOAK_WAVE_SIZE", "4"))
MAX_TOKENS = 6
REQUEST_DEADLINE_S = 150.0  # > P's 30 s lease plus retries; << D's 480 s registration watchdog


def test_every_request_ends_in_time_under_a_cpu_hog(tmp_path):
    stack = Stack(tmp_path / "soak", progress=lambda m: print(m, flush=True))
    hogs: list[subprocess.Popen] = []
    try:
        stack.start()
        # The hog starts once the engines are up (start-up under it only takes longer).
        hog = [sys.executable, "-c", "while True: pass"]
        hogs = [subprocess.Popen(hog) for _ in range(os.cpu_count() or 2)]
        outcomes: list[drive.Outcome] = []
        slowest = 0.0
        for w in range(WAVES):
            t0 = time.monotonic()
            wave = drive.run(stack.router.url, stack.prefill.url, drive.make_prompts(WAVE_SIZE, seed=100 + w),
                             prefix=f"soak-{w}", max_tokens=MAX_TOKENS, concurrency=WAVE_SIZE,
                             timeout_s=REQUEST_DEADLINE_S)
            took = time.monotonic() - t0
            slowest = max(slowest, took)
            outcomes += wave
            print(f"wave {w}: {sum(o.ok for o in wave)}/{len(wave)} ok in {took:.1f} s", flush=True)
        p = report.samples(stack.prefill.metrics())
        d = report.samples(stack.decode.metrics())
        counted = {
            "P expired leases": report.total(p, VLLM_KV_EXPIRED_TOTAL),
            "P PUSH_REG after lease": report.total(p, "vllm:nixl_push_reg_rejected_total",
                                                    reason="after_lease_expired"),
            "P pushes failed": report.total(p, "vllm:nixl_pushes_total", outcome="failed"),
            "D receives failed": report.total(d, "vllm:nixl_push_receive_duration_seconds_count",
                                              outcome="failure"),
            "D receives expired": report.total(d, "vllm:nixl_push_receive_duration_seconds_count",
                                               outcome="expired"),
            "D receives ok": report.total(d, "vllm:nixl_push_receive_duration_seconds_count",
                                          outcome="success"),
        }
        print(f"{len(outcomes)} requests, {sum(o.ok for o in outcomes)} ok, slowest wave {slowest:.1f} s; "
              f"counted: {counted}", flush=True)
        hung = [o.request_id for o in outcomes if "timed out" in o.error]
        assert not hung, f"requests with no answer within {REQUEST_DEADLINE_S:.0f}s: {hung}"
        wrong = [o.request_id for o in outcomes if not o.error and o.tokens != o.reference]
        assert not wrong, f"outputs differ from the single-engine reference: {wrong}"
        failed = [o for o in outcomes if o.error]
        assert len(failed) <= counted["D receives failed"] + counted["D receives expired"], failed
        # Every request's KV either came over NIXL or its failure is counted on D.
        assert counted["D receives ok"] + counted["D receives failed"] + counted["D receives expired"] \
            >= len(outcomes)
    finally:
        for hog in hogs:
            hog.kill()
        stack.close()

"""A defect in a step of the push's data path ends its request by the failure path,
counted and logged, never as a lost metric with the request stuck.

Real engines (the harness: real NIXL/UCX and ZMQ); each case arms one step of the
connector to raise once (`cmd_inject_fault`, as a bug there would), pushes a request
through it, and checks: the request ended (landed, or failed and reported to vLLM) within
its bounds, the step is counted in `internal_errors{step}`, and no telemetry error was
counted for it (the data path no longer hides inside telemetry guards). These are the
steps that used to sit inside telemetry guards: the push's failure accounting, the
PUSH_REG's bookkeeping, the step's results, and the notifications the writer reads.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Any

import pytest

from connector.vocabulary import InternalStep, ReceiveAbandon, StatKey
from harness import PushHarness
from harness.poll import wait_until

pytestmark = [pytest.mark.real, pytest.mark.timeout(600)]

# Short lease arithmetic: a given-up receive fails 6 + 2 + 2 x 0.5 = 9 s after its last ask.
EXTRA = {"kv_lease_duration": 6, "push_write_timeout_s": 2, "push_lease_margin_s": 0.5}


class Counts:
    """An engine's stats records, collected as they come."""

    def __init__(self, h: PushHarness, engine: str):
        self.h, self.engine, self.records = h, engine, []

    def of(self, key: str) -> Counter:
        self.records += self.h.stats(self.engine)
        return Counter(v for r in self.records for v in r.get(key, []))

    def wait(self, key: str, want: dict[str, int]) -> None:
        wait_until(lambda: all(self.of(key)[k] >= n for k, n in want.items()),
                   f"{self.engine}'s {key} to reach {want}", last=lambda: self.of(key))


@pytest.fixture(scope="module")
def harness(tmp_path_factory: pytest.TempPathFactory) -> Any:
    h = PushHarness.pd(workdir=str(tmp_path_factory.mktemp("faults")), num_blocks=64, extra_config=EXTRA)
    h.specs["P"] = dataclasses.replace(h.specs["P"], faults_seed=1)  # (to refuse WRITEs on demand)
    h.start()
    try:
        assert h.push(1).ok  # both directions connected
        yield h
    finally:
        h.stop()


def _injected(h: PushHarness, engine: str, target: str) -> None:
    h[engine].call("inject_fault", target)


def _raised(h: PushHarness, engine: str, target: str) -> int:
    return h[engine].call("faults_raised")[target]


def test_the_push_reg_bookkeeping_raising_still_ends_the_request(harness) -> None:
    """D's note of where its PUSH_REG went raises: the receive is given up (it fails at
    its safe point unless the KV lands first, which it does: the PUSH_REG reached P)."""
    h, d = harness, Counts(harness, "D")
    target = "connector.state.receives.ReceiveLedger.sent"
    _injected(h, "D", target)
    report = h.push(1)
    assert _raised(h, "D", target) == 1
    assert report.ok, (report.failed, report.mismatched)
    d.wait(StatKey.INTERNAL_ERRORS, {InternalStep.REGISTRATION.value: 1})
    assert d.of(StatKey.RECEIVES_ABANDONED) == Counter({ReceiveAbandon.INTERNAL_ERROR.value: 1})
    assert d.of(StatKey.TELEMETRY_ERRORS) == Counter()


@pytest.mark.parametrize("target", ["connector.glue.peers.PeerFlow._suspect_write_target",
                                    "connector.state.leases.LeaseLedger.fail"],
                         ids=["suspect", "lease_fail"])
def test_the_push_failure_accounting_raising_still_fails_the_push(harness, target: str) -> None:
    """NIXL refuses P's WRITE; a step of ending the failed push raises: the push still
    fails and its decoder is told at once (PUSH_FAIL), not after a lease."""
    h, p, d = harness, Counts(harness, "P"), Counts(harness, "D")
    _injected(h, "P", target)
    h["P"].call("refuse_writes", 1)
    report = h.push(1, timeout_s=30)
    assert _raised(h, "P", target) == 1
    assert report.failed == report.requests, report
    p.wait(StatKey.INTERNAL_ERRORS, {InternalStep.PUSH_FAILURE.value: 1})
    assert p.of(StatKey.TELEMETRY_ERRORS) == Counter() and d.of(StatKey.TELEMETRY_ERRORS) == Counter()
    assert h.push(1).ok  # and the next request is unaffected


def test_the_results_bookkeeping_raising_still_reports_the_request(harness) -> None:
    """D's receive ledger raises when vLLM reports the receive over: vLLM still gets the
    result (the request completes), and the step is counted."""
    h, d = harness, Counts(harness, "D")
    target = "connector.state.receives.ReceiveLedger.over"
    _injected(h, "D", target)
    report = h.push(1)
    assert _raised(h, "D", target) == 1
    assert report.ok, (report.failed, report.mismatched)
    d.wait(StatKey.INTERNAL_ERRORS, {InternalStep.STEP.value: 1})
    assert d.of(StatKey.TELEMETRY_ERRORS) == Counter()


def test_a_notification_handler_raising_costs_that_notification_only(harness) -> None:
    """NIXL refuses P's WRITE; D's handling of P's PUSH_FAIL raises: the router gives the
    receive up (it fails at its safe point), counts it, and reads on."""
    h, d = harness, Counts(harness, "D")
    target = "connector.state.receives.ReceiveLedger.agent_failed"
    _injected(h, "D", target)
    h["P"].call("refuse_writes", 1)
    report = h.push(1, timeout_s=60)
    assert _raised(h, "D", target) == 1
    assert report.failed == report.requests, report
    d.wait(StatKey.INTERNAL_ERRORS, {InternalStep.NOTIFICATION.value: 1})
    assert d.of(StatKey.RECEIVES_ABANDONED)[ReceiveAbandon.INTERNAL_ERROR.value] == 1
    assert d.of(StatKey.TELEMETRY_ERRORS) == Counter()
    assert h.push(1).ok

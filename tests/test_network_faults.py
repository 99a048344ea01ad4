"""Network and host faults between P and D on separate hosts, on real `vllm serve`.

P, D and the router with Prometheus each run on a host of their own (network
namespaces on a bridge, demo/network.py). A partition cuts only the path between P and
D (the router still reaches both), silently, as a failed switch or route does; a host
that dies has every process on it killed. Each test says what a user sees and how long
the request caught by the fault is held.

Opt-in (`make faults`, or FAULTS=1): needs root for the namespaces, and starts its own
deployment. CI runs the P restart case in tests/test_e2e_serve.py.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from typing import Any

import pytest

from connector.vocabulary import (
    HANDSHAKE_PHASE_FAILURES,
    HANDSHAKE_RETRIES,
    HANDSHAKES,
    KV_LEASE_EXPIRIES,
    KV_LEASE_RENEWALS,
    KV_LEASES_HELD,
    PEER_RESETS,
    PUSH_REG_REJECTED,
    RECEIVE_FAILURES,
)
from connector.vocabulary import VLLM_EXTERNAL_PROMPT_TOKENS as EXTERNAL
from connector.vocabulary import VLLM_KV_EXPIRED_TOTAL as EXPIRED
from demo import drive, report
from demo.network import unavailable_reason
from demo.stack import EngineOptions, Stack
from harness.poll import wait_until

pytestmark = [
    pytest.mark.real, pytest.mark.serve, pytest.mark.prometheus, pytest.mark.timeout(1200),
    pytest.mark.skipif(os.environ.get("FAULTS") != "1", reason="opt-in: make faults (FAULTS=1)"),
    pytest.mark.skipif(unavailable_reason() is not None, reason=str(unavailable_reason())),
]

MAX_TOKENS = 6
LEASE_S = 9
# D gives a handshake this long per attempt, and retries within the budget.
TIMEOUT_MS, BUDGET_S = 2000, 20
# D serves one sequence at a time: these local requests keep it busy about 30 s.
BUSY_REQUESTS, BUSY_TOKENS, BUSY_S = 3, 3000, 40


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Any:
    kv = {"kv_connector_extra_config": {"kv_lease_duration": LEASE_S, "handshake_timeout_ms": TIMEOUT_MS,
                                        "handshake_retry_budget_s": BUDGET_S}}
    s = Stack(tmp_path_factory.mktemp("faults"), hosts=True, prefill=EngineOptions(kv=kv),
              decode=EngineOptions(kv={**kv, "kv_load_failure_policy": "recompute"},
                                   args=("--max-num-seqs", "1"), max_model_len=4096))
    s.start()
    yield s
    s.close()
    assert s.leftovers() == []


def report_held(what: str, seconds: float) -> None:
    """One line per fault for `make faults` (run with -s): how long it held a request."""
    print(f"\n[faults] {what} {seconds:.1f} s", flush=True)


def count(server: Any, name: str, **labels: str) -> float:
    return report.total(report.samples(server.metrics()), name, **labels)


def total(spec: Any) -> str:
    return spec.name + "_total"


def test_partition_during_the_first_handshake_is_ridden_out_by_its_retries(stack: Stack) -> None:
    """The path between P and D is cut when the first request arrives: D's D->P
    handshake fails (timeout or unreachable), is retried with backoff, and succeeds once
    the path is back; the request completes with its KV over NIXL."""
    net = stack.network
    prompt = drive.make_prompts(1, seed=71)[0]
    net.partition("prefill", "decode")
    try:
        request = drive.InBackground(stack.router.url, prompt, "faults-first", MAX_TOKENS)
        wait_until(lambda: count(stack.decode, total(HANDSHAKE_PHASE_FAILURES), phase="metadata_fetch") >= 1,
                   "D's first handshake attempt to fail", BUDGET_S, 0.25)
    finally:
        net.partition("prefill", "decode", cut=False)
    out = request.join()
    report_held("partition during the first handshake: request took", request.seconds)
    assert not out.error, out.error
    assert out.tokens == drive.reference(stack.prefill.url, prompt, MAX_TOKENS, salt="ref-faults-first")
    assert request.seconds < BUDGET_S + TIMEOUT_MS / 1000, request.seconds
    d = report.samples(stack.decode.metrics())
    hs = total(HANDSHAKES)
    assert report.total(d, hs, direction="d_to_p", outcome="failure") >= 1
    assert report.total(d, hs, direction="d_to_p", outcome="success", notif_agents_only="true") == 1
    assert report.total(d, total(HANDSHAKE_RETRIES), direction="d_to_p") >= 1
    assert report.total(d, EXTERNAL[0], **EXTERNAL[1]) == len(prompt)  # KV came over NIXL


def test_partition_while_a_request_waits_releases_it_when_the_path_is_back(stack: Stack) -> None:
    """The path is cut after P prefilled a request and before D's PUSH_REG reaches it.
    Nothing errors on either side (NIXL queues what D sends). P's lease expires on
    schedule, unclaimed; when the path is back, P reads the late PUSH_REG (also idle),
    refuses it and tells D, which recomputes the prefill at once."""
    net = stack.network
    prompt = drive.make_prompts(1, seed=72)[0]
    p = report.samples(stack.prefill.metrics())
    unclaimed = report.total(p, total(KV_LEASE_EXPIRIES), fate="unclaimed")
    rejected = report.total(p, total(PUSH_REG_REJECTED), reason="after_lease_expired")
    net.partition("prefill", "decode")
    try:
        request = drive.InBackground(stack.router.url, prompt, "faults-wait", MAX_TOKENS)
        wait_until(lambda: count(stack.prefill, total(KV_LEASE_EXPIRIES), fate="unclaimed") > unclaimed,
                   "P's lease for the request to expire", 3 * LEASE_S, 0.5)
        healed_at = time.monotonic()
    finally:
        net.partition("prefill", "decode", cut=False)
    out = request.join()
    held_after_heal = time.monotonic() - healed_at
    report_held(f"partition while waiting: request took {request.seconds:.1f} s, released after the heal in",
                held_after_heal)
    assert not out.error, out.error
    assert out.tokens == drive.reference(stack.prefill.url, prompt, MAX_TOKENS, salt="ref-faults-wait")
    assert held_after_heal < LEASE_S, held_after_heal  # released by PUSH_FAIL, not a watchdog
    assert count(stack.prefill, total(PUSH_REG_REJECTED), reason="after_lease_expired") == rejected + 1
    assert count(stack.decode, total(RECEIVE_FAILURES), reason="lease_expired") >= 1


@contextlib.contextmanager
def queued_on_d(stack: Stack, prompt: list[int], request_id: str) -> Iterator[drive.InBackground]:
    """A request waiting in D's queue behind local requests (heartbeating P), its KV held
    on P, for the block; leaving it cuts the local requests short. (D answers `/metrics`
    slowly while it generates flat out on its one core, so P's metrics are watched.)"""
    renewed = count(stack.prefill, total(KV_LEASE_RENEWALS), outcome="renewed")
    with contextlib.ExitStack() as busy:
        for seed in range(BUSY_REQUESTS):
            busy.enter_context(drive.Busy(stack.decode.url, BUSY_TOKENS, seed=seed, wait=seed == 0))
        request = drive.InBackground(stack.router.url, prompt, request_id, MAX_TOKENS)
        wait_until(lambda: count(stack.prefill, KV_LEASES_HELD.name) >= 1
                   and count(stack.prefill, total(KV_LEASE_RENEWALS), outcome="renewed") > renewed,
                   "P to hold the request's KV while D heartbeats it from its queue", 60, 0.25)
        yield request


def test_prefill_host_dies_while_a_request_waits_on_it(stack: Stack) -> None:
    """P's host dies while P holds the KV of a request queued on D. D's next heartbeat
    fails, D drops the connection; when the request is scheduled its PUSH_REG finds no P
    and D recomputes the prefill after the handshake's retry budget at most. Once P's
    host is back (same engine id and address), new requests get their KV over NIXL."""
    prompt = drive.make_prompts(1, seed=73)[0]
    resets = count(stack.decode, total(PEER_RESETS))
    with queued_on_d(stack, prompt, "faults-p-dies") as request:
        stack.network["prefill"].kill_all()
        died_at = time.monotonic()
        wait_until(lambda: count(stack.decode, total(PEER_RESETS)) > resets,
                   "D to drop its connection to the dead P", 60, 0.25)
    out = request.join()
    held = time.monotonic() - died_at
    report_held("P's host died: the waiting request answered (recomputed) after", held)
    assert not out.error, out.error
    assert out.tokens == drive.reference(stack.decode.url, prompt, MAX_TOKENS, salt="ref-faults-p-dies")
    assert held < BUSY_S + BUDGET_S + TIMEOUT_MS / 1000, held  # D finishes its local requests first
    assert count(stack.decode, total(RECEIVE_FAILURES)) >= 1
    new_p = stack.restart_prefill()
    external = count(stack.decode, EXTERNAL[0], **EXTERNAL[1])
    after = drive.run(stack.router.url, new_p.url, drive.make_prompts(2, seed=74), prefix="faults-after",
                      max_tokens=MAX_TOKENS)
    assert all(o.ok for o in after), [o.error for o in after]
    assert count(stack.decode, EXTERNAL[0], **EXTERNAL[1]) - external == sum(len(o.prompt) for o in after)


def test_decode_host_dies_while_prefill_holds_its_lease(stack: Stack) -> None:
    """D's host dies while a request waits in its queue, its KV held (and heartbeated) on
    P: the heartbeats stop, and P's lease expires on schedule and is counted (vLLM's own
    expiry count agrees)."""
    prompt = drive.make_prompts(1, seed=75)[0]
    p = report.samples(stack.prefill.metrics())
    waiting, expired = report.total(p, total(KV_LEASE_EXPIRIES), fate="waiting"), report.total(p, EXPIRED)
    with queued_on_d(stack, prompt, "faults-d-dies") as request:
        stack.network["decode"].kill_all()
        died_at = time.monotonic()
        wait_until(lambda: count(stack.prefill, KV_LEASES_HELD.name) == 0, "P to release the lease",
                   3 * LEASE_S, 0.25)
        released_after = time.monotonic() - died_at
    report_held("D's host died: P released the lease after", released_after)
    assert request.join().error  # the client learns its request failed (the router's D leg broke)
    assert released_after <= LEASE_S + 2, released_after
    p = report.samples(stack.prefill.metrics())
    assert report.total(p, total(KV_LEASE_EXPIRIES), fate="waiting") == waiting + 1
    assert report.total(p, EXPIRED) == expired + 1

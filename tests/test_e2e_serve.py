"""End to end on real `vllm serve`: what the fork is for, pinned on real engines.

One fork deployment (the demo's `Stack`: router, P and D, OTLP receiver, Prometheus) is
shared by the fork tests; where this machine can make network namespaces (root), P, D
and the router with Prometheus each run on a host of their own, and the last fork
test restarts P's host. Then one stock deployment of the same shape is the control.
Both run with a short KV lease (9 s: heartbeats every second, each extending a lease
by 6 s, slack for a loaded prefill that steps seconds apart) and D serving one sequence
at a time, so a request queued behind D's work waits longer than a lease. D's work is a
streamed local request that the test cuts short once what it waits for has happened.

Requests carry a traceparent the test made, so the test knows each request's trace.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import re
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from connector.vocabulary import (
    DESCRIPTORS_REGISTERED,
    DESCRIPTORS_SAVED,
    HANDSHAKES,
    HEARTBEATS,
    KV_DIGEST_DURATION,
    KV_LEASE_EXPIRIES,
    KV_LEASE_RENEWALS,
    KV_LEASES_HELD,
    KV_VERIFY,
    KV_WAIT,
    PEER_RESETS,
    PUSH_FAIL_NOTIFS,
    PUSH_REG_NOTIFS,
    PUSH_REG_REJECTED,
    PUSH_WRITE_DURATION,
    PUSH_WRITE_WAIT,
    PUSHES,
    RECEIVE_FAILURES,
    SPAN_HANDSHAKE,
    SPAN_PUSH_RECEIVE,
    SPAN_PUSH_WRITE,
    SPAN_ROUTER_REQUEST,
    VLLM_REQUEST_SPAN,
    VLLM_TTFT,
    Attr,
    Phase,
    RouterAttr,
    SpanEvent,
    phase_span_name,
)
from connector.vocabulary import VLLM_EXTERNAL_PROMPT_TOKENS as EXTERNAL
from connector.vocabulary import VLLM_KV_EXPIRED_TOTAL as EXPIRED
from dashboards import panels, promrun
from demo import drive, report
from demo.engines import (
    NIXL_WORKER_LOGGER,
    PROGRESS_DELAY_US,
    SERVED_MODEL,
    nixl_debug_logging,
    session_pids,
)
from demo.network import unavailable_reason
from demo.stack import JOB, NIXL_JOB, EngineOptions, Stack
from harness.outsider import Outsider
from harness.poll import wait_until

pytestmark = [pytest.mark.real, pytest.mark.prometheus, pytest.mark.serve, pytest.mark.timeout(1200)]

MAX_TOKENS = 6
LEASE_S = 9
SPAN_WAIT_S = 60.0
HOSTS = unavailable_reason() is None
FINISHED = "vllm:request_success_total"  # vLLM's own count of finished requests
# What a fixture learns beside the value it returns (read by the tests that use that fixture).
FACTS: dict[str, Any] = {}


def options(connector: str, workdir: Path) -> dict[str, Any]:
    """Both deployments: a short lease on both engines; D one sequence at a time, long
    enough a context for the requests that keep it busy, and recomputing a prefill
    whose KV will not come. The stock D logs what its full handshake prepares."""
    lease = {"kv_connector_extra_config": {"kv_lease_duration": LEASE_S}}
    d_kv = {**lease, "kv_load_failure_policy": "recompute"}
    return {"connector": connector,
            "prefill": EngineOptions(kv=lease),
            "decode": EngineOptions(kv=d_kv, args=("--max-num-seqs", "1"), max_model_len=4096,
                                    env=nixl_debug_logging(workdir) if connector == "stock" else {})}


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Any:
    if not HOSTS:  # said in the test report, not silently
        warnings.warn(f"the e2e tests run P, D and the router on loopback, not on hosts of their "
                      f"own: {unavailable_reason()}", stacklevel=1)
    work = tmp_path_factory.mktemp("e2e")
    s = Stack(work, hosts=HOSTS, **options("fork", work))
    s.start()
    yield s
    s.close()


def metric(server: Any) -> list[report.Sample]:
    return report.samples(server.metrics())


def count(server: Any, name: str, **labels: str) -> float:
    return report.total(metric(server), name, **labels)


def external_tokens(stack: Stack) -> float:
    return count(stack.decode, EXTERNAL[0], **EXTERNAL[1])


def receive_endings(stack: Stack) -> dict[str, float]:
    """D's receive failures by reason and KV check verdicts: what an assertion on external
    tokens reports when it fails (why D recomputed instead of loading)."""
    data = metric(stack.decode)
    names = {RECEIVE_FAILURES.name + "_total": "reason", KV_VERIFY.name + "_total": "outcome"}
    return {f"{name}{{{lab.get(names[name])},{lab.get('reason', '')}}}": v
            for name, lab, v in data if name in names and v}


def renewals(server: Any) -> float:
    return count(server, KV_LEASE_RENEWALS.name + "_total", outcome="renewed")


@contextlib.contextmanager
def busy(server: Any, requests: int = 1) -> Iterator[None]:
    """`server` runs long local requests for the block, the first already running when
    it starts (with --max-num-seqs 1, every request that arrives meanwhile waits in its
    queue); leaving the block cuts them short."""
    with contextlib.ExitStack() as local:
        local.enter_context(drive.Busy(server.url))
        for seed in range(1, requests):
            local.enter_context(drive.Busy(server.url, seed=5 + seed, wait=False))
        yield


def d_to_p(stack: Stack) -> list[dict[str, Any]]:
    return [s for s in stack.spans() if s["name"] == SPAN_HANDSHAKE and s["service"] == "vllm-decode"]


# --------------------------------------------------------------------- headline
@pytest.fixture(scope="module")
def first_request(stack: Stack) -> dict[str, Any]:
    """The fork's first request, sent while D is busy: it waits in D's queue and D's
    heartbeat for it starts D's first handshake to P. Its prompt and outcome, D's metrics
    after it, and the descriptors that handshake saved (what the stock control compares
    with)."""
    prompt = drive.make_prompts(1, seed=21)[0]
    with busy(stack.decode):
        request = drive.InBackground(stack.router.url, prompt, "e2e-first", MAX_TOKENS)
        wait_until(lambda: count(stack.decode, HEARTBEATS.name + "_total", outcome="sent") >= 1,
                   "D to heartbeat P for the queued request", 60, 0.5)
    first = request.join()
    d = metric(stack.decode)
    return {"prompt": prompt, "outcome": first, "metrics": d,
            "saved": report.total(d, DESCRIPTORS_SAVED.name + "_total", direction="d_to_p")}


def test_first_d_to_p_handshake_is_heartbeat_triggered_and_notification_only(
        stack: Stack, first_request: dict[str, Any]) -> None:
    """D is busy when the first request arrives: the request waits in D's queue, D's
    scheduler heartbeats P for it, and that heartbeat starts D's first handshake to P
    (upstream makes it a full one). Ours is notification-only, phase by phase."""
    first = first_request["outcome"]
    assert not first.error, first.error
    assert first.tokens == drive.reference(stack.prefill.url, first_request["prompt"], MAX_TOKENS,
                                           salt="ref-e2e-first")
    d, saved = first_request["metrics"], first_request["saved"]
    hs = HANDSHAKES.name + "_total"
    assert report.total(d, hs, direction="d_to_p") == 1
    assert report.total(d, hs, direction="d_to_p", trigger="heartbeat", notif_agents_only="true",
                        outcome="success") == 1
    assert saved > 0
    [span] = wait_until(lambda: d_to_p(stack), "D's handshake span", SPAN_WAIT_S)
    assert span["attributes"][Attr.TRIGGER] == "heartbeat"
    assert span["attributes"][Attr.NOTIF_AGENTS_ONLY] is True
    assert span["attributes"][Attr.DESCRIPTORS_SAVED] == saved
    phases = [s for s in stack.spans() if s["parent_span_id"] == span["span_id"]]
    wanted = {phase_span_name(p) for p in (Phase.METADATA_FETCH, Phase.AGENT_LOAD)}
    assert {s["name"] for s in phases} >= wanted
    assert all(s["attributes"][Attr.NOTIF_AGENTS_ONLY] is True for s in phases)
    assert "Transfer plan" not in stack.decode.log()  # vLLM logs it on its full path only


# ------------------------------------------------------------------ the push flow
@pytest.fixture(scope="module")
def outcomes(stack: Stack) -> list[drive.Outcome]:
    """Four requests one by one, each with its single-engine reference."""
    before = external_tokens(stack)
    out = drive.run(stack.router.url, stack.prefill.url, drive.make_prompts(4), prefix="e2e-seq",
                    max_tokens=MAX_TOKENS)
    FACTS["seq_external_tokens"] = external_tokens(stack) - before
    return out


def test_disaggregated_outputs_equal_the_single_engine_reference(outcomes: list[drive.Outcome]) -> None:
    for o in outcomes:
        assert not o.error, (o.request_id, o.error)
        assert len(o.tokens) == MAX_TOKENS
        assert o.tokens == o.reference, o.request_id
    # random weights: different prompts give different tokens, so equality is not an accident
    assert len({tuple(o.tokens) for o in outcomes}) > 1


def test_kv_came_over_nixl_and_every_d_to_p_handshake_stayed_notification_only(
        stack: Stack, outcomes: list[drive.Outcome]) -> None:
    d, p = metric(stack.decode), metric(stack.prefill)
    assert FACTS["seq_external_tokens"] == sum(len(o.prompt) for o in outcomes)
    hs = HANDSHAKES.name + "_total"
    assert report.total(d, hs, direction="d_to_p", notif_agents_only="false") == 0
    n = len(outcomes) + 1  # and the headline request
    assert report.total(d, PUSH_REG_NOTIFS.name + "_total", outcome="sent") == n
    assert report.total(p, PUSHES.name + "_total", outcome="completed") == n
    assert report.total(p, PUSHES.name + "_total", outcome="failed") == 0
    assert report.total(p, DESCRIPTORS_REGISTERED.name + "_total", direction="p_to_d", list="remote") > 0
    assert "Transfer plan" in stack.prefill.log()  # P's P->D handshake is full: it writes into D
    # KV integrity (kv_verify_ratio 1 by default): D checked every request's KV against the
    # digest P computed before its WRITE, and it matched; each side digested once per push.
    verify = KV_VERIFY.name + "_total"
    assert report.total(d, verify, outcome="match") == n
    assert report.total(d, verify, outcome="mismatch") == report.total(d, verify, outcome="skipped") == 0
    assert report.total(p, KV_DIGEST_DURATION.name + "_count") == n
    assert report.total(d, KV_DIGEST_DURATION.name + "_count") == n


def test_nixls_own_exporter_counts_exactly_the_bytes_and_writes_the_engines_report(
        stack: Stack, outcomes: list[drive.Outcome]) -> None:
    """NIXL's exporter in each engine (prometheus_mp, demo/engines.py) is an independent witness:
    once the last WRITE's stats reached /metrics, P's bytes and WRITEs as vLLM reports them equal
    NIXL's agent_tx_bytes_total and agent_tx_requests_num_total for P's agents, joined by the
    engine's vllm:nixl_push_agent_info (D: both 0, its agent joined). One WRITE off, they differ."""
    assert outcomes
    p = report.wait_witness(stack.prefill, timeout_s=60)
    d = report.wait_witness(stack.decode, timeout_s=60)
    assert p.agrees(), p.line("P")
    assert d.agrees(), d.line("D")
    assert len(p.agents) == len(d.agents) == 1
    assert p.engine_writes >= len(outcomes) + 1 and p.engine_bytes > 0 and p.last_write_bytes > 0
    assert d.nixl_bytes == d.engine_bytes == 0  # (D writes nothing: one-sided WRITEs from P)
    assert not dataclasses.replace(p, engine_bytes=p.engine_bytes - p.last_write_bytes).agrees()
    assert not dataclasses.replace(p, engine_writes=p.engine_writes + 1).agrees()
    assert not dataclasses.replace(p, agents=()).agrees()  # (nothing joined: no witness)
    # The dashboard's NIXL row, as Grafana asks the stack's Prometheus (which scrapes NIXL's
    # exporters as job "nixl"): every query answers, and the witness stat reads 0.
    prom = stack.prometheus
    assert prom is not None
    read_at = time.time()
    wait_until(lambda: (prom.value(f'min(timestamp(up{{job=~"{JOB}|{NIXL_JOB}"}}))') or 0) > read_at,
               "a scrape of both engines and their NIXL exporters after the counts agreed", 60, 0.25)
    row = panels.row_titles(panels.NIXL_AGENTS_ROW)
    answers = [q for q in promrun.evaluate_dashboard(
        prom, panels.build_dashboard(), {"job": JOB, "model_name": SERVED_MODEL, "instance": ".*",
                                         "engine": ".*", "__rate_interval": "10m", "__range": "1h",
                                         "__interval": "15s"}) if q.panel in row]
    assert {q.panel for q in answers} == row
    for q in answers:
        assert q.ok and q.series, f"{q.panel} {q.ref_id} returned no data: {q.expr}"
    difference = next(q for q in answers if q.panel == "Engine bytes minus NIXL's (range)")
    assert [v for _, v in difference.values()] == [0.0]


@pytest.mark.skipif(not HOSTS, reason="needs network namespaces: the outsider runs on a host of its own")
def test_without_the_secret_an_outsider_gets_the_metadata_as_vllm_does_today(stack: Stack) -> None:
    """The trust boundary as vLLM ships it: anything that reaches P's side channel, here a
    process on the router's host, gets the metadata that reads P's KV (with
    side_channel_secret_file it does not: tests/test_trust_serve.py)."""
    assert stack.network is not None and stack.prefill is not None
    log = stack.workdir / "outsider.log"
    with Outsider(stack.network["obs"], stack.prefill.side_channel, log) as outsider:
        assert outsider.result["fetch"].startswith("got "), outsider.result


def test_streamed_completion_through_the_router_equals_the_reference(stack: Stack) -> None:
    prompt = drive.make_prompts(1, seed=99)[0]
    tokens = drive.streamed(stack.router.url, prompt, "e2e-stream", MAX_TOKENS)
    assert tokens == drive.reference(stack.prefill.url, prompt, MAX_TOKENS, salt="reference-e2e-stream")


# ------------------------------------------------------------------ KV leases
def test_requests_queued_longer_than_the_lease_keep_their_kv(stack: Stack) -> None:
    """A burst arrives while D is busy for longer than P's lease: D's heartbeats renew
    the leases (upstream they renew nothing), no lease expires, every request's KV
    arrives over NIXL and the outputs equal the reference."""
    prompts = drive.make_prompts(3, seed=31, lengths=(100,))
    expired, external = count(stack.prefill, EXPIRED), external_tokens(stack)
    pushed, failed = (count(stack.prefill, PUSHES.name + "_total", outcome=o)
                      for o in ("completed", "failed"))
    # (Four local requests: more than the test waits for; leaving the block cuts them short.)
    with drive.KeepStepping(stack.prefill.url), busy(stack.decode, requests=4):
        burst = [drive.InBackground(stack.router.url, prompt, f"e2e-burst-{i:03d}", MAX_TOKENS)
                 for i, prompt in enumerate(prompts)]
        # (P's /metrics is polled once a second: rendering it costs a loaded prefill.)
        wait_until(lambda: count(stack.prefill, KV_LEASES_HELD.name) >= len(prompts),
                   "P to hold the KV of every request of the burst", 120, 1.0)
        # One renewal per queued request and heartbeat (every second): this many more,
        # and each request has waited longer than its first lease.
        held = renewals(stack.prefill)
        wait_until(lambda: renewals(stack.prefill) - held >= len(prompts) * (LEASE_S + 2),
                   "D's heartbeats to keep the queued requests' leases for longer than a lease", 120, 1.0)
    results = [(b.join(), b.seconds) for b in burst]
    # Pushed, not recomputed (a recompute gives the same tokens): P's counts first.
    p = metric(stack.prefill)
    assert report.total(p, PUSHES.name + "_total", outcome="completed") == pushed + len(prompts)
    assert report.total(p, PUSHES.name + "_total", outcome="failed") == failed
    latencies = [t for _, t in results]
    assert min(latencies) > LEASE_S, latencies  # (the scenario: each waited longer than a lease)
    for (o, _), prompt in zip(results, prompts, strict=True):
        assert not o.error, o.error
        assert o.tokens == drive.reference(stack.prefill.url, prompt, MAX_TOKENS, salt=f"ref-{o.request_id}")
    p = metric(stack.prefill)
    expiries = [line for line in stack.prefill.log().splitlines() if "expired before its push" in line]
    assert report.total(p, EXPIRED) == expired, expiries  # vLLM's own count: nothing released
    assert report.total(p, KV_LEASE_EXPIRIES.name + "_total") == 0
    assert report.total(p, KV_LEASE_RENEWALS.name + "_total", outcome="renewed") >= len(prompts)
    assert count(stack.decode, HEARTBEATS.name + "_total", outcome="sent") > 0
    assert external_tokens(stack) - external == sum(len(x) for x in prompts)
    trace_ids = {o.trace_id for o, _ in results}

    def writes() -> list[dict[str, Any]] | None:
        found = [s for s in stack.spans() if s["name"] == SPAN_PUSH_WRITE and s["trace_id"] in trace_ids]
        return found if {s["trace_id"] for s in found} == trace_ids else None

    spans = wait_until(writes, "the burst's write spans", SPAN_WAIT_S, 0.25)
    assert all(SpanEvent.LEASE_RENEWED in s["events"] for s in spans)


def test_a_decode_leg_after_the_lease_fails_fast_and_is_recomputed(stack: Stack) -> None:
    """The D leg reaches D only after P released the KV (a late or retried D leg): P
    answers its PUSH_REG with PUSH_FAIL, D fails the load at once and vLLM recomputes the
    prefill on D (kv_load_failure_policy=recompute) instead of waiting 480 s."""
    prompt = drive.make_prompts(1, seed=41)[0]
    p = metric(stack.prefill)
    expired = report.total(p, EXPIRED)
    rejected = report.total(p, PUSH_REG_REJECTED.name + "_total", reason="after_lease_expired")
    failed = count(stack.decode, RECEIVE_FAILURES.name + "_total", reason="lease_expired")
    with drive.KeepStepping(stack.prefill.url):
        drive.prefill_leg(stack.prefill.url, prompt, "e2e-late")
        # This request's release (P's log names it), not any other lease's.
        wait_until(lambda: any("e2e-late" in line and "released before its push" in line
                               for line in stack.prefill.log().splitlines()),
                   "P to release this request's lease", 4 * LEASE_S, 0.5)
        started = time.monotonic()
        tokens = drive.decode_leg(stack.decode.url, stack.prefill.target(), prompt, "e2e-late", MAX_TOKENS)
    waited = time.monotonic() - started
    assert tokens == drive.reference(stack.prefill.url, prompt, MAX_TOKENS, salt="ref-e2e-late")
    assert waited < 60, waited  # upstream: push_registration_timeout, 480 s
    p = metric(stack.prefill)
    assert report.total(p, EXPIRED) > expired
    assert report.total(p, PUSH_REG_REJECTED.name + "_total", reason="after_lease_expired") == rejected + 1
    assert report.total(p, KV_LEASE_EXPIRIES.name + "_total", fate="unclaimed") >= 1
    assert count(stack.decode, RECEIVE_FAILURES.name + "_total", reason="lease_expired") == failed + 1


def test_a_cpu_burning_neighbour_on_ps_core_costs_no_queued_request_its_kv(stack: Stack) -> None:
    """A process burns P's core while a burst waits on D longer than P's lease: P steps
    seconds apart (a starved prefill), its writer applies D's heartbeats as they come and
    claims each lease when its PUSH_REG matches; every request's KV arrives over NIXL, no
    lease expires and no WRITE is refused (before, a starved P refused WRITEs on deadlines
    its main thread had not renewed yet)."""
    prompts = drive.make_prompts(3, seed=71, lengths=(100,))
    p = metric(stack.prefill)
    before = {k: report.total(p, name, **labels) for k, (name, labels) in {
        "expired": (EXPIRED, {}), "expiries": (KV_LEASE_EXPIRIES.name + "_total", {}),
        "completed": (PUSHES.name + "_total", {"outcome": "completed"}),
        "failed": (PUSHES.name + "_total", {"outcome": "failed"}),
        "push_fails": (PUSH_FAIL_NOTIFS.name + "_total", {})}.items()}
    external = external_tokens(stack)
    with drive.CpuHog(0), drive.KeepStepping(stack.prefill.url), busy(stack.decode, requests=4):
        burst = [drive.InBackground(stack.router.url, prompt, f"e2e-starved-{i:03d}", MAX_TOKENS)
                 for i, prompt in enumerate(prompts)]
        wait_until(lambda: count(stack.prefill, KV_LEASES_HELD.name) >= len(prompts),
                   "P to hold the KV of every request of the burst", 180, 1.0)
        held = renewals(stack.prefill)
        wait_until(lambda: renewals(stack.prefill) - held >= len(prompts) * (LEASE_S + 2),
                   "D's heartbeats to keep the queued requests' leases for longer than a lease", 180, 1.0)
    results = [b.join() for b in burst]
    p = metric(stack.prefill)
    assert report.total(p, PUSHES.name + "_total", outcome="completed") == before["completed"] + len(prompts)
    assert report.total(p, PUSHES.name + "_total", outcome="failed") == before["failed"]
    assert report.total(p, EXPIRED) == before["expired"]
    assert report.total(p, KV_LEASE_EXPIRIES.name + "_total") == before["expiries"]
    assert report.total(p, PUSH_FAIL_NOTIFS.name + "_total") == before["push_fails"]  # none refused
    assert external_tokens(stack) - external == sum(len(x) for x in prompts)  # all over NIXL
    for o, prompt in zip(results, prompts, strict=True):
        assert not o.error, o.error
        assert o.tokens == drive.reference(stack.prefill.url, prompt, MAX_TOKENS, salt=f"ref-{o.request_id}")


def test_requests_sharing_a_client_id_through_the_router_get_their_own_answers(stack: Stack) -> None:
    """Clients and gateways reuse X-Request-Id: the router gives each request its own
    transfer id, so nothing on P is ambiguous and each gets its own answer."""
    prompts = drive.make_prompts(3, seed=81)
    rejected = count(stack.prefill, PUSH_REG_REJECTED.name + "_total", reason="ambiguous_request_id")
    with busy(stack.decode):
        same = [drive.InBackground(stack.router.url, prompt, "e2e-same-id", MAX_TOKENS) for prompt in prompts]
        wait_until(lambda: count(stack.prefill, KV_LEASES_HELD.name) >= len(prompts),
                   "P to hold the KV of the three requests", 120, 1.0)
    for b, prompt in zip(same, prompts, strict=True):
        o = b.join()
        assert not o.error, o.error
        assert o.tokens == drive.reference(stack.prefill.url, prompt, MAX_TOKENS,
                                           salt=f"ref-same-{prompt[0]}")
    assert count(stack.prefill, PUSH_REG_REJECTED.name + "_total", reason="ambiguous_request_id") == rejected


def test_a_stock_style_router_reusing_an_id_gets_push_fail_never_crossed_kv(stack: Stack) -> None:
    """A router that passes the client's id on as the transfer id: two requests in flight
    share it. P holds both prefills under one id and refuses to guess whose KV a PUSH_REG
    asks for: each decoder gets PUSH_FAIL and recomputes; each answer is its own."""
    prompts = drive.make_prompts(2, seed=91)
    rejected = count(stack.prefill, PUSH_REG_REJECTED.name + "_total", reason="ambiguous_request_id")
    failed = count(stack.decode, RECEIVE_FAILURES.name + "_total", reason="ambiguous_request_id")
    with drive.KeepStepping(stack.prefill.url), busy(stack.decode):
        pairs = [drive.StockStylePair(stack.prefill.url, stack.decode.url, stack.prefill.target(), prompt,
                                      "e2e-reused", MAX_TOKENS) for prompt in prompts]
        wait_until(lambda: count(stack.prefill, KV_LEASES_HELD.name) >= len(prompts),
                   "P to hold both prefills under the one id", 120, 1.0)
    for pair, prompt in zip(pairs, prompts, strict=True):
        o = pair.join()
        assert not o.error, o.error
        assert o.tokens == drive.reference(stack.prefill.url, prompt, MAX_TOKENS,
                                           salt=f"ref-reused-{prompt[0]}")
    assert count(stack.prefill, PUSH_REG_REJECTED.name + "_total",
                 reason="ambiguous_request_id") == rejected + len(prompts)
    assert count(stack.decode, RECEIVE_FAILURES.name + "_total",
                 reason="ambiguous_request_id") == failed + len(prompts)


# ------------------------------------------------------------------ traces
def test_every_request_is_one_trace_across_router_p_and_d(stack: Stack,
                                                          outcomes: list[drive.Outcome]) -> None:
    missing: dict[str, set] = {}

    def complete() -> bool:
        spans = stack.spans()
        missing.clear()
        for o in outcomes:
            if gap := report.trace_missing(spans, o.trace_id, fork=True):
                missing[o.request_id] = gap
        return not missing

    wait_until(complete, "router, vLLM and connector spans of every request", SPAN_WAIT_S, 0.25,
               last=lambda: missing)
    spans = stack.spans()
    for o in outcomes:
        mine = [s for s in spans if s["trace_id"] == o.trace_id]
        by_name = {(s["service"], s["name"]): s for s in mine}
        router = by_name[("router", SPAN_ROUTER_REQUEST)]
        assert router["kind"] == "SERVER"
        assert router["parent_span_id"] not in {s["span_id"] for s in mine}  # child of the test's span
        # The client's id stays on the router's span; the engines know the request by the
        # transfer id the router gave it (one of its own: clients reuse theirs).
        assert router["attributes"][RouterAttr.REQUEST_ID] == o.request_id
        transfer_id = router["attributes"][RouterAttr.TRANSFER_ID]
        assert o.request_id not in transfer_id
        for service in ("vllm-prefill", "vllm-decode"):
            vllm_span = by_name[(service, VLLM_REQUEST_SPAN)]
            assert transfer_id in vllm_span["attributes"]["gen_ai.request.id"]
        assert by_name[("vllm-decode", SPAN_PUSH_RECEIVE)]["attributes"][Attr.KV_VERIFY] == "match"
        assert by_name[("vllm-prefill", SPAN_PUSH_WRITE)]


def test_each_requests_ttft_stages_add_up_to_the_clients_ttft(stack: Stack,
                                                             outcomes: list[drive.Outcome]) -> None:
    """Per request, from its trace: P's queue and prefill (vLLM on P), P's handoff (our write
    span: prefill done to WRITE done), D's work after the KV landed (vLLM's TTFT on D minus our
    wait for KV) and, not streamed, the rest of D's answer add up to the TTFT the router
    measured for the client, within the tolerances `report.split_problems` states; and P's
    two stages make D's wait for KV. Five clocks in three processes, none derived from another."""
    splits = report.wait_splits(stack.spans, outcomes, SPAN_WAIT_S)
    assert sorted(splits) == sorted(o.request_id for o in outcomes), "requests without a complete split"
    for request_id, sp in splits.items():
        assert min(sp.p_prefill, sp.p_handoff, sp.kv_wait, sp.d_rest) >= 0, (request_id, sp)
        assert sp.d_after_kv > 0, (request_id, sp)  # D's first token comes after its KV
        assert not report.split_problems(sp), (request_id, sp, report.split_problems(sp))


def test_where_ttft_goes_panels_equal_the_engines_metrics_in_prometheus(
        stack: Stack, outcomes: list[drive.Outcome]) -> None:
    """The row's exact panels, as Grafana asks Prometheus over the last hour, equal the means and
    the share computed from the engines' own /metrics (vLLM's TTFT included) at the same time."""
    assert stack.prometheus is not None and outcomes
    p, d = metric(stack.prefill), metric(stack.decode)
    read_at = time.time()
    prom = stack.prometheus
    wait_until(lambda: (prom.value(f'min(timestamp(up{{job="{JOB}"}}))') or 0) > read_at,
               "a scrape of both engines after their /metrics were read", 60, 0.25)
    at = prom.value(f'max(timestamp(up{{job="{JOB}"}}))')
    means = report.ttft_dashboard_means(prom, JOB, SERVED_MODEL, at=at)

    def mean(data: list[report.Sample], name: str, **labels: str) -> float:
        return report.total(data, name + "_sum", **labels) / report.total(data, name + "_count", **labels)

    expected = {
        "D: wait for KV (arrival -> KV landed)": mean(d, KV_WAIT.name, outcome="success"),
        "D: TTFT (vLLM)": mean(d, VLLM_TTFT.name),
        "P: prefill done -> WRITE posted": mean(p, PUSH_WRITE_WAIT.name),
        "P: PUSH_REG matched -> WRITE done": mean(p, PUSH_WRITE_DURATION.name),
        "share": report.total(d, KV_WAIT.name + "_sum") / report.total(d, VLLM_TTFT.name + "_sum"),
    }
    assert means.keys() == expected.keys(), means
    for name, value in expected.items():
        assert math.isclose(means[name], value, rel_tol=1e-9), (name, means[name], value)
    assert 0 < expected["share"] < 1


def test_exemplars_on_d_openmetrics_and_in_prometheus_resolve_to_received_traces(
        stack: Stack, outcomes: list[drive.Outcome]) -> None:
    on_d = report.exemplars(stack.decode.metrics(openmetrics=True))
    assert on_d, "no exemplar with a trace_id on D's OpenMetrics /metrics"
    wanted = {tid for _, _, tid in on_d}
    wait_until(lambda: wanted <= {s["trace_id"] for s in stack.spans()}, "the traces D's exemplars point to",
               SPAN_WAIT_S, 0.25)
    start = time.time() - 900
    stored = wait_until(lambda: report.prometheus_exemplars(stack.prometheus, start, time.time()),
                        "Prometheus to store exemplars", SPAN_WAIT_S, 0.25)
    received = {s["trace_id"] for s in stack.spans()}
    assert {tid for _, tid in stored} <= received


# ------------------------------------------------------------------ the engines
def _parse_cpus(text: str) -> set[int]:
    out: set[int] = set()
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return out


def _worker_threads_cpus(server: Any) -> tuple[set[int], list[set[int]]]:
    """The allowed CPUs of the engine's worker process: its main thread's, and every thread's."""
    [worker] = [pid for pid in session_pids(server.pid)
                if Path(f"/proc/{pid}/comm").read_text().strip() == "VLLM::Worker"]
    main, every = set(), []
    for task in Path(f"/proc/{worker}/task").iterdir():
        cpus = _parse_cpus((task / "status").read_text().split("Cpus_allowed_list:")[1].split()[0])
        every.append(cpus)
        if int(task.name) == worker:
            main = cpus
    return main, every


def test_each_engines_worker_stays_on_its_own_core_and_polls_nixl_with_a_delay(stack: Stack) -> None:
    """vLLM pins both workers to the last core; the fork keeps P's main thread on core 0
    (its VLLM_CPU_OMP_THREADS_BIND), and no worker thread is kept off its engine's core."""
    for server, core in ((stack.prefill, 0), (stack.decode, 1)):
        main, every = _worker_threads_cpus(server)
        assert main == {core}, server.name
        assert all(core in cpus for cpus in every), (server.name, every)
        line = f"NIXL progress thread polls every {PROGRESS_DELAY_US} us (nixl_progress_delay_us)"
        assert line in server.log()
    assert "Kept the NIXL worker on CPUs [0]: vLLM pinned it to CPUs [" in stack.prefill.log()


def test_prefill_restart_fails_the_caught_request_fast_and_new_requests_work(stack: Stack) -> None:
    """P's host dies while a request waits for it in D's queue and comes back with the same
    engine id and address (a pod restart). D drops the dead connection and re-handshakes;
    the caught request is recomputed on D (not held for 480 s); new requests get their KV
    over NIXL from the new P."""
    caught_prompt = drive.make_prompts(1, seed=51)[0]
    resets = count(stack.decode, PEER_RESETS.name + "_total")
    sent = count(stack.decode, HEARTBEATS.name + "_total", outcome="sent")
    prefilled = count(stack.prefill, FINISHED)
    with busy(stack.decode, requests=2):
        caught = drive.InBackground(stack.router.url, caught_prompt, "e2e-caught", MAX_TOKENS, timeout_s=300)
        # P finished the prefill (vLLM counts the request; the connector's lease gauge moves
        # only on P's next step, and an idle P takes none) and D heartbeats it from its queue.
        wait_until(lambda: count(stack.prefill, FINISHED) > prefilled
                   and count(stack.decode, HEARTBEATS.name + "_total", outcome="sent") > sent,
                   "P to finish the prefill while D heartbeats the request from its queue", 60, 1.0)
        new_p = stack.restart_prefill()
    out = caught.join()
    assert not out.error, out.error
    assert out.tokens == drive.reference(new_p.url, caught_prompt, MAX_TOKENS, salt="ref-e2e-caught")
    assert count(stack.decode, PEER_RESETS.name + "_total") > resets
    external = external_tokens(stack)
    after = drive.run(stack.router.url, new_p.url, drive.make_prompts(2, seed=61), prefix="e2e-after",
                      max_tokens=MAX_TOKENS)
    assert all(o.ok for o in after), [o.error for o in after]
    assert external_tokens(stack) - external == sum(len(o.prompt) for o in after), receive_endings(stack)


def test_requests_sent_right_after_a_prefill_restart_all_get_their_kv(stack: Stack) -> None:
    """P's host dies while D is idle and comes back with the same engine id and address;
    requests arrive at once, before D noticed anything: their PUSH_REGs meet P's dead
    agent (or none, while D drops it) and go again with the new connection. All complete
    with their KV over NIXL: no receive failed, so no `kv_load_failure_policy` was asked
    (with vLLM's default, `fail`, a failed one is an HTTP 500). P's restart takes longer
    than a lease, so D has heard nothing from P for that long when they arrive."""
    before = drive.run(stack.router.url, stack.prefill.url, drive.make_prompts(1, seed=70),
                       prefix="e2e-before-restart", max_tokens=MAX_TOKENS)  # (D connected to P)
    assert all(o.ok for o in before), [o.error for o in before]
    failures = count(stack.decode, RECEIVE_FAILURES.name + "_total")
    resets = count(stack.decode, PEER_RESETS.name + "_total")
    new_p = stack.restart_prefill()
    external = external_tokens(stack)
    prompts = drive.make_prompts(3, seed=71)
    outs = drive.run(stack.router.url, new_p.url, prompts, prefix="e2e-right-after", max_tokens=MAX_TOKENS,
                     concurrency=3)
    assert all(o.ok for o in outs), [o.error or "differs from the reference" for o in outs]
    assert external_tokens(stack) - external == sum(len(p) for p in prompts), receive_endings(stack)
    assert count(stack.decode, RECEIVE_FAILURES.name + "_total") == failures
    assert count(stack.decode, PEER_RESETS.name + "_total") > resets  # (D did meet the dead agent)


def test_every_process_started_is_gone_after_close(stack: Stack) -> None:
    pids = [p.pid for p in stack.processes] + [stack.prometheus_pid]
    assert all(pids)
    stack.close()
    assert stack.leftovers() == []


# ------------------------------------------------------------------ stock, the control
# Stock vLLM's behaviour does not change with this tree: the two controls below run on
# `make serve-stock` (E2E_STOCK=1), not in CI, whose budget they would cost a third deployment
# start. CI keeps the same comparisons one level down, with real NIXL: the shapes matrix
# (saved == what stock's full handshake prepared, every shape) and tests/test_leases.py
# (stock lets the queued requests' leases expire).
stock_control = pytest.mark.skipif(os.environ.get("E2E_STOCK") != "1",
                                   reason="stock control on real vllm serve: make serve-stock (E2E_STOCK=1)")


@pytest.fixture(scope="module")
def stock(tmp_path_factory: pytest.TempPathFactory) -> Any:
    work = tmp_path_factory.mktemp("e2e-stock")
    s = Stack(work, nixl_progress_delay_us=None, **options("stock", work))
    s.start()
    yield s
    s.close()


@stock_control
def test_stock_prepares_for_its_heartbeat_handshake_the_descriptors_the_fork_saves(
        first_request: dict[str, Any], stock: Stack) -> None:
    """The same first request on stock vLLM: its heartbeat-triggered D->P handshake is a full
    one, and vLLM's own log says how many descriptors it prepared: exactly what the fork
    reported saved (`first_request`, on the fork deployment)."""
    prompt = drive.make_prompts(1, seed=21)[0]
    pattern = re.compile(r"Created (\d+) blocks for dst engine prefill-0")
    with busy(stock.decode):
        # (Not waited for: on stock, a request queued longer than the lease loses its KV.)
        drive.InBackground(stock.router.url, prompt, "stock-first", MAX_TOKENS, timeout_s=2 * LEASE_S)
        log = wait_until(lambda: (text := stock.decode.log()) and pattern.search(text) and text,
                         f"stock D to log its full handshake ('{NIXL_WORKER_LOGGER}' at DEBUG)", 120, 0.5)
    assert "Transfer plan" in log
    created = [int(n) for n in pattern.findall(log)]
    assert sum(created) > 0
    assert sum(created) == first_request["saved"]


@stock_control
def test_stock_lets_queued_requests_lose_their_kv(stock: Stack) -> None:
    """The same burst on stock vLLM: the heartbeats renew nothing, P releases the KV of the
    queued requests (vLLM's own expiry count rises) and they wait on D (cut short here)."""
    prompt = drive.make_prompts(1, seed=31, lengths=(100,))[0]
    expired = count(stock.prefill, EXPIRED)
    with drive.KeepStepping(stock.prefill.url), busy(stock.decode, requests=3):
        # (Not waited for: it waits on D for KV that P released.)
        drive.InBackground(stock.router.url, prompt, "stock-burst", MAX_TOKENS, timeout_s=2 * LEASE_S)
        wait_until(lambda: count(stock.prefill, EXPIRED) > expired,
                   "stock P to release the KV of the request queued on D", 120, 0.5)

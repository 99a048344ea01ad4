"""Trace back-end faults on real engines: pushes go on, nothing waits, losses are counted.

One real P/D harness (real NIXL/UCX, ZMQ); both engines export spans through our
tracer set-up (`BatchSpanProcessor` wrapped by `connector.telemetry.export_guard`):
- D exports OTLP/HTTP to one port, whose back-end goes through three phases, each
  holding every export attempt until the test releases it (tests/support/backends.py),
  then: down (drops the connection unanswered), slow (answers 200) and refusing
  (answers 503, which the exporter retries);
- P exports to an exporter that raises on every export, throughout.
A back-end that failed at once could not show a push waiting for it; these hold every
attempt, and record when each arrived and ended. Per phase, half the pushes run, then,
once an export attempt is held at the back-end, the other half; only once all have
landed does the test release the back-end. Every push lands byte-for-byte while that
attempt is still held (the exporter was blocked throughout: a push that waited for it
would never have landed), the queue (16 spans) stayed within its bound, and every
dropped or failed span reached the worker's stats as a counted telemetry error. gRPC
UNAVAILABLE is tried in process against a real gRPC receiver.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest

from connector.vocabulary import StatKey, TelemetryError
from harness import PushHarness
from harness.otlp_receiver import OtlpGrpcReceiver
from harness.poll import wait_until
from harness.runner import free_port
from tests.support.backends import ACCEPT, DROP, REFUSE, HeldBackend
from tests.support.telemetry import reset_telemetry_errors

real = pytest.mark.real  # the tests of the `backends` fixture: real engines

QUEUE = 16
BATCH = 8
# The deadline of the pushes that run while an export attempt is held.
PUSH_TIMEOUT_S = 12.0
# The exporter's budget per export, its retries included. It is a deadline, not what the
# test waits on: it covers the held pushes' deadline, so the exporter does not give up on
# a held attempt before those pushes have landed (or failed). Once released, a slow
# back-end's 200 comes at once; a down or refusing one's failures are retried until the
# budget cuts them short.
EXPORT_TIMEOUT_S = PUSH_TIMEOUT_S
BSP = {"max_queue_size": QUEUE, "max_export_batch_size": BATCH, "export_timeout_s": EXPORT_TIMEOUT_S}
REQUESTS = 20  # per phase, in two halves
PHASES = {"down": DROP, "slow": ACCEPT, "refusing": REFUSE}
LOSSES = (TelemetryError.SPANS_DROPPED.value, TelemetryError.SPAN_EXPORT_FAILED.value)


def _settled(h: PushHarness, engine: str, timeout_s: float = 120.0) -> dict[str, int]:
    """The span ledger once nothing is queued (every span dropped or handed over, answered)."""
    def settled() -> dict[str, int] | None:
        led = h[engine].call("span_ledger")
        done = (led["queued"] == 0 and led["handed_to_exporter"] == led["exported"] + led["export_failed"]
                and accounted(led))
        return led if done else None

    return wait_until(settled, f"{engine}'s span queue to drain and every export to end", timeout_s,
                      interval_s=0.1, last=lambda: h[engine].call("span_ledger"))


def accounted(led: dict[str, int]) -> bool:
    """Every ended span was dropped (counted) or handed to the exporter; the SDK may count
    one drop too many per export call (see `export_guard.ledger`), never one too few."""
    surplus = led["dropped"] + led["handed_to_exporter"] - led["ended"]
    return 0 <= surplus <= led["exports"]


def _delta(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    return {k: after[k] - before[k] for k in after}


def _losses_counted(h: PushHarness, engine: str, tally: Counter, want: dict[str, int],
                    timeout_s: float = 60.0) -> Counter:
    """Add the engine's counted losses to `tally` until they reach `want`."""
    def reached() -> bool:
        for s in h.stats(engine):
            tally.update(r for r in s.get(StatKey.TELEMETRY_ERRORS, []) if r in LOSSES)
        return all(tally[k] >= n for k, n in want.items())

    wait_until(reached, f"{engine}'s counted span losses to reach {want}", timeout_s, interval_s=0.05,
               last=lambda: dict(tally))
    return tally


def _phase(h: PushHarness, port: int, mode: str, tally: Counter) -> dict[str, Any]:
    """Pushes against one back-end; what they, the ledger and the back-end saw."""
    backend = HeldBackend(port, mode)
    try:
        before = _settled(h, "D")
        counted_before = Counter(tally)
        first = h.push(REQUESTS // 2, bulk=True, timeout_s=120)
        # The second half runs while an export attempt is held, and the back-end is
        # released only after it: had a push to wait for the exporter, it would not land.
        under_way = wait_until(backend.snapshot, "an export attempt of D's spans to reach the back-end", 60)
        second = h.push(REQUESTS - REQUESTS // 2, bulk=True, timeout_s=PUSH_TIMEOUT_S)
        ids = first.requests + second.requests
        landed = h["D"].call("results", ids)["finished_recving"]
        at_done = _delta(h["D"].call("span_ledger"), before)
        held = backend.snapshot()  # every attempt so far, the pushes done, before the release
        backend.release()
        led = _delta(_settled(h, "D"), before)
        attempts = wait_until(backend.all_ended, "every export attempt to end at the back-end", 30)
        want = {LOSSES[0]: counted_before[LOSSES[0]] + led["dropped"],
                LOSSES[1]: counted_before[LOSSES[1]] + led["export_failed"]}
        _losses_counted(h, "D", tally, want)
        return {"reports": (first, second), "landed": landed, "at_done": at_done, "ledger": led,
                "under_way": under_way, "held": held, "attempts": attempts, "spans_kept": backend.spans_kept,
                "counted": {k: tally[k] - counted_before[k] for k in LOSSES}}
    finally:
        backend.close()


@pytest.fixture(scope="module")
def backends(tmp_path_factory: pytest.TempPathFactory) -> Any:
    work = str(tmp_path_factory.mktemp("backends"))
    port = free_port()
    d_tracing = {"endpoint": f"http://127.0.0.1:{port}/v1/traces", "protocol": "http/protobuf", **BSP}
    h = PushHarness.pd(num_blocks=2 * REQUESTS * len(PHASES) + 8, workdir=work,
                       prefill_tracing={"exporter": "raising", **BSP}, decode_tracing=d_tracing)
    tally: Counter = Counter()
    try:
        h.start()
        phases = {phase: _phase(h, port, mode, tally) for phase, mode in PHASES.items()}
        p_ledger = _settled(h, "P")
        p_tally = _losses_counted(h, "P", Counter(), {LOSSES[0]: p_ledger["dropped"],
                                                       LOSSES[1]: p_ledger["export_failed"]})
        yield {"phases": phases, "p_ledger": p_ledger, "p_counted": p_tally}
    finally:
        h.stop()


@real
@pytest.mark.parametrize("phase", PHASES)
def test_pushes_complete_whatever_the_backend(backends: Any, phase: str) -> None:
    facts = backends["phases"][phase]
    for report in facts["reports"]:
        assert report.ok, (report.failed, report.mismatched, report.dirty_blocks)
    assert sum(r.verified for r in facts["reports"]) == len(facts["landed"]) == REQUESTS


@real
@pytest.mark.parametrize("phase", PHASES)
def test_pushes_did_not_wait_for_the_backend(backends: Any, phase: str) -> None:
    """Every push of the phase landed on D while the exporter was blocked: the export
    attempt under way before the second half ran was still held by the back-end (not
    ended, by it or by the exporter) once every push had landed; the back-end was
    released only then."""
    facts = backends["phases"][phase]
    assert len(facts["landed"]) == REQUESTS, facts["reports"]
    under_way, held = facts["under_way"], facts["held"]  # `held` starts with `under_way`'s attempts
    assert under_way and all(a.ended is None for a in held), (under_way, held)
    assert facts["at_done"]["ended"] >= 2 * REQUESTS  # receive + register span per request


@real
@pytest.mark.parametrize("phase", PHASES)
def test_queue_bounded_and_every_loss_counted(backends: Any, phase: str) -> None:
    facts = backends["phases"][phase]
    led = facts["ledger"]
    assert accounted(led), led
    assert led["handed_to_exporter"] == led["exported"] + led["export_failed"], led
    # Memory bound: spans past the queue's 16 were dropped, not kept.
    assert led["dropped"] > 0, led
    if phase == "slow":  # every export answered, within the exporter's budget
        assert led["export_failed"] == 0 and led["exported"] == facts["spans_kept"] > 0, led
    else:  # down, refusing: nothing arrived
        assert led["exported"] == 0 and led["export_failed"] > 0 and facts["spans_kept"] == 0, led
    assert facts["counted"] == {LOSSES[0]: led["dropped"], LOSSES[1]: led["export_failed"]}


@real
def test_raising_exporter_counted_on_p(backends: Any) -> None:
    led = backends["p_ledger"]
    assert led["ended"] >= REQUESTS * len(PHASES)  # one nixl.push.write per request
    assert led["exported"] == 0 and led["export_failed"] == led["handed_to_exporter"] > 0
    assert accounted(led), led
    counted = backends["p_counted"]
    assert {k: counted[k] for k in LOSSES} == {LOSSES[0]: led["dropped"], LOSSES[1]: led["export_failed"]}


def test_grpc_unavailable_counts_as_export_failure(monkeypatch: pytest.MonkeyPatch) -> None:
    """In process: gRPC UNAVAILABLE from a real receiver is counted per span, never raised."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor

    from connector.telemetry import errors
    from connector.telemetry.export_guard import CountingExporter, ledger
    from connector.telemetry.tracing import make_span_exporter

    receiver = OtlpGrpcReceiver(refuse=True)
    try:
        reset_telemetry_errors()
        before = ledger()
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", "1")
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "grpc")
        exporter = CountingExporter(make_span_exporter(receiver.endpoint))
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(exporter))
        tracer = provider.get_tracer("t")
        for _ in range(3):
            tracer.start_span("x").end()  # must return, never raise
        after = ledger()
        assert after["export_failed"] - before["export_failed"] == 3
        assert errors.drain().get(TelemetryError.SPAN_EXPORT_FAILED.value) == 3
        assert receiver.attempts >= 3 and receiver.requests == 0
        provider.shutdown()
    finally:
        receiver.close()


def test_overflow_and_raising_exporter_counted_in_process() -> None:
    """Narrow check of export_guard with the SDK's real batch processor: every span ends
    up dropped or handed over, and each loss is counted once in the telemetry errors."""
    from opentelemetry.sdk.trace import TracerProvider

    from connector.telemetry import errors
    from connector.telemetry.export_guard import counting_batch_span_processor, ledger
    from harness.otlp_receiver import RaisingExporter

    reset_telemetry_errors()
    before = ledger()
    provider = TracerProvider()
    provider.add_span_processor(counting_batch_span_processor(
        RaisingExporter(), max_queue_size=4, max_export_batch_size=4, schedule_delay_millis=60_000))
    tracer = provider.get_tracer("t")
    for _ in range(40):
        tracer.start_span("s").end()  # never raises, never waits for the exporter
    provider.force_flush()
    led = {k: v - before[k] for k, v in ledger().items()}
    assert led["ended"] == 40 and accounted(led), led
    assert led["dropped"] > 0 and led["exported"] == 0
    assert led["export_failed"] == led["handed_to_exporter"] > 0
    assert errors.drain() == {TelemetryError.SPANS_DROPPED.value: led["dropped"],
                              TelemetryError.SPAN_EXPORT_FAILED.value: led["export_failed"]}
    provider.shutdown()

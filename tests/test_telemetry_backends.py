"""Trace back-end faults on real engines: pushes go on, nothing waits, losses are counted.

One real P/D harness (real NIXL/UCX, ZMQ); both engines export spans through our
tracer set-up (`BatchSpanProcessor` wrapped by `connector.telemetry.export_guard`):
- D exports OTLP/HTTP to one port, whose back-end goes through three phases:
  down (nothing listening), slow (a real receiver that holds every export until the
  pushes are done, then takes seconds per export), refusing (a real receiver
  answering 503);
- P exports to an exporter that raises on every export, throughout.
A small batch queue (16 spans) makes the queue overflow on purpose. Per phase:
every push lands byte-for-byte, the pushes finished while the back-end had answered
no export at all (no push waited on it), the queue stayed within its bound,
and every dropped or failed span reached the worker's stats as a counted telemetry
error. gRPC UNAVAILABLE is tried in process against a real gRPC receiver.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from connector.vocabulary import StatKey, TelemetryError
from harness import PushHarness
from harness.otlp_receiver import OtlpGrpcReceiver, OtlpHttpReceiver
from harness.runner import free_port
from tests.support.telemetry import reset_telemetry_errors

QUEUE = 16
BATCH = 4
BSP = {"max_queue_size": QUEUE, "max_export_batch_size": BATCH, "export_timeout_s": 2}
REQUESTS = 20
SLOW_S = 1.0
PHASES = ("down", "slow", "refusing")
LOSSES = (TelemetryError.SPANS_DROPPED.value, TelemetryError.SPAN_EXPORT_FAILED.value)


def _settled(h: PushHarness, engine: str, timeout_s: float = 90.0) -> dict[str, int]:
    """The span ledger once nothing is queued (every span dropped or handed over, answered)."""
    deadline = time.monotonic() + timeout_s
    while True:
        led = h[engine].call("span_ledger")
        handed = led["handed_to_exporter"]
        if (led["queued"] == 0 and handed == led["exported"] + led["export_failed"]
                and accounted(led)) or time.monotonic() > deadline:
            return led
        time.sleep(0.1)  # poll interval


def accounted(led: dict[str, int]) -> bool:
    """Every ended span was dropped (counted) or handed to the exporter; the SDK may count
    one drop too many per export call (see `export_guard.ledger`), never one too few."""
    surplus = led["dropped"] + led["handed_to_exporter"] - led["ended"]
    return 0 <= surplus <= led["exports"]


def _delta(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    return {k: after[k] - before[k] for k in after}


def _losses_counted(h: PushHarness, engine: str, tally: Counter, want: dict[str, int],
                    timeout_s: float = 60.0) -> Counter:
    """Add the engine's counted losses to `tally` until they reach `want` (or time out)."""
    deadline = time.monotonic() + timeout_s
    while True:
        for s in h.stats(engine):
            tally.update(r for r in s.get(StatKey.TELEMETRY_ERRORS, []) if r in LOSSES)
        if all(tally[k] >= n for k, n in want.items()) or time.monotonic() > deadline:
            return tally
        time.sleep(0.05)  # poll interval


def _backend(phase: str, port: int) -> OtlpHttpReceiver | None:
    if phase == "down":
        return None
    if phase == "slow":
        return OtlpHttpReceiver(port=port, delay_s=SLOW_S, hold=threading.Event())
    return OtlpHttpReceiver(port=port, status=503)


@pytest.fixture(scope="module")
def backends(tmp_path_factory: pytest.TempPathFactory) -> Any:
    work = str(tmp_path_factory.mktemp("backends"))
    port = free_port()
    d_tracing = {"endpoint": f"http://127.0.0.1:{port}/v1/traces", "protocol": "http/protobuf", **BSP}
    h = PushHarness.pd(num_blocks=2 * REQUESTS * len(PHASES) + 8, workdir=work,
                       prefill_tracing={"exporter": "raising", **BSP}, decode_tracing=d_tracing)
    phases: dict[str, dict[str, Any]] = {}
    tally: Counter = Counter()
    try:
        h.start()
        for phase in PHASES:
            receiver = _backend(phase, port)
            try:
                before = _settled(h, "D")
                counted_before = Counter(tally)
                report = h.push(REQUESTS, timeout_s=120)
                at_done = _delta(h["D"].call("span_ledger"), before)
                answered = receiver.requests if receiver else 0
                if receiver is not None and receiver.hold is not None:
                    receiver.hold.set()  # the stuck back-end recovers, slowly
                led = _delta(_settled(h, "D"), before)
                want = {LOSSES[0]: counted_before[LOSSES[0]] + led["dropped"],
                        LOSSES[1]: counted_before[LOSSES[1]] + led["export_failed"]}
                _losses_counted(h, "D", tally, want)
                phases[phase] = {
                    "report": report, "at_done": at_done, "answered_at_done": answered,
                    "ledger": led, "attempts": receiver.attempts if receiver else 0,
                    "counted": {k: tally[k] - counted_before[k] for k in LOSSES},
                }
            finally:
                if receiver is not None:
                    receiver.close()
        p_ledger = _settled(h, "P")
        p_tally = _losses_counted(h, "P", Counter(), {LOSSES[0]: p_ledger["dropped"],
                                                       LOSSES[1]: p_ledger["export_failed"]})
        yield {"phases": phases, "p_ledger": p_ledger, "p_counted": p_tally}
    finally:
        h.stop()


@pytest.mark.parametrize("phase", PHASES)
def test_pushes_complete_whatever_the_backend(backends: Any, phase: str) -> None:
    report = backends["phases"][phase]["report"]
    assert report.ok, (report.failed, report.mismatched, report.dirty_blocks)
    assert report.verified == REQUESTS


@pytest.mark.parametrize("phase", PHASES)
def test_pushes_did_not_wait_for_the_backend(backends: Any, phase: str) -> None:
    """When the last push landed, the back-end had answered no export of D's spans."""
    facts = backends["phases"][phase]
    at_done = facts["at_done"]
    assert at_done["ended"] >= 2 * REQUESTS  # receive + register span per request
    assert at_done["exported"] == 0
    assert facts["answered_at_done"] == 0


@pytest.mark.parametrize("phase", PHASES)
def test_queue_bounded_and_every_loss_counted(backends: Any, phase: str) -> None:
    facts = backends["phases"][phase]
    led = facts["ledger"]
    assert accounted(led), led
    assert led["handed_to_exporter"] == led["exported"] + led["export_failed"], led
    # Memory bound: spans past the queue's 16 were dropped, not kept.
    assert led["dropped"] > 0, led
    if phase == "slow":  # after the hold, exports arrive (the held one may have timed out)
        assert led["exported"] > 0, led
    else:  # down, refusing: nothing arrived
        assert led["exported"] == 0 and led["export_failed"] > 0, led
    if phase != "down":  # the back-end really was tried
        assert facts["attempts"] > 0
    assert facts["counted"] == {LOSSES[0]: led["dropped"], LOSSES[1]: led["export_failed"]}


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


def test_every_telemetry_error_reason_is_documented() -> None:
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    for reason in TelemetryError:
        assert f"| `{reason.value}` |" in readme, reason


def test_overflow_and_raising_exporter_counted_in_process() -> None:
    """Narrow check of export_guard with the SDK's real batch processor: every span ends
    up dropped or handed over, and each loss is counted once in the telemetry errors."""
    from opentelemetry.sdk.trace import TracerProvider

    from connector.telemetry import errors
    from connector.telemetry.export_guard import counted_batch_processor, ledger
    from harness.otlp_receiver import RaisingExporter

    reset_telemetry_errors()
    before = ledger()
    provider = TracerProvider()
    provider.add_span_processor(counted_batch_processor(
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

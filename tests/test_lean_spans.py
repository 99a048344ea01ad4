"""Lean spans against the SDK's: the same decisions, the same exported bytes.

Two tracers on one provider with a deterministic id generator: the SDK's own and
our `LeanTracer`. Driven through the same calls with the same timestamps, each
span must encode to the same OTLP bytes (with the SDK's encoder, which reads the
lean span through `ReadableSpan`'s properties, and with ours).
"""

from __future__ import annotations

import itertools
import threading

import pytest
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider, sampling
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.id_generator import IdGenerator
from opentelemetry.trace import Link, NonRecordingSpan, SpanContext, SpanKind, Status, StatusCode, TraceFlags

from connector.telemetry import otlp_wire, tracing
from connector.telemetry.export_guard import CountingBatchSpanProcessor, CountingExporter
from connector.telemetry.lean_span import LEAN_SPANS_ENV, LeanSpan, LeanTracer
from connector.vocabulary import TRACER_NAME


class CountingIds(IdGenerator):
    """Ids from a counter, so two tracers driven alike name their spans alike."""

    def __init__(self) -> None:
        self._next = itertools.count(1)

    def generate_span_id(self) -> int:
        return next(self._next)

    def generate_trace_id(self) -> int:
        return (1 << 100) + next(self._next)

    def is_trace_id_random(self) -> bool:
        return True


class Collect(SpanExporter):
    def __init__(self) -> None:
        self.spans: list = []

    def export(self, spans):
        self.spans.extend(spans)
        return SpanExportResult.SUCCESS


def _pair(sampler=None):
    """(sdk tracer, lean tracer, exporter, id generator reset) on one provider."""
    exporter = InMemorySpanExporter()
    ids = CountingIds()
    provider = TracerProvider(resource=Resource.create({"service.name": "vllm-prefill"}),
                              id_generator=ids, sampler=sampler or sampling.ParentBased(sampling.ALWAYS_ON))
    processor = SimpleSpanProcessor(exporter)
    provider.add_span_processor(processor)
    return provider, processor, exporter


REMOTE = SpanContext(0x0AF7651916CD43DD8448EB211C80319C, 0xB7AD6B7169203331, is_remote=True,
                     trace_flags=TraceFlags(1))


def _drive(tracer) -> list:
    """The calls our push path makes (and a few it could), with fixed times."""
    parent = trace.set_span_in_context(NonRecordingSpan(REMOTE))
    write = tracer.start_span("nixl.push.write", context=parent, kind=SpanKind.CONSUMER,
                              attributes={"vllm.request_id": "r-1", "n": 3, "ok": True, "f": 0.5},
                              links=[Link(REMOTE, {"link.role": "prefill_request"})], start_time=10)
    write.set_attribute("nixl.handshake.wait_s", 0.0)
    write.set_attributes({"x": "y", "none": None})
    hs = tracer.start_span("nixl.handshake", context=trace.set_span_in_context(write),
                           kind=SpanKind.CLIENT, start_time=11)
    hs.add_event("exception", {"exception.message": "boom"}, timestamp=12)
    hs.set_status(Status(StatusCode.ERROR, "boom"))
    hs.set_status(StatusCode.UNSET)  # never overwrites
    hs.end(end_time=13)
    hs.set_attribute("after", "end")  # ignored, as the SDK does
    root = tracer.start_span("nixl.push.receive", start_time=20)
    root.set_status(Status(StatusCode.OK))
    root.set_status(Status(StatusCode.ERROR, "too late"))  # OK is final
    root.end(end_time=21)
    write.end(end_time=30)
    write.end(end_time=40)  # a second end is a no-op
    return [hs, root, write]


def _sdk_and_lean(sampler=None):
    provider, processor, exporter = _pair(sampler)
    sdk_spans = _drive(provider.get_tracer(TRACER_NAME))
    sdk_finished = list(exporter.get_finished_spans())
    exporter.clear()
    provider.id_generator._next = itertools.count(1)
    lean_spans = _drive(LeanTracer(provider, processor, TRACER_NAME))
    lean_finished = list(exporter.get_finished_spans())
    return sdk_spans, sdk_finished, lean_spans, lean_finished


def test_lean_spans_export_the_same_bytes_as_sdk_spans():
    _, sdk_finished, _, lean_finished = _sdk_and_lean()
    assert len(sdk_finished) == len(lean_finished) == 3
    assert all(isinstance(s, LeanSpan) for s in lean_finished)
    sdk_bytes = encode_spans(sdk_finished).SerializeToString()
    assert encode_spans(lean_finished).SerializeToString() == sdk_bytes
    assert otlp_wire.encode_request(lean_finished) == sdk_bytes


@pytest.mark.parametrize("sampler", [
    sampling.ParentBased(sampling.ALWAYS_OFF),
    sampling.ALWAYS_OFF,
    sampling.TraceIdRatioBased(0.5),  # keeps our small root trace ids, drops the remote one
    # Parent-based, but not keeping every child of a sampled remote parent: asked each time.
    sampling.ParentBased(sampling.ALWAYS_ON, remote_parent_sampled=sampling.ALWAYS_OFF),
])
def test_lean_spans_follow_the_providers_sampler(sampler):
    sdk_spans, sdk_finished, lean_spans, lean_finished = _sdk_and_lean(sampler)
    assert len(lean_finished) == len(sdk_finished) < 3  # the sampler dropped something
    for sdk, lean in zip(sdk_spans, lean_spans, strict=True):
        assert isinstance(sdk, NonRecordingSpan) is isinstance(lean, NonRecordingSpan)
        assert sdk.get_span_context() == lean.get_span_context()
    assert encode_spans(lean_finished).SerializeToString() == encode_spans(sdk_finished).SerializeToString()


def test_children_of_sampled_parents_skip_the_default_sampler_and_export_the_same():
    """With the default parent-based sampler a sampled parent's child is always kept,
    and its `always_on` root delegate keeps every root: the lean tracer then asks the
    sampler for neither (the exported bytes stay the SDK's, see above). A subclass is
    asked for every span."""
    asked = []

    class Spy(sampling.ParentBased):
        def should_sample(self, parent_context, *args, **kwargs):
            asked.append(parent_context)
            return super().should_sample(parent_context, *args, **kwargs)

    provider, processor, _ = _pair()
    provider.sampler = Spy(sampling.ALWAYS_ON)
    lean = LeanTracer(provider, processor, TRACER_NAME)
    assert not lean._follows_sampled_parents  # a subclass may decide otherwise: asked
    _drive(lean)
    assert len(asked) == 3
    asked.clear()
    provider.sampler = sampling.ParentBased(sampling.ALWAYS_ON)
    lean = LeanTracer(provider, processor, TRACER_NAME)
    provider.sampler = Spy(sampling.ALWAYS_ON)  # (what the lean tracer would ask, if it did)
    lean._sampler = provider.sampler
    _drive(lean)
    assert not asked


@pytest.mark.parametrize("delegate", [
    sampling.ParentBased(sampling.ALWAYS_ON),
    sampling.ParentBased(sampling.ALWAYS_ON, remote_parent_sampled=sampling.ALWAYS_OFF),
    sampling.TraceIdRatioBased(0.5),
])
def test_spans_under_a_parent_span_match_the_sdks_and_the_sampler_sees_that_parent(delegate):
    """Our push path hands `SpanEmitter.start` parent spans (a remote one from a PUSH_REG,
    the receive span), not contexts: the lean tracer starts under them without building
    an OTel context, except for a sampler it must ask. Same span contexts, same finished
    spans and the same parent seen by the sampler as with the SDK's tracer."""
    from connector.telemetry.tracing import SpanEmitter

    provider, processor, exporter = _pair()
    seen: list = []

    class Spy(sampling.Sampler):
        def should_sample(self, parent_context, *args, **kwargs):
            seen.append(trace.get_current_span(parent_context))
            return delegate.should_sample(parent_context, *args, **kwargs)

        def get_description(self) -> str:
            return "Spy"

    provider.sampler = Spy()
    results = []
    for lean in (False, True):
        provider.id_generator._next = itertools.count(1)
        exporter.clear()
        seen.clear()
        emitter = SpanEmitter(LeanTracer(provider, processor, TRACER_NAME) if lean
                              else provider.get_tracer(TRACER_NAME))
        spans = []
        for _ in range(4):
            receive = emitter.start("nixl.push.receive", attributes=lambda: {"n": 1})
            register = emitter.start("nixl.push.register", parent=receive, attributes={"a": "b"})
            write = emitter.start("nixl.push.write", parent=NonRecordingSpan(REMOTE),
                                  links=[Link(REMOTE, {})], attributes=lambda: {"x": 1})
            for span in (register, receive, write):
                SpanEmitter.end(span)
            spans += [receive, register, write]
        finished = [(f.name, f.context, f.parent, f.kind, dict(f.attributes),
                     [(x.context, dict(x.attributes)) for x in f.links], f.status.status_code)
                    for f in exporter.get_finished_spans()]  # (their times differ)
        results.append(([s.get_span_context() for s in spans], finished,
                        [s.get_span_context() for s in seen]))
    assert results[0] == results[1]
    assert results[1][2]  # the spy was asked


class ListedIds(IdGenerator):
    """Trace ids from a list (span ids from a counter)."""

    def __init__(self, trace_ids: list[int]) -> None:
        self._trace_ids = iter(trace_ids)
        self._spans = itertools.count(1)

    def generate_span_id(self) -> int:
        return next(self._spans)

    def generate_trace_id(self) -> int:
        return next(self._trace_ids)


class NotToBeAsked(sampling.Sampler):
    def should_sample(self, *args, **kwargs):
        raise AssertionError("the sampler was asked")

    def get_description(self) -> str:
        return "NotToBeAsked"


@pytest.mark.parametrize("sampler, kept", [
    (sampling.ALWAYS_ON, "all"), (sampling.ALWAYS_OFF, "none"),
    (sampling.ParentBased(sampling.ALWAYS_OFF), "none"),
    (sampling.TraceIdRatioBased(0.25), "some"),
    (sampling.ParentBased(sampling.TraceIdRatioBased(0.25)), "some"),
    (sampling.ParentBasedTraceIdRatio(0.25), "some"),  # what parentbased_traceidratio makes
])
def test_root_decisions_of_the_built_in_samplers_match_the_sdks_without_asking(sampler, kept):
    """A root span under the SDK's built-in samplers is decided from its trace id
    alone: the same decision and span context as the SDK's, the sampler never asked.
    The trace ids straddle the ratio's bound and carry random high bits (the ratio
    reads the low 64 only)."""
    import random

    rng = random.Random(7)
    bound = sampling.TraceIdRatioBased(0.25).bound
    lows = [0, 1, bound - 1, bound, bound + 1, (1 << 64) - 1] + [rng.getrandbits(64) for _ in range(200)]
    trace_ids = [(rng.getrandbits(64) << 64) | low or 1 for low in lows]
    decided = []
    for lean in (False, True):
        provider, processor, _ = _pair(sampler)
        provider.id_generator = ListedIds(trace_ids)
        tracer = provider.get_tracer(TRACER_NAME)
        if lean:
            tracer = LeanTracer(provider, processor, TRACER_NAME)
            tracer._sampler = NotToBeAsked()
        spans = [tracer.start_span("nixl.push.receive", start_time=1) for _ in trace_ids]
        decided.append([(s.is_recording(), s.get_span_context()) for s in spans])
    assert decided[0] == decided[1]
    recorded = [recording for recording, _ in decided[1]]
    assert {"all": all(recorded), "none": not any(recorded),
            "some": recorded[:5] == [True, True, True, False, False]}[kept]


@pytest.mark.parametrize("direct", [True, False])
def test_span_contexts_built_directly_equal_the_constructors(monkeypatch, direct):
    """`new_span_context` (the per-span paths) against `SpanContext(...)`, field for
    field, valid ids and invalid ones; with the direct build (the installed API's
    layout, checked at import) and with the constructor it falls back to."""
    from opentelemetry.trace.span import DEFAULT_TRACE_STATE, TraceState

    from connector.telemetry import lean_span

    assert lean_span._DIRECT  # the installed API has the layout the direct build needs
    monkeypatch.setattr(lean_span, "_DIRECT", direct)
    state = TraceState([("vendor", "x")])
    for trace_id, span_id, remote, flags, ts in itertools.product(
            [0, 1, (1 << 128) - 1, 1 << 128], [0, 7, (1 << 64) - 1, 1 << 64], [True, False],
            [TraceFlags(0), TraceFlags(1), TraceFlags(3)], [DEFAULT_TRACE_STATE, state]):
        got = lean_span.new_span_context(trace_id, span_id, remote, flags, ts)
        want = SpanContext(trace_id, span_id, is_remote=remote, trace_flags=flags, trace_state=ts)
        assert type(got) is SpanContext and tuple(got) == tuple(want)
        assert (got.trace_id, got.span_id, got.is_remote, got.trace_flags, got.trace_state,
                got.is_valid) == (want.trace_id, want.span_id, want.is_remote, want.trace_flags,
                                  want.trace_state, want.is_valid)


@pytest.mark.parametrize("name", ["parentbased_always_on", "parentbased_always_off",
                                  "parentbased_traceidratio", "always_on", "always_off", "traceidratio"])
def test_every_sampler_the_environment_names_takes_the_fast_paths(monkeypatch, name):
    """`OTEL_TRACES_SAMPLER`'s built-in samplers: roots decided from the trace id,
    attributes built only for kept spans, a sampled parent's child kept unasked
    (parent-based ones)."""
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", name)
    monkeypatch.setenv("OTEL_TRACES_SAMPLER_ARG", "0.1")
    provider = TracerProvider()
    processor = SimpleSpanProcessor(InMemorySpanExporter())
    provider.add_span_processor(processor)
    lean = LeanTracer(provider, processor, TRACER_NAME)
    assert lean._root_bound is not None
    assert lean.decides_before_attributes
    assert lean._follows_sampled_parents is name.startswith("parentbased")


@pytest.mark.parametrize("root_sampler, kept", [(sampling.ALWAYS_ON, True), (sampling.ALWAYS_OFF, False)])
def test_attributes_given_as_a_function_are_built_only_for_a_kept_span(root_sampler, kept):
    """The SDK's samplers ignore attributes, so the lean tracer decides first: a dropped
    root (an unsampled request) builds none; a kept one exports what a dict gives."""
    built = []

    def attributes():
        built.append(1)
        return {"vllm.request_id": "r-1", "n": 3}

    provider, processor, exporter = _pair(sampling.ParentBased(root_sampler))
    lean = LeanTracer(provider, processor, TRACER_NAME)
    assert lean.decides_before_attributes
    span = lean.start_span("nixl.push.receive", attributes=attributes, start_time=1)
    span.end(end_time=2)
    assert len(built) == int(kept)
    if kept:
        provider.id_generator._next = itertools.count(1)
        lean.start_span("nixl.push.receive", attributes=attributes(), start_time=1).end(end_time=2)
        first, second = exporter.get_finished_spans()
        assert encode_spans([first]).SerializeToString() == encode_spans([second]).SerializeToString()
    else:
        assert not span.is_recording() and not exporter.get_finished_spans()


def test_a_sampler_that_may_read_attributes_gets_them():
    class ByAttribute(sampling.Sampler):
        def should_sample(self, parent_context, trace_id, name, kind=None, attributes=None,
                          links=None, trace_state=None):
            keep = bool(attributes and attributes.get("keep"))
            return sampling.SamplingResult(
                sampling.Decision.RECORD_AND_SAMPLE if keep else sampling.Decision.DROP, attributes)

        def get_description(self) -> str:
            return "ByAttribute"

    provider, processor, _ = _pair(ByAttribute())
    lean = LeanTracer(provider, processor, TRACER_NAME)
    assert not lean.decides_before_attributes
    assert lean.start_span("s", attributes=lambda: {"keep": True}).is_recording()
    assert not lean.start_span("s", attributes=lambda: {"keep": False}).is_recording()


def test_attribute_limits_of_the_environment_apply(monkeypatch):
    monkeypatch.setenv("OTEL_SPAN_ATTRIBUTE_VALUE_LENGTH_LIMIT", "4")
    monkeypatch.setenv("OTEL_SPAN_ATTRIBUTE_COUNT_LIMIT", "2")
    provider, processor, exporter = _pair()
    seen = []
    for tracer in (provider.get_tracer(TRACER_NAME), LeanTracer(provider, processor, TRACER_NAME)):
        provider.id_generator._next = itertools.count(1)
        span = tracer.start_span("s", attributes={"a": "abcdefgh"}, start_time=1)
        span.set_attribute("b", "xyzxyz")
        seen.append(dict(span.attributes))
        span.set_attribute("c", 2)
        span.end(end_time=2)
    assert seen == [{"a": "abcd", "b": "xyzx"}] * 2  # strings cut to the length limit
    sdk, lean = exporter.get_finished_spans()
    assert dict(lean.attributes) == dict(sdk.attributes) == {"b": "xyzx", "c": 2}  # the oldest went
    assert lean.dropped_attributes == sdk.dropped_attributes == 1


def test_our_provider_gets_lean_spans_only_while_our_processor_is_its_only_one(monkeypatch):
    provider = TracerProvider()
    processor = CountingBatchSpanProcessor(CountingExporter(Collect()))
    provider.add_span_processor(processor)
    try:
        assert isinstance(tracing.own_tracer(provider, processor), LeanTracer)
        monkeypatch.setenv(LEAN_SPANS_ENV, "0")
        assert not isinstance(tracing.own_tracer(provider, processor), LeanTracer)
        monkeypatch.delenv(LEAN_SPANS_ENV)
        assert not isinstance(tracing.own_tracer(provider, None), LeanTracer)  # not ours
        lean = tracing.own_tracer(provider, processor)
        assert isinstance(lean.start_span("before"), LeanSpan)
        added = InMemorySpanExporter()
        provider.add_span_processor(SimpleSpanProcessor(added))
        assert not isinstance(tracing.own_tracer(provider, processor), LeanTracer)
        # A tracer made before the processor was added hands the SDK its next spans.
        after = lean.start_span("after")
        assert not isinstance(after, LeanSpan)
        after.end()
        assert [s.name for s in added.get_finished_spans()] == ["after"]
    finally:
        provider.shutdown()


def test_lean_spans_reach_the_batch_exporter_and_its_ledger():
    exporter = Collect()
    provider = TracerProvider()
    processor = CountingBatchSpanProcessor(CountingExporter(exporter))
    provider.add_span_processor(processor)
    tracer = LeanTracer(provider, processor, TRACER_NAME)
    try:
        def work() -> None:
            for _ in range(200):
                span = tracer.start_span("nixl.push.write")
                span.set_attribute("k", 1)
                span.end()

        threads = [threading.Thread(target=work) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert processor.force_flush()
        assert len(exporter.spans) == 800
        assert len({s.context.span_id for s in exporter.spans}) == 800
        assert all(s.attributes == {"k": 1} and s.end_time >= s.start_time for s in exporter.spans)
    finally:
        provider.shutdown()


def test_the_count_limit_applies_without_a_length_limit(monkeypatch):
    # (Under the count limit a lean span takes its attributes in one update; at it,
    # one by one, the oldest dropped as the SDK does.)
    monkeypatch.setenv("OTEL_SPAN_ATTRIBUTE_COUNT_LIMIT", "2")
    provider, processor, exporter = _pair()
    for tracer in (provider.get_tracer(TRACER_NAME), LeanTracer(provider, processor, TRACER_NAME)):
        span = tracer.start_span("s", attributes={"a": "a long value, not cut", "b": 1}, start_time=1)
        span.set_attribute("b", 2)  # an existing key: nothing dropped
        span.set_attributes({"c": 3})
        span.set_attribute("d", 4)  # a new key at the limit: the oldest goes
        span.end(end_time=2)
        over = tracer.start_span("t", attributes={"x": 1, "y": 2, "z": 3}, start_time=1)
        over.end(end_time=2)
    sdk, sdk_over, lean, lean_over = exporter.get_finished_spans()
    assert dict(lean.attributes) == dict(sdk.attributes) == {"c": 3, "d": 4}
    assert lean.dropped_attributes == sdk.dropped_attributes == 2
    assert dict(lean_over.attributes) == dict(sdk_over.attributes) == {"y": 2, "z": 3}
    assert lean_over.dropped_attributes == sdk_over.dropped_attributes == 1

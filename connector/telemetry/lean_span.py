"""Spans for our own tracer provider, without the SDK's per-span machinery.

Profiles of a P/D pair with every request sampled showed the SDK's `start_span` and
`Span.end` (bounded attribute and event containers, a lock and a processor fan-out
per span, the span's own metrics) as the largest part of what tracing costs the
writer and engine threads, and the exporter thread copying each span's attributes,
events and links again through `ReadableSpan`'s properties.

On the provider we install ourselves (OTLP endpoint, our batch processor, nothing
else) our spans are these instead: the same sampler decides (the provider's,
`OTEL_TRACES_SAMPLER`), the same id generator names them, the same batch processor
queues and exports them, and the span limits of `OTEL_SPAN_ATTRIBUTE_*` still
apply. A `LeanSpan` answers the OTel span API on the recording side and the
`ReadableSpan` properties exporters read, so the SDK's own OTLP encoder accepts it
too (our fallback when our encoder fails).

Not used on a provider vLLM or the user installed, or on ours once it has another
span processor (checked per span): those get the SDK's own spans, exactly as before.
`NIXL_PUSH_OBSERVED_LEAN_SPANS=0` turns it off.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import traceback
from collections.abc import Mapping, Sequence
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.sdk.trace import Event, SpanLimits
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import Link, SpanContext, SpanKind, Status, StatusCode, TraceFlags
from opentelemetry.trace.span import DEFAULT_TRACE_STATE, TraceState

LEAN_SPANS_ENV = "NIXL_PUSH_OBSERVED_LEAN_SPANS"

# Setters and `end` of every lean span: attributes may be set on one thread while
# another ends the span; nothing may change once the exporter can see it.
_LOCK = threading.Lock()
_UNSET = Status(StatusCode.UNSET)
_SAMPLED = TraceFlags(TraceFlags.SAMPLED)
_NOT_SAMPLED = TraceFlags(TraceFlags.DEFAULT)
_RANDOM = getattr(TraceFlags, "RANDOM_TRACE_ID", 0)  # W3C level 2 flag, newer SDKs only
_SAMPLED_RANDOM, _NOT_SAMPLED_RANDOM = TraceFlags(_SAMPLED | _RANDOM), TraceFlags(_RANDOM)
_TRACE_ID_LIMIT = (1 << 64) - 1  # the part of a trace id the SDK's ratio sampler reads
_TRACE_ID_MAX, _SPAN_ID_MAX = (1 << 128) - 1, (1 << 64) - 1
_tuple_new = tuple.__new__


def _direct_build_matches() -> bool:
    """Whether the installed `SpanContext` is the tuple its constructor is known to make:
    (trace id, span id, is remote, flags, trace state, is valid). Checked once, against
    the constructor itself."""
    try:
        flags = TraceFlags(TraceFlags.SAMPLED)
        want = SpanContext(3, 4, is_remote=True, trace_flags=flags, trace_state=DEFAULT_TRACE_STATE)
        got = _tuple_new(SpanContext, (3, 4, True, flags, DEFAULT_TRACE_STATE, True))
        return (tuple(got) == tuple(want) and got == want
                and (got.trace_id, got.span_id, got.is_remote, got.trace_flags, got.is_valid)
                == (3, 4, True, flags, True) and got.trace_state is want.trace_state)
    except Exception:
        return False


_DIRECT = _direct_build_matches()


def new_span_context(trace_id: int, span_id: int, is_remote: bool, flags: TraceFlags,
                     state: TraceState = DEFAULT_TRACE_STATE) -> SpanContext:
    """`SpanContext(...)` for the per-span paths (`state` never None).

    The constructor only fills defaults, computes `is_valid` and builds its tuple; built
    directly it costs 0.17 instead of 0.48 us (three to six per traced request). Done
    only when the installed API's layout is the one checked at import, else the
    constructor."""
    if _DIRECT:
        return _tuple_new(SpanContext, (trace_id, span_id, is_remote, flags, state,
                                        0 < trace_id <= _TRACE_ID_MAX and 0 < span_id <= _SPAN_ID_MAX))
    return SpanContext(trace_id, span_id, is_remote=is_remote, trace_flags=flags, trace_state=state)


def lean_spans_wanted() -> bool:
    return os.environ.get(LEAN_SPANS_ENV, "1").strip().lower() not in {"0", "false", "no", "off"}


class LeanTracer:
    """`start_span` for one SDK provider whose only processor is `processor`."""

    def __init__(self, provider: Any, processor: Any, name: str, version: str | None = None):
        self._provider = provider
        self._processor = processor
        self._sampler = provider.sampler
        self._ids = provider.id_generator
        self._random_ids = bool(getattr(self._ids, "is_trace_id_random", lambda: False)())
        self.resource = provider.resource
        self.instrumentation_scope = InstrumentationScope(name, version)
        limits = SpanLimits()  # reads OTEL_SPAN_ATTRIBUTE_* / OTEL_ATTRIBUTE_* as the SDK does
        self.max_attributes = limits.max_span_attributes
        self.max_value_length = limits.max_span_attribute_length
        # How many attributes a span holds before a limit needs looking at (-1: a length
        # limit applies to every value); below it they are stored as they come.
        self.free_attributes = -1 if self.max_value_length is not None else (
            sys.maxsize if self.max_attributes is None else self.max_attributes)
        self._sdk_tracer = provider.get_tracer(name, version)
        self._checked: Any = None  # the provider's processor tuple last found to be ours alone
        self._follows_sampled_parents = _keeps_children_of_sampled_parents(self._sampler)
        self._root_bound = _root_bound(self._sampler)
        # `start_span` may then take the attributes as a function, called only for a span
        # the sampler keeps (a dropped request builds none).
        self.decides_before_attributes = _ignores_attributes(self._sampler)

    def is_current(self) -> bool:
        """Still the provider's only processor (else SDK spans, which reach them all).

        The SDK replaces its processor tuple when one is added, so an identity check
        per span notices a processor added at any time.
        """
        try:
            processors = self._provider._active_span_processor._span_processors
        except Exception:
            return False
        if processors is self._checked:
            return True
        if tuple(processors) == (self._processor,):
            self._checked = processors
            return True
        return False

    def start_span(self, name: str, context: Any = None, kind: SpanKind = SpanKind.INTERNAL,
                   attributes: Mapping[str, Any] | None = None, links: Sequence[Link] | None = None,
                   start_time: int | None = None) -> trace.Span:
        return self._start(name, trace.get_current_span(context).get_span_context(), context, kind,
                           attributes, links, start_time)

    def start_under(self, name: str, parent_span: Any, kind: SpanKind = SpanKind.INTERNAL,
                    attributes: Any = None, links: Sequence[Link] | None = None) -> trace.Span:
        """`start_span` for a parent given as a span (None: a root, whatever the thread's
        current span). Its OTel context is made only where the sampler or the SDK's
        tracer must be given one, not for every span (0.46 us each)."""
        if parent_span is None:
            return self._start(name, None, _ROOT_CONTEXT, kind, attributes, links, None)
        return self._start(name, parent_span.get_span_context(), _LazyContext(parent_span), kind,
                           attributes, links, None)

    def _start(self, name: str, parent: SpanContext | None, context: Any, kind: SpanKind,
               attributes: Any, links: Sequence[Link] | None, start_time: int | None) -> trace.Span:
        # Attributes given as a function are built here for a sampler that may read them,
        # else only once a span is kept (`factory`, called at the exits below).
        factory = None
        if callable(attributes):
            if self.decides_before_attributes:
                factory, attributes = attributes, None
            else:
                attributes = attributes()
        if not self.is_current():  # someone added a processor: theirs may need SDK spans
            return self._sdk_tracer.start_span(
                name, context=_context_of(context), kind=kind, links=links, start_time=start_time,
                attributes=attributes if factory is None else factory())
        links = links or ()
        if parent is None or not parent.is_valid:
            parent = None
            trace_id = self._ids.generate_trace_id()
            random_id = self._random_ids
            bound = self._root_bound
            if bound is not None:
                # What the sampler would answer for a root, without asking it (see
                # `_root_bound`): a dropped request's root then costs its ids only.
                sampled = (trace_id & _TRACE_ID_LIMIT) < bound
                if random_id and _RANDOM:
                    flags = _SAMPLED_RANDOM if sampled else _NOT_SAMPLED_RANDOM
                else:
                    flags = _SAMPLED if sampled else _NOT_SAMPLED
                span_context = new_span_context(trace_id, self._ids.generate_span_id(), False, flags)
                if not sampled:
                    return trace.NonRecordingSpan(span_context)
                return LeanSpan(self, name, span_context, None, kind,
                                attributes if factory is None else factory(), links, start_time)
        else:
            trace_id = parent.trace_id
            random_id = bool(int(parent.trace_flags) & _RANDOM)
            if self._follows_sampled_parents and parent.trace_flags.sampled:
                # What the sampler would answer, without asking it: recorded and
                # sampled, with the parent's trace state.
                flags = _SAMPLED_RANDOM if random_id and _RANDOM else _SAMPLED
                span_context = new_span_context(trace_id, self._ids.generate_span_id(), False, flags,
                                                parent.trace_state)
                return LeanSpan(self, name, span_context, parent, kind,
                                attributes if factory is None else factory(), links, start_time)
        result = self._sampler.should_sample(_context_of(context), trace_id, name, kind, attributes,
                                             links)
        flags = _SAMPLED if result.decision.is_sampled() else _NOT_SAMPLED
        if random_id and _RANDOM:
            flags = TraceFlags(flags | _RANDOM)
        span_context = SpanContext(trace_id, self._ids.generate_span_id(), is_remote=False,
                                   trace_flags=flags, trace_state=result.trace_state)
        if not result.decision.is_recording():
            return trace.NonRecordingSpan(span_context)
        return LeanSpan(self, name, span_context, parent, kind,
                        result.attributes if factory is None else factory(), links, start_time)


_ROOT_CONTEXT = otel_context.Context()  # (contexts are immutable: one serves every root)


class _LazyContext:
    """A parent given as a span: made the OTel context it stands for only if asked."""

    __slots__ = ("span",)

    def __init__(self, span: Any) -> None:
        self.span = span


def _context_of(context: Any) -> Any:
    return trace.set_span_in_context(context.span) if type(context) is _LazyContext else context


def _sdk_parent_based(sampler: Any) -> bool:
    """The SDK's own parent-based sampler: `ParentBased`, or the `ParentBasedTraceIdRatio`
    that `OTEL_TRACES_SAMPLER=parentbased_traceidratio` makes (it only builds the root
    delegate). A user's subclass may decide otherwise, so it is asked."""
    from opentelemetry.sdk.trace.sampling import ParentBased, ParentBasedTraceIdRatio

    return type(sampler) in (ParentBased, ParentBasedTraceIdRatio)


def _keeps_children_of_sampled_parents(sampler: Any) -> bool:
    """The SDK's parent-based sampler with its default delegates for a sampled parent
    (`ALWAYS_ON`, local and remote): it then records and samples every child of a
    sampled parent (the default `parentbased_always_on`, and `parentbased_traceidratio`)."""
    from opentelemetry.sdk.trace.sampling import ALWAYS_ON

    return (_sdk_parent_based(sampler)
            and getattr(sampler, "_remote_parent_sampled", None) is ALWAYS_ON
            and getattr(sampler, "_local_parent_sampled", None) is ALWAYS_ON)


def _root_bound(sampler: Any) -> int | None:
    """For the SDK's built-in samplers, the bound a root span's trace id (its low 64
    bits) must stay under to be sampled; None for any other sampler (then asked).

    `always_on` keeps every root, `always_off` none, `traceidratio` those under its
    bound; a parent-based sampler decides a root with its root delegate. None of them
    adds a trace state to a root, and each keeps (records and samples) or drops.
    """
    from opentelemetry.sdk.trace.sampling import Decision, StaticSampler, TraceIdRatioBased

    if _sdk_parent_based(sampler):
        sampler = getattr(sampler, "_root", None)
    if type(sampler) is TraceIdRatioBased:
        return int(sampler.bound)
    if type(sampler) is StaticSampler:
        decision = getattr(sampler, "_decision", None)
        if decision is Decision.RECORD_AND_SAMPLE:
            return _TRACE_ID_LIMIT + 1
        if decision is Decision.DROP:
            return 0
    return None


def _ignores_attributes(sampler: Any) -> bool:
    """The SDK's built-in samplers decide without looking at a span's attributes (and
    hand back exactly those they were given); a custom one may look at them."""
    from opentelemetry.sdk.trace.sampling import StaticSampler, TraceIdRatioBased

    if type(sampler) in (StaticSampler, TraceIdRatioBased):
        return True
    if _sdk_parent_based(sampler):
        delegates = [getattr(sampler, name, None) for name in (
            "_root", "_remote_parent_sampled", "_remote_parent_not_sampled",
            "_local_parent_sampled", "_local_parent_not_sampled")]
        return all(d is not None and _ignores_attributes(d) for d in delegates)
    return False


class LeanSpan(trace.Span):
    """A recording span that goes to its tracer's batch processor when it ends."""

    __slots__ = (
        "_attributes",
        "_events",
        "_links",
        "_tracer",
        "context",
        "dropped_attributes",
        "end_time",
        "kind",
        "name",
        "parent",
        "start_time",
        "status",
    )

    dropped_events = 0
    dropped_links = 0

    def __init__(self, tracer: LeanTracer, name: str, context: SpanContext,
                 parent: SpanContext | None, kind: SpanKind,
                 attributes: Mapping[str, Any] | None, links: Sequence[Link],
                 start_time: int | None) -> None:
        self._tracer = tracer
        self.name = name
        self.context = context
        self.parent = parent
        self.kind = kind
        self.start_time = start_time if start_time is not None else time.time_ns()
        self.end_time: int | None = None
        self.dropped_attributes = 0
        self._events: list[Event] = []
        self._links = tuple(links)
        self.status = _UNSET
        if not attributes:
            self._attributes: dict[str, Any] = {}
        elif len(attributes) <= tracer.free_attributes:
            self._attributes = dict(attributes)  # (the usual case, as in `_put`)
        else:
            self._attributes = {}
            self._put(attributes)

    # -- what exporters read (ReadableSpan's properties) ---------------------
    @property
    def attributes(self) -> Mapping[str, Any]:
        return self._attributes

    @property
    def events(self) -> Sequence[Event]:
        return self._events

    @property
    def links(self) -> Sequence[Link]:
        return self._links

    @property
    def resource(self) -> Any:
        return self._tracer.resource

    @property
    def instrumentation_scope(self) -> InstrumentationScope:
        return self._tracer.instrumentation_scope

    # -- the recording side (opentelemetry.trace.Span) ------------------------
    def get_span_context(self) -> SpanContext:
        return self.context

    def is_recording(self) -> bool:
        return self.end_time is None

    def _put(self, attributes: Mapping[str, Any]) -> None:
        """Store attributes under the SDK's limits (count: the oldest is dropped; string length)."""
        attrs = self._attributes
        if len(attrs) + len(attributes) <= self._tracer.free_attributes:
            attrs.update(attributes)  # (the usual case: under the count limit, no length limit)
            return
        limit, length = self._tracer.max_attributes, self._tracer.max_value_length
        for key, value in attributes.items():
            if length is not None and isinstance(value, str) and len(value) > length:
                value = value[:length]
            if key not in attrs and limit is not None and len(attrs) >= limit:
                self.dropped_attributes += 1
                if not limit:
                    continue
                del attrs[next(iter(attrs))]  # as the SDK: the oldest goes
            attrs[key] = value

    def set_attributes(self, attributes: Mapping[str, Any]) -> None:
        with _LOCK:
            if self.end_time is None:
                self._put(attributes)

    def set_attribute(self, key: str, value: Any) -> None:
        attrs = self._attributes
        with _LOCK:
            if self.end_time is not None:
                return
            # (The usual case, as in `_put`; a key already there adds no attribute.)
            if len(attrs) - (key in attrs) < self._tracer.free_attributes:
                attrs[key] = value
            else:
                self._put({key: value})

    def add_event(self, name: str, attributes: Mapping[str, Any] | None = None,
                  timestamp: int | None = None) -> None:
        with _LOCK:
            if self.end_time is None:
                self._events.append(Event(name, dict(attributes or {}),
                                          timestamp if timestamp is not None else time.time_ns()))

    def add_link(self, context: SpanContext, attributes: Mapping[str, Any] | None = None) -> None:
        with _LOCK:
            if self.end_time is None and context.is_valid:
                self._links = (*self._links, Link(context, dict(attributes or {})))

    def update_name(self, name: str) -> None:
        with _LOCK:
            if self.end_time is None:
                self.name = name

    def set_status(self, status: Status | StatusCode, description: str | None = None) -> None:
        # As the SDK: OK is final, UNSET never overwrites.
        if not isinstance(status, Status):
            status = Status(status, description)
        with _LOCK:
            if self.end_time is None and self.status.status_code is not StatusCode.OK \
                    and status.status_code is not StatusCode.UNSET:
                self.status = status

    def record_exception(self, exception: BaseException, attributes: Mapping[str, Any] | None = None,
                         timestamp: int | None = None, escaped: bool = False) -> None:
        attrs = {"exception.type": type(exception).__name__,
                 "exception.message": str(exception),
                 "exception.stacktrace": "".join(traceback.format_exception(
                     type(exception), exception, exception.__traceback__)),
                 "exception.escaped": str(escaped)}
        attrs.update(attributes or {})
        self.add_event("exception", attrs, timestamp)

    def end(self, end_time: int | None = None) -> None:
        with _LOCK:
            if self.end_time is not None:
                return
            self.end_time = end_time if end_time is not None else time.time_ns()
        self._tracer._processor.on_end(self)

    def __repr__(self) -> str:
        return f"LeanSpan({self.name!r}, span_id={self.context.span_id:016x})"

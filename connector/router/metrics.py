"""The router's own Prometheus metrics: requests by outcome, legs, client TTFT, in flight.

One `RouterMetrics` per app, on its own `CollectorRegistry` (an embedding process keeps its
global registry to itself; tests read one app's samples). Every series of every closed label
combination exists at 0 from start-up, so `rate()` and the exact range change see the first
event. A request's figures go through one `RequestRecord`, which counts each thing once
whatever path the request takes. Telemetry never fails a request: every update is guarded,
and the first failure of each kind is logged at WARNING.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import choose_encoder

from connector import vocabulary as V
from connector.vocabulary import LegCancel, LegOutcome, MetricSpec, RouterLeg, RouterOutcome

_LOG = logging.getLogger("connector.router.metrics")
_warned: set[str] = set()


def _guarded(what: str, fn: Callable[[], Any]) -> None:
    """Run one telemetry update; a failure is logged once per kind and never raised."""
    try:
        fn()
    except Exception as exc:  # telemetry must not reach the request
        if what not in _warned:
            _warned.add(what)
            _LOG.warning("router telemetry lost (%s): %s: %s", what, type(exc).__name__, exc)


def _combos(spec: MetricSpec) -> list[tuple[str, ...]]:
    """Every closed combination of the spec's label values."""
    combos: list[tuple[str, ...]] = [()]
    for label in spec.labels:
        combos = [(*c, v) for c in combos for v in V.allowed_values(spec.name, label)]
    return combos


class RouterMetrics:
    """The router's metric objects, created from the vocabulary's specs."""

    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.requests = Counter(V.ROUTER_REQUESTS.name, V.ROUTER_REQUESTS.help,
                                V.ROUTER_REQUESTS.labels, registry=r)
        self.in_flight = Gauge(V.ROUTER_REQUESTS_IN_FLIGHT.name, V.ROUTER_REQUESTS_IN_FLIGHT.help,
                               V.ROUTER_REQUESTS_IN_FLIGHT.labels, registry=r)
        self.ttft = Histogram(V.ROUTER_TTFT.name, V.ROUTER_TTFT.help, V.ROUTER_TTFT.labels,
                              buckets=V.ROUTER_TTFT.buckets, registry=r)
        self.leg_duration = Histogram(V.ROUTER_LEG_DURATION.name, V.ROUTER_LEG_DURATION.help,
                                      V.ROUTER_LEG_DURATION.labels, buckets=V.ROUTER_LEG_DURATION.buckets,
                                      registry=r)
        self.legs_cancelled = Counter(V.ROUTER_LEGS_CANCELLED.name, V.ROUTER_LEGS_CANCELLED.help,
                                      V.ROUTER_LEGS_CANCELLED.labels, registry=r)
        made = ((self.requests, V.ROUTER_REQUESTS), (self.in_flight, V.ROUTER_REQUESTS_IN_FLIGHT),
                (self.ttft, V.ROUTER_TTFT), (self.leg_duration, V.ROUTER_LEG_DURATION),
                (self.legs_cancelled, V.ROUTER_LEGS_CANCELLED))
        for metric, spec in made:
            for combo in _combos(spec):
                metric.labels(*combo)

    def start(self, route: str, clock: Callable[[], float] = time.monotonic) -> RequestRecord:
        """A request arrived on `route` (one of vocabulary.ROUTER_ROUTES)."""
        return RequestRecord(self, route, clock)

    def exposition(self, accept: str) -> tuple[bytes, str]:
        """The registry in the format the scraper asks for (OpenMetrics carries the exemplars)."""
        encoder, content_type = choose_encoder(accept)
        return encoder(self.registry), content_type


def _exemplar(span: Any) -> dict[str, str] | None:
    """{trace_id, span_id} of a recording span, for an OpenMetrics exemplar."""
    if span is None:
        return None
    ctx = span.get_span_context()
    if not ctx.is_valid or not ctx.trace_flags.sampled:
        return None
    return {V.EXEMPLAR_TRACE_ID: f"{ctx.trace_id:032x}", V.EXEMPLAR_SPAN_ID: f"{ctx.span_id:016x}"}


class RequestRecord:
    """One client request's figures; each of them is recorded at most once."""

    def __init__(self, metrics: RouterMetrics, route: str, clock: Callable[[], float]):
        self.metrics, self.route, self.clock = metrics, route, clock
        self.arrived = clock()
        self.stream = False
        self.span: Any = None  # router.request, for the TTFT exemplar
        self.outcome: RouterOutcome | None = None
        self._first_token = False
        self._legs: dict[RouterLeg, float] = {}  # leg -> when it was sent
        self._legs_done: set[RouterLeg] = set()
        self._leg_spans: dict[RouterLeg, Any] = {}
        self._in_flight = False
        _guarded("in_flight", self._enter)

    def _enter(self) -> None:
        self.metrics.in_flight.labels(self.route).inc()
        self._in_flight = True

    # ------------------------------------------------------------------ legs
    def leg_sent(self, leg: RouterLeg, span: Any = None) -> None:
        self._legs.setdefault(leg, self.clock())
        self._leg_spans[leg] = span

    def leg_done(self, leg: RouterLeg, outcome: LegOutcome) -> None:
        """The leg answered, failed or was cancelled (its first report wins)."""
        if leg not in self._legs or leg in self._legs_done:
            return
        self._legs_done.add(leg)
        seconds = self.clock() - self._legs[leg]
        exemplar = _exemplar(self._leg_spans.get(leg))
        _guarded("leg_duration", lambda: self.metrics.leg_duration.labels(leg.value, outcome.value)
                 .observe(seconds, exemplar))

    def leg_cancelled(self, leg: RouterLeg, reason: LegCancel) -> None:
        """The router stopped a leg still in flight; counted only if it had not ended."""
        if leg not in self._legs or leg in self._legs_done:
            return
        _guarded("legs_cancelled", lambda: self.metrics.legs_cancelled.labels(leg.value, reason.value).inc())
        self.leg_done(leg, LegOutcome.CANCELLED)

    def open_legs(self) -> list[RouterLeg]:
        return [leg for leg in self._legs if leg not in self._legs_done]

    # ------------------------------------------------------------------ the request
    def first_token(self) -> None:
        """The client got its first token (streamed: D's first event; else the whole answer)."""
        if self._first_token:
            return
        self._first_token = True
        seconds = self.clock() - self.arrived
        exemplar = _exemplar(self.span)
        _guarded("ttft", lambda: self.metrics.ttft.labels(self.route, V.bool_label(self.stream))
                 .observe(seconds, exemplar))
        if self.span is not None:
            _guarded("ttft_attribute", lambda: self.span.set_attribute(V.RouterAttr.TTFT, seconds))

    def finish(self, outcome: RouterOutcome) -> None:
        """The request ended; the first outcome reported is the one counted."""
        if self.outcome is not None:
            return
        self.outcome = outcome
        _guarded("requests", lambda: self.metrics.requests.labels(self.route, outcome.value).inc())
        self.release()

    def release(self) -> None:
        """Leave the in-flight count (also on a path that counted no outcome)."""
        if self._in_flight:
            self._in_flight = False
            _guarded("in_flight", lambda: self.metrics.in_flight.labels(self.route).dec())

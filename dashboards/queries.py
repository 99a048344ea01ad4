"""PromQL built from `connector.vocabulary`: series names, label matchers, quantiles and
the exact range change the headline panels use.

Panels (dashboards/panels.py) and rules (dashboards/rules.py) compose their queries from
these helpers only, so a matcher can hold only a value the vocabulary allows.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from connector import vocabulary as V
from connector.vocabulary import Label, MetricKind, MetricSpec

RATE = "$__rate_interval"
RANGE = "$__range"
# Every panel query is scoped by the dashboard variables its metric carries (multi-value,
# hence =~): engine metrics by all four, the router's (no model_name, no engine) by the
# scrape target's two, as vLLM's own dashboards scope its HTTP metrics.
SCOPE = ('job=~"$job"', 'model_name=~"$model_name"', 'instance=~"$instance"', 'engine=~"$engine"')
TARGET_SCOPE = ('job=~"$job"', 'instance=~"$instance"')
# Labels Prometheus or vLLM put on every engine series, besides the vocabulary's own.
BASE_LABELS = frozenset({"job", "instance", Label.MODEL_NAME, Label.ENGINE})
TARGET_LABELS = frozenset({"job", "instance"})
# What the rules aggregate by: one alert or recorded series per engine.
INSTANCE = ("job", "instance", Label.MODEL_NAME, Label.ENGINE)
FLAVOR = (Label.DIRECTION, Label.NOTIF_AGENTS_ONLY)


def all_specs() -> tuple[MetricSpec, ...]:
    """Every metric a query may select: ours, the stock vLLM NIXL metrics we keep, vLLM's
    TTFT, the router's, NIXL's own exporter's and the info metric that joins it to ours."""
    return (V.ALL_METRICS + V.STOCK_METRICS + V.VLLM_REQUEST_METRICS + V.ROUTER_METRICS
            + (V.NIXL_AGENT_INFO,) + V.NIXL_EXPORTER_METRICS)


def series_index() -> dict[str, MetricSpec]:
    """Series name (as stored by Prometheus) -> its metric spec."""
    return {series: spec for spec in all_specs() for series in spec.series_names}


def is_router(spec: MetricSpec) -> bool:
    return spec in V.ROUTER_METRICS


def is_nixl_exporter(spec: MetricSpec) -> bool:
    """NIXL's own series: another scrape target, reached through the agent info join."""
    return spec in V.NIXL_EXPORTER_METRICS


def base_labels(spec: MetricSpec | None) -> frozenset[str]:
    """Labels a series has besides its vocabulary labels (None: any series, engine or router)."""
    return TARGET_LABELS if spec is not None and (is_router(spec) or is_nixl_exporter(spec)) \
        else BASE_LABELS


def scope_of(series: str) -> tuple[str, ...]:
    """The dashboard-variable matchers a series can be scoped by."""
    spec = series_index().get(series)
    if spec is not None and is_nixl_exporter(spec):
        return ()  # (scoped by the join to the engine's agent info, which is)
    return TARGET_SCOPE if spec is not None and is_router(spec) else SCOPE


def total(spec: MetricSpec) -> str:
    assert spec.kind is MetricKind.COUNTER, spec.name
    return spec.series_names[0]


def bucket(spec: MetricSpec) -> str:
    assert spec.kind is MetricKind.HISTOGRAM, spec.name
    return spec.name + "_bucket"


def hcount(spec: MetricSpec) -> str:
    assert spec.kind is MetricKind.HISTOGRAM, spec.name
    return spec.name + "_count"


def hsum(spec: MetricSpec) -> str:
    assert spec.kind is MetricKind.HISTOGRAM, spec.name
    return spec.name + "_sum"


def gauge(spec: MetricSpec) -> str:
    assert spec.kind is MetricKind.GAUGE, spec.name
    return spec.name


def allowed_label_values(label: str) -> set[str]:
    """Every value `label` may take on any metric (per-metric sets included)."""
    return set(V.LABEL_VALUES[label]).union(
        *(values for (_, lab), values in V.METRIC_LABEL_VALUES.items() if lab == label))


def _checked(label: str, value: object) -> str:
    text = str(value)
    allowed = allowed_label_values(label)
    if text not in allowed:
        raise ValueError(f"{label}={text!r} is not in the vocabulary ({sorted(allowed)})")
    return text


def eq(label: str, value: object) -> str:
    """An exact label matcher; the value must be one the vocabulary allows."""
    return f'{label}="{_checked(label, value)}"'


def one_of(label: str, *values: object) -> str:
    """A matcher for several literal values (`label=~"a|b"`), each one the vocabulary's."""
    return f'{label}=~"{"|".join(_checked(label, v) for v in values)}"'


def sel(series: str, *matchers: str, scoped: bool = True) -> str:
    parts = (*scope_of(series), *matchers) if scoped else matchers
    return series + "{" + ",".join(parts) + "}" if parts else series


def by(*labels: str) -> str:
    return "by (" + ", ".join(labels) + ")"


def range_change(selector: str) -> str:
    """A counter's exact change over the dashboard range, per series, without extrapolation.

    `increase(x[$__range])` extrapolates from the first and last samples to the range's
    edges, so it reads more than the counter moved. This is the value at the range's end minus the
    value at its start; a series born inside the range counts from 0 (the connector and
    vLLM create theirs at 0 per engine), and a series reset inside the range (a restart)
    counts from the reset instead of going negative.
    """
    return f"(({selector} - {selector} offset {RANGE}) >= 0 or {selector})"


def quantile(q: float, spec: MetricSpec, labels: Iterable[str], window: str, *matchers: str,
             scoped: bool = True, drop_nan: bool = True, multiline: bool = False) -> str:
    """histogram_quantile over rate of _bucket; `>= 0` drops the NaN of idle windows."""
    inner = f"rate({sel(bucket(spec), *matchers, scoped=scoped)}[{window}])"
    start, end = ("\n  ", "\n") if multiline else (" ", "")
    expr = f"histogram_quantile({q},{start}sum {by('le', *labels)} ({inner}){end})"
    return expr + " >= 0" if drop_nan else expr


LITERAL_ALTERNATIVES = re.compile(r"[A-Za-z0-9_.:-]+(\|[A-Za-z0-9_.:-]+)*")

D_TO_P = eq(Label.DIRECTION, V.Direction.D_TO_P)
NOTIF_ONLY = eq(Label.NOTIF_AGENTS_ONLY, V.bool_label(True))
FULL = eq(Label.NOTIF_AGENTS_ONLY, V.bool_label(False))
FAILURE = eq(Label.OUTCOME, V.Outcome.FAILURE)
QUEUE_WAIT = eq(Label.PHASE, V.Phase.QUEUE_WAIT)
RECEIVE_SUCCESS = eq(Label.OUTCOME, V.ReceiveOutcome.SUCCESS)
NOT_SUCCESS = f'{Label.OUTCOME}!="{V.ReceiveOutcome.SUCCESS.value}"'
# A lease expired while a decoder still wanted its request (heartbeated for it, or registered).
STILL_WANTED = one_of(Label.FATE, V.LeaseFate.WAITING, V.LeaseFate.REGISTERED)
UNKNOWN_REQUEST = eq(Label.OUTCOME, V.LeaseRenewal.UNKNOWN_REQUEST)
RENEWED = eq(Label.OUTCOME, V.LeaseRenewal.RENEWED)
ROUTER_OK = eq(Label.OUTCOME, V.RouterOutcome.OK)
# The labels one engine's series share (vLLM's TTFT joins our KV wait on them).
ENGINE_KEY = "on (" + ", ".join(INSTANCE) + ")"


def on_decoders(expr: str, kv_wait_count: str) -> str:
    """`expr` (per engine) kept only for engines whose KV waits `kv_wait_count` moved: the
    decode engines (a prefill engine's vLLM TTFT is its own prefill, not a decoder's)."""
    return f"({expr} and {ENGINE_KEY} ({kv_wait_count} > 0))"
LEG_OK = eq(Label.OUTCOME, V.LegOutcome.OK)

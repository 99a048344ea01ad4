"""Just enough PromQL reading to check queries against the vocabulary.

Not a parser: it finds the metric names a query selects, the label matchers attached
to each selector, the labels of `by (...)`/`on (...)` clauses, the range of every
`[...]` and every `offset`. Real Prometheus parses the queries in
`tests/test_prometheus_real.py`; this module only has to be right about names, so
dashboards and rules cannot drift from `connector.vocabulary`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

FUNCTIONS = frozenset({
    "abs", "absent", "absent_over_time", "avg_over_time", "ceil", "changes", "clamp", "clamp_max",
    "clamp_min", "count_over_time", "day_of_month", "day_of_week", "day_of_year", "days_in_month",
    "delta", "deriv", "exp", "floor", "group_over_time", "histogram_avg", "histogram_count",
    "histogram_fraction", "histogram_quantile", "histogram_stddev", "histogram_stdvar",
    "histogram_sum", "holt_winters", "hour", "idelta", "increase", "irate", "label_join",
    "label_replace", "last_over_time", "ln", "log10", "log2", "max_over_time", "min_over_time",
    "minute", "month", "predict_linear", "present_over_time", "quantile_over_time", "rate",
    "resets", "round", "scalar", "sgn", "sort", "sort_desc", "sqrt", "stddev_over_time",
    "stdvar_over_time", "sum_over_time", "time", "timestamp", "vector", "year",
})
AGGREGATIONS = frozenset({
    "sum", "min", "max", "avg", "group", "stddev", "stdvar", "count", "count_values", "bottomk",
    "topk", "quantile",
})
KEYWORDS = frozenset({"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and",
                      "or", "unless", "offset", "atan2", "inf", "nan"})
# Functions whose argument is a range vector: the window must be a dashboard interval.
RANGE_FUNCTIONS = frozenset({"rate", "irate", "increase", "delta", "idelta", "deriv", "changes",
                             "resets"})

_STRING = re.compile(r'"(?:\\.|[^"\\])*"|\'(?:\\.|[^\'\\])*\'')
_IDENT = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")
_SELECTOR = re.compile(r"([A-Za-z_:][A-Za-z0-9_:]*)?\s*\{([^}]*)\}")
_MATCHER = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)\s*(=~|!~|!=|=)\s*"((?:\\.|[^"\\])*)"')
_GROUPING = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)")
_RANGE = re.compile(r"\[([^\]]*)\]")
_NUMBER = re.compile(r"(?<![A-Za-z0-9_:$])\d+(?:\.\d+)?(?:[eE][+-]?\d+)?(?:ms|s|m|h|d|w|y)?")
_RANGE_CALL = re.compile(r"\b(" + "|".join(sorted(RANGE_FUNCTIONS)) + r")\s*\(")
_OFFSET = re.compile(r"\boffset\s+(-?[$\w{}]+)")


@dataclass(frozen=True)
class Matcher:
    metric: str  # "" when the selector has no metric name
    label: str
    op: str
    value: str


class PromQLError(ValueError):
    """A query this module cannot make sense of (unknown function, bad syntax)."""


def _blank_strings(expr: str) -> str:
    return _STRING.sub('""', expr)


def metric_names(expr: str) -> set[str]:
    """Metric (series) names the expression selects."""
    text = _blank_strings(expr)
    text = _OFFSET.sub(" ", text)
    text = _RANGE.sub(" ", text)
    text = re.sub(r"\{[^}]*\}", " ", text)
    text = _GROUPING.sub(" ", text)
    text = _NUMBER.sub(" ", text)
    names: set[str] = set()
    for match in _IDENT.finditer(text):
        token = match.group()
        if token in KEYWORDS:
            continue
        if text[match.end():].lstrip().startswith("("):
            if token not in FUNCTIONS and token not in AGGREGATIONS:
                raise PromQLError(f"unknown PromQL function {token!r} in {expr!r}")
            continue
        names.add(token)
    return names


def matchers(expr: str) -> list[Matcher]:
    """Every label matcher, with the metric name of its selector."""
    out = []
    for sel in _SELECTOR.finditer(expr):
        metric = sel.group(1) or ""
        if metric in KEYWORDS or metric in FUNCTIONS or metric in AGGREGATIONS:
            metric = ""
        for m in _MATCHER.finditer(sel.group(2)):
            out.append(Matcher(metric, m.group(1), m.group(2), m.group(3)))
    return out


def grouping_labels(expr: str) -> set[str]:
    """Labels named in by/without/on/ignoring/group_left/group_right clauses."""
    labels: set[str] = set()
    for clause in _GROUPING.finditer(_blank_strings(expr)):
        labels.update(x.strip() for x in clause.group(2).split(",") if x.strip())
    return labels


def range_calls(expr: str) -> list[tuple[str, str]]:
    """(function, window) of every range-vector call, e.g. ("rate", "$__rate_interval")."""
    text = _blank_strings(expr)
    calls = []
    for call in _RANGE_CALL.finditer(text):
        tail = text[call.end():]
        depth, i = 1, 0
        while i < len(tail) and depth:
            depth += {"(": 1, ")": -1}.get(tail[i], 0)
            i += 1
        inner = _RANGE.findall(tail[:i])
        if not inner:
            raise PromQLError(f"{call.group(1)}() without a range in {expr!r}")
        calls.append((call.group(1), inner[-1].split(":")[0].strip()))
    return calls


def offsets(expr: str) -> list[str]:
    """The duration of every `offset` modifier, e.g. "$__range" or "15m"."""
    return _OFFSET.findall(_blank_strings(expr))


def variables(expr: str) -> set[str]:
    """Grafana variables ($name or ${name}) the expression uses."""
    return set(re.findall(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)", expr))

"""What the demo prints after its requests, read from the running systems.

Engine `/metrics` (vLLM's own endpoint, our metrics on it), the router's `/metrics`,
Prometheus' API (rule states, phase medians, quantiles, exemplars) and the OTLP receiver
(trace trees). Nothing here
is computed from the demo's own bookkeeping, except the output check.
"""

from __future__ import annotations

import contextlib
import re
import statistics
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from prometheus_client.parser import text_string_to_metric_families as parse_text

from connector.vocabulary import (
    DESCRIPTOR_REGISTRATIONS,
    DESCRIPTORS_REGISTERED,
    DESCRIPTORS_SAVED,
    HANDSHAKE_PHASE_DURATION,
    HANDSHAKES,
    KV_DIGEST_DURATION,
    KV_VERIFY,
    NIXL_AGENT_INFO,
    NIXL_TX_BYTES,
    NIXL_TX_LAST_BYTES,
    NIXL_TX_REQUESTS,
    PUSH_REG_NOTIFS,
    PUSHES,
    ROUTER_LEG_DURATION,
    ROUTER_LEGS_CANCELLED,
    ROUTER_REQUESTS,
    ROUTER_TTFT,
    SPAN_HANDSHAKE,
    SPAN_PHASE_PREFIX,
    SPAN_PUSH_RECEIVE,
    SPAN_PUSH_WRITE,
    SPAN_ROUTER_REQUEST,
    TTFT_JOIN_TOLERANCE_S,
    TTFT_JOIN_TOLERANCE_SHARE,
    TTFT_ROUTER_SHARE_MAX_S,
    TTFT_ROUTER_SHARE_MIN_S,
    TTFT_ROUTER_SHARE_SHARE,
    VLLM_BYTES_TRANSFERRED,
    VLLM_E2E_ATTR,
    VLLM_EXTERNAL_PROMPT_TOKENS,
    VLLM_REQUEST_SPAN,
    VLLM_TTFT_ATTR,
    AgentLabel,
    Attr,
    Label,
    LegOutcome,
    RouterAttr,
    RouterLabel,
    RouterLeg,
    RouterOutcome,
    SpanEvent,
)
from dashboards import panels
from dashboards.promrun import PrometheusServer, evaluate_dashboard
from demo.drive import Outcome
from harness.poll import PollTimeout, wait_until

Sample = tuple[str, dict[str, str], float]


def samples(exposition: str) -> list[Sample]:
    """(sample name, labels, value) of a Prometheus text exposition."""
    return [(s.name, dict(s.labels), float(s.value))
            for fam in parse_text(exposition) for s in fam.samples]


class MissingSeries(LookupError):
    """No sample of that name and labels: a renamed metric or label would otherwise read 0."""


def total(data: Iterable[Sample], name: str, *, missing_ok: bool = False, **labels: str) -> float:
    """The sum of the samples of `name` with `labels`; raises MissingSeries when there is
    none (unless `missing_ok`: a series that may rightly not exist yet)."""
    matched = [v for n, lab, v in data if n == name and all(lab.get(k) == x for k, x in labels.items())]
    if not matched and not missing_ok:
        raise MissingSeries(f"no sample {name}{labels or ''} on /metrics")
    return sum(matched)


_EXEMPLAR = re.compile(r'^(?P<name>[^{\s]+)(?:\{(?P<labels>[^}]*)\})?\s+\S+\s+#\s+\{(?P<ex>[^}]*)\}')
_PAIR = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')


def exemplars(openmetrics: str) -> list[tuple[str, dict[str, str], str]]:
    """(sample name, labels, trace_id) for every exemplar carrying a trace id.

    Read line by line (`name{labels} value # {trace_id="..."} value [ts]`): the strict
    OpenMetrics parser rejects vLLM's whole exposition over unrelated families.
    """
    out = []
    for line in openmetrics.splitlines():
        m = _EXEMPLAR.match(line)
        if m is None:
            continue
        ex = dict(_PAIR.findall(m.group("ex")))
        if "trace_id" in ex:
            out.append((m.group("name"), dict(_PAIR.findall(m.group("labels") or "")), ex["trace_id"]))
    return out


@dataclass(frozen=True)
class Witness:
    """One engine's byte and WRITE counts as its /metrics reports them (vLLM's per-transfer
    telemetry), beside NIXL's own exporter's for the same agents (joined by the engine's
    `vllm:nixl_push_agent_info`)."""

    agents: tuple[str, ...]  # the engine's agents, from its info metric
    engine_bytes: float
    engine_writes: float
    nixl_bytes: float
    nixl_requests: float
    last_write_bytes: float  # NIXL's size of the agents' latest transfer (agent_tx_last_bytes)

    def agrees(self) -> bool:
        """Every agent joined, and the two witnesses count the same bytes and transfers."""
        return bool(self.agents) and (self.engine_bytes, self.engine_writes) == (
            self.nixl_bytes, self.nixl_requests)

    def line(self, name: str) -> str:
        verdict = "equal" if self.agrees() else "DIFFERENT"
        return (f"{name} bytes sent: engine {self.engine_bytes:,.0f} (vllm:nixl_bytes_transferred), NIXL's "
                f"own exporter {self.nixl_bytes:,.0f} (agent_tx_bytes_total); transfers: engine "
                f"{self.engine_writes:.0f}, NIXL {self.nixl_requests:.0f}: {verdict} "
                f"({len(self.agents)} agent(s) joined)")


def witness(engine: list[Sample], nixl: list[Sample]) -> Witness:
    """The witness for one engine from its /metrics and its NIXL exporter's."""
    agents = tuple(sorted({lab[AgentLabel.AGENT_NAME] for n, lab, v in engine
                           if n == NIXL_AGENT_INFO.name and v == 1}))

    def nixl_total(name: str) -> float:
        return sum(v for n, lab, v in nixl if n == name and lab.get(AgentLabel.AGENT_NAME) in agents)

    return Witness(agents,
                   total(engine, VLLM_BYTES_TRANSFERRED.name + "_sum"),
                   total(engine, VLLM_BYTES_TRANSFERRED.name + "_count"),
                   nixl_total(NIXL_TX_BYTES.series_names[0]), nixl_total(NIXL_TX_REQUESTS.series_names[0]),
                   nixl_total(NIXL_TX_LAST_BYTES))


def wait_witness(server: Any, timeout_s: float = 30.0) -> Witness:
    """The engine's witness once both sides agree (the engine's count reaches /metrics a
    step after NIXL's: the last WRITE's stats travel with the next step), or as last seen
    when they do not within `timeout_s`."""
    seen: list[Witness] = []

    def agreed() -> bool:
        seen[:] = [witness(samples(server.metrics()), samples(server.nixl_metrics()))]
        return seen[0].agrees()

    with contextlib.suppress(PollTimeout):
        wait_until(agreed, "the engine's and NIXL's counts to agree", timeout_s, 0.5)
    return seen[0]


def _pct(part: float, whole: float) -> str:
    return f"{100 * part / whole:.0f}%" if whole else "n/a"


def handshake_lines(data: list[Sample], d_log: str) -> list[str]:
    name = HANDSHAKES.name + "_total"
    rows: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for n, lab, v in data:
        if n == name and lab.get(Label.OUTCOME) == "success":
            rows[lab[Label.DIRECTION]][lab[Label.NOTIF_AGENTS_ONLY]] += v
    if not rows:
        plans = d_log.count("Transfer plan")
        return ["no handshake metrics (vLLM's stock connector exports none);",
                f"D's log shows {plans} full D->P handshake(s) "
                "(vLLM logs \"Transfer plan\" only on the full path)"]
    lines = []
    for direction in ("d_to_p", "p_to_d"):
        r = rows.get(direction, {})
        n_all = r.get("true", 0) + r.get("false", 0)
        arrow = "D->P" if direction == "d_to_p" else "P->D"
        lines.append(f"{arrow}: {n_all:.0f} handshake(s), {r.get('true', 0):.0f} notification-only "
                     f"({_pct(r.get('true', 0), n_all)}), {r.get('false', 0):.0f} full")
    return lines


def descriptor_lines(data: list[Sample]) -> list[str]:
    lines = []
    for direction, arrow in (("p_to_d", "P->D"), ("d_to_p", "D->P")):
        regs = total(data, DESCRIPTOR_REGISTRATIONS.name + "_total", direction=direction)
        descs = total(data, DESCRIPTORS_REGISTERED.name + "_total", direction=direction)
        lines.append(f"{arrow}: {regs:.0f} descriptor list(s) prepared, {descs:.0f} descriptors")
    saved = total(data, DESCRIPTORS_SAVED.name + "_total", direction="d_to_p")
    lines.append(f"saved by notification-only D->P: {saved:.0f} descriptors")
    return lines


def push_lines(p: list[Sample], d: list[Sample], outcomes: list[Outcome]) -> list[str]:
    prompt_tokens = sum(len(o.prompt) for o in outcomes if not o.error)
    from_kv = total(d, VLLM_EXTERNAL_PROMPT_TOKENS[0], **VLLM_EXTERNAL_PROMPT_TOKENS[1])
    lines = [f"D prompt tokens that arrived as KV over NIXL: {from_kv:.0f} of {prompt_tokens} sent"]
    if any(n.startswith(PUSHES.name) for n, _, _ in p):
        lines.append(f"P pushes: {total(p, PUSHES.name + '_total', outcome='completed'):.0f} completed, "
                     f"{total(p, PUSHES.name + '_total', outcome='failed'):.0f} failed; D PUSH_REG sent: "
                     f"{total(d, PUSH_REG_NOTIFS.name + '_total', outcome='sent'):.0f}")
    verify = KV_VERIFY.name + "_total"
    if any(n.startswith(KV_VERIFY.name) for n, _, _ in d):
        checked = {o: total(d, verify, outcome=o) for o in ("match", "mismatch", "skipped")}
        digests = total(d, KV_DIGEST_DURATION.name + "_count") + total(p, KV_DIGEST_DURATION.name + "_count")
        seconds = total(d, KV_DIGEST_DURATION.name + "_sum") + total(p, KV_DIGEST_DURATION.name + "_sum")
        mean = f", {seconds / digests * 1e3:.2f} ms per digest" if digests else ""
        lines.append(f"D KV integrity checks: {sum(checked.values()):.0f} ({checked['match']:.0f} matched, "
                     f"{checked['mismatch']:.0f} mismatched, {checked['skipped']:.0f} skipped){mean}")
    xfers = total(p, "vllm:nixl_xfer_time_seconds_count")
    lines.append(f"P NIXL transfers (vLLM's own metric): {xfers:.0f}, "
                 f"{total(p, 'vllm:nixl_bytes_transferred_sum') / 1024:.0f} KiB")
    return lines


def phase_lines(spans: list[dict[str, Any]], prom: PrometheusServer, job: str) -> tuple[str, list[str]]:
    """Per-phase medians: exact, from the phase spans when we have them; else Prometheus means."""
    direction_of = {s["span_id"]: s["attributes"].get(Attr.DIRECTION) for s in spans
                    if s["name"] == SPAN_HANDSHAKE}
    groups: dict[tuple[str, str], list[float]] = defaultdict(list)
    for s in spans:
        if s["name"].startswith(SPAN_PHASE_PREFIX) and Attr.PHASE in s["attributes"]:
            key = (direction_of.get(s["parent_span_id"]) or "?", s["attributes"][Attr.PHASE])
            groups[key].append((s["end"] - s["start"]) / 1e6)
    if groups:
        rows = [(d, p, statistics.median(v), len(v)) for (d, p), v in sorted(groups.items())]
        source = "median of the phase spans received"
    else:
        metric, by = HANDSHAKE_PHASE_DURATION.name, f"{Label.DIRECTION}, {Label.PHASE}"
        expr = (f'sum by ({by}) ({metric}_sum{{job="{job}"}}) / '
                f'sum by ({by}) ({metric}_count{{job="{job}"}}) > -1')  # `> -1` drops NaN (no samples)
        counts = {(r["metric"][Label.DIRECTION], r["metric"][Label.PHASE]): float(r["value"][1])
                  for r in prom.query(f'sum by ({by}) ({metric}_count{{job="{job}"}})')}
        rows = sorted((r["metric"][Label.DIRECTION], r["metric"][Label.PHASE], float(r["value"][1]) * 1e3,
                       int(counts.get((r["metric"][Label.DIRECTION], r["metric"][Label.PHASE]), 0)))
                      for r in prom.query(expr))
        source = "mean from Prometheus (_sum/_count)"
    if not rows:
        return source, ["no handshake phases recorded"]
    out = []
    for direction in sorted({r[0] for r in rows}):
        parts = [f"{phase} {ms:.2f}" for d, phase, ms, _ in rows if d == direction]
        arrow = {"d_to_p": "D->P", "p_to_d": "P->D"}.get(direction, direction)
        out.append(f"{arrow} (ms): " + ", ".join(parts))
    return source, out


def rule_lines(prom: PrometheusServer) -> tuple[list[str], int]:
    """Lines and the number of alerts firing."""
    groups = prom.api("/api/v1/rules", post=False)["data"]["groups"]
    rules = [r for g in groups for r in g["rules"]]
    alerts = [r for r in rules if r["type"] == "alerting"]
    unhealthy = [r["name"] for r in rules if r.get("health") != "ok"]
    firing = [r["name"] for r in alerts if r["state"] == "firing"]
    states = ", ".join(f"{r['name']} {r['state']}" for r in alerts)
    lines = [f"{len(rules)} rules loaded ({len(alerts)} alerts), "
             f"{'all healthy' if not unhealthy else 'unhealthy: ' + ', '.join(unhealthy)}",
             f"alerts firing: {', '.join(firing) if firing else 'none'}",
             f"states: {states}"]
    return lines, len(firing)


def trace_missing(spans: list[dict[str, Any]], trace_id: str, fork: bool) -> set[tuple[str, str]]:
    """(service, span name) of the router, vLLM and (fork) push spans not yet in the trace."""
    got = {(s["service"], s["name"]) for s in spans if s["trace_id"] == trace_id}
    want = {("router", SPAN_ROUTER_REQUEST), ("vllm-prefill", VLLM_REQUEST_SPAN),
            ("vllm-decode", VLLM_REQUEST_SPAN)}
    if fork:
        want |= {("vllm-decode", SPAN_PUSH_RECEIVE), ("vllm-prefill", SPAN_PUSH_WRITE)}
    return want - got


def trace_complete(spans: list[dict[str, Any]], trace_id: str, fork: bool) -> bool:
    """Router span, both engines' llm_request spans and (fork) our push spans."""
    return not trace_missing(spans, trace_id, fork)


def wait_trace(get_spans: Any, trace_id: str, fork: bool, timeout_s: float = 30.0) -> list[dict[str, Any]]:
    """The spans received once the trace is complete, or after `timeout_s` as they are
    (the demo then reports the trace incomplete)."""
    try:
        return wait_until(lambda: (spans := get_spans()) and trace_complete(spans, trace_id, fork) and spans,
                          f"trace {trace_id} to be complete", timeout_s, 0.5)
    except PollTimeout:
        return get_spans()


def prometheus_exemplars(prom: PrometheusServer, start: float, end: float) -> list[tuple[str, str]]:
    """(series name, trace_id) of every exemplar Prometheus stored for our metrics."""
    answer = prom.api("/api/v1/query_exemplars", {"query": '{__name__=~"vllm:nixl_.+"}',
                                                  "start": f"{start:.3f}", "end": f"{end:.3f}"})
    out = []
    for series in answer.get("data") or []:
        for ex in series.get("exemplars", []):
            if "trace_id" in ex.get("labels", {}):
                out.append((series["seriesLabels"].get("__name__", "?"), ex["labels"]["trace_id"]))
    return out


def span_tree(spans: list[dict[str, Any]], trace_id: str) -> list[str]:
    """Indented lines for one trace (children in start order), safe against parent cycles."""
    mine = {s["span_id"]: s for s in spans if s["trace_id"] == trace_id}
    kids: dict[str | None, list[dict[str, Any]]] = defaultdict(list)
    for s in mine.values():
        parent = s["parent_span_id"] if s["parent_span_id"] in mine and s["parent_span_id"] != s["span_id"] \
            else None
        kids[parent].append(s)
    keys = (Attr.NOTIF_AGENTS_ONLY, Attr.DIRECTION, Attr.TRIGGER, Attr.ERROR_TYPE)
    lines: list[str] = []
    seen: set[str] = set()
    stack: list[tuple[dict[str, Any], int]] = [(s, 0) for s in sorted(kids[None], key=lambda x: x["start"],
                                                                       reverse=True)]
    while stack:
        s, depth = stack.pop()
        if s["span_id"] in seen:
            continue
        seen.add(s["span_id"])
        ms = (s["end"] - s["start"]) / 1e6
        attrs = " ".join(f"{k.rsplit('.', 1)[-1]}={s['attributes'][k]}" for k in keys if k in s["attributes"])
        lines.append(f"{'  ' * depth}{s['name']}  [{s['service']}] {ms:.1f} ms {attrs}".rstrip())
        stack += [(c, depth + 1) for c in sorted(kids[s["span_id"]], key=lambda x: x["start"], reverse=True)]
    left = len(mine) - len(seen)
    if left:
        lines.append(f"({left} span(s) in a parent cycle, not shown)")
    return lines


def _quantile(prom: PrometheusServer, q: float, bucket: str, job: str, by: str,
              *matchers: str) -> dict[str, float]:
    """Prometheus' histogram_quantile over a histogram's buckets since the router started
    (the demo's router serves only the demo's requests), by one label."""
    sel = ",".join((f'job="{job}"', *matchers))
    expr = f"histogram_quantile({q}, sum by (le, {by}) ({bucket}{{{sel}}})) >= 0"
    return {r["metric"].get(by, ""): float(r["value"][1]) for r in prom.query(expr)}


def router_lines(data: list[Sample], prom: PrometheusServer, job: str, sent: int) -> tuple[list[str], int]:
    """The router's requests by outcome, client TTFT and leg latencies; (lines, failed checks).

    Counts and means (exact) come from the router's own /metrics; p50/p95 are Prometheus'
    histogram_quantile, interpolated within the router's buckets."""
    outcomes = {o.value: total(data, ROUTER_REQUESTS.series_names[0], outcome=o.value) for o in RouterOutcome}
    lines = ["requests: " + ", ".join(f"{v:.0f} {k}" for k, v in outcomes.items())]
    failed = 0
    if outcomes[RouterOutcome.OK.value] != sent or sum(outcomes.values()) != sent:
        failed += 1
        lines.append(f"CHECK FAILED: the router counted {sum(outcomes.values()):.0f} request(s), "
                     f"{outcomes['ok']:.0f} ok; the demo sent {sent}, all answered")
    ttft = {q: _quantile(prom, q, ROUTER_TTFT.name + "_bucket", job, RouterLabel.STREAM) for q in (0.5, 0.95)}
    for stream in sorted(ttft[0.5]):
        n = total(data, ROUTER_TTFT.name + "_count", stream=stream)
        mean = total(data, ROUTER_TTFT.name + "_sum", stream=stream) / n if n else 0.0
        kind = "streamed: first event" if stream == "true" else "not streamed: the whole answer"
        lines.append(f"client TTFT ({kind}, {n:.0f} requests): p50 {ttft[0.5][stream] * 1e3:.0f} ms, "
                     f"p95 {ttft[0.95][stream] * 1e3:.0f} ms, mean {mean * 1e3:.0f} ms")
    legs = {q: _quantile(prom, q, ROUTER_LEG_DURATION.name + "_bucket", job, RouterLabel.LEG,
                         f'{Label.OUTCOME}="{LegOutcome.OK.value}"') for q in (0.5, 0.95)}
    for leg in (RouterLeg.PREFILL.value, RouterLeg.DECODE.value):
        if leg in legs[0.5]:
            ok = {"leg": leg, "outcome": LegOutcome.OK.value}
            n = total(data, ROUTER_LEG_DURATION.name + "_count", **ok)
            mean = total(data, ROUTER_LEG_DURATION.name + "_sum", **ok) / n if n else 0.0
            lines.append(f"{leg} leg ({n:.0f} ok): p50 {legs[0.5][leg] * 1e3:.0f} ms, "
                         f"p95 {legs[0.95][leg] * 1e3:.0f} ms, mean {mean * 1e3:.0f} ms")
    cancelled = total(data, ROUTER_LEGS_CANCELLED.series_names[0])
    lines.append(f"legs cancelled: {cancelled:.0f}")
    return lines, failed


# ------------------------------------------------------------------- where TTFT goes


@dataclass(frozen=True)
class TtftSplit:
    """One request's TTFT by stage, each stage read from the component that measured it
    (seconds). The client's TTFT (router) should be the stages' sum plus the router's own
    share and its hops (`residual`); D's wait for KV should be P's two stages (`join`)."""

    client_ttft: float  # router.request: arrival at the router -> first token to the client
    streamed: bool
    p_prefill: float  # P's vLLM TTFT: arrival at P -> first token (its queue and prefill)
    p_handoff: float  # P's write span: prefill done -> WRITE done
    kv_wait: float  # D's receive span: arrival at D -> KV landed
    d_after_kv: float  # D's vLLM TTFT minus the wait: D's queue after the KV and its first step
    d_rest: float  # not streamed: D's answer after its first token (the client waits for it all)

    @property
    def stages(self) -> float:
        return self.p_prefill + self.p_handoff + self.d_after_kv + self.d_rest

    @property
    def residual(self) -> float:
        return self.client_ttft - self.stages

    @property
    def join(self) -> float:
        return self.kv_wait - (self.p_prefill + self.p_handoff)


def split_problems(sp: TtftSplit) -> list[str]:
    """Where one request's stages do not add up within the stated tolerances (the vocabulary's
    `TTFT_JOIN_TOLERANCE_*` and `TTFT_ROUTER_SHARE_*`)."""
    out = []
    if abs(sp.join) > TTFT_JOIN_TOLERANCE_S + TTFT_JOIN_TOLERANCE_SHARE * sp.kv_wait:
        out.append(f"D waited {sp.kv_wait * 1e3:.0f} ms for KV, P's stages add up to "
                   f"{(sp.p_prefill + sp.p_handoff) * 1e3:.0f} ms")
    if not (TTFT_ROUTER_SHARE_MIN_S <= sp.residual
            <= TTFT_ROUTER_SHARE_MAX_S + TTFT_ROUTER_SHARE_SHARE * sp.client_ttft):
        out.append(f"client TTFT {sp.client_ttft * 1e3:.0f} ms, stages {sp.stages * 1e3:.0f} ms: "
                   f"the router's share {sp.residual * 1e3:.0f} ms is out of bounds")
    return out


def ttft_split(spans: list[dict[str, Any]], trace_id: str) -> TtftSplit | None:
    """The split of one request's trace; None while a span or boundary it needs is missing."""
    mine = {(s["service"], s["name"]): s for s in spans if s["trace_id"] == trace_id}
    router = mine.get(("router", SPAN_ROUTER_REQUEST))
    p_req, d_req = mine.get(("vllm-prefill", VLLM_REQUEST_SPAN)), mine.get(("vllm-decode", VLLM_REQUEST_SPAN))
    write, receive = mine.get(("vllm-prefill", SPAN_PUSH_WRITE)), mine.get(("vllm-decode", SPAN_PUSH_RECEIVE))
    if router is None or p_req is None or d_req is None or write is None or receive is None:
        return None
    prefill_done = write.get("event_times", {}).get(SpanEvent.PREFILL_DONE)
    needed = (router["attributes"].get(RouterAttr.TTFT), p_req["attributes"].get(VLLM_TTFT_ATTR),
              d_req["attributes"].get(VLLM_TTFT_ATTR), d_req["attributes"].get(VLLM_E2E_ATTR),
              receive["attributes"].get(Attr.KV_WAIT), prefill_done)
    if None in needed:
        return None
    client, p_ttft, d_ttft, d_e2e, kv_wait, _ = (float(v) for v in needed)
    streamed = bool(router["attributes"].get(RouterAttr.STREAM))
    return TtftSplit(client, streamed, p_ttft, (write["end"] - prefill_done) / 1e9, kv_wait,
                     d_ttft - kv_wait, 0.0 if streamed else d_e2e - d_ttft)


def wait_splits(get_spans: Any, outcomes: Iterable[Outcome], timeout_s: float) -> dict[str, TtftSplit]:
    """Request id -> its TTFT split, once every request's trace holds what the split needs, or
    after `timeout_s` those that do (the caller says what is missing)."""
    outcomes = list(outcomes)
    found: dict[str, TtftSplit] = {}

    def complete() -> bool:
        spans = get_spans()
        for o in outcomes:
            if o.request_id not in found and (sp := ttft_split(spans, o.trace_id)) is not None:
                found[o.request_id] = sp
        return len(found) == len(outcomes)

    with contextlib.suppress(PollTimeout):
        wait_until(complete, "every request's stage spans and boundaries", timeout_s, 0.25)
    return {o.request_id: found[o.request_id] for o in outcomes if o.request_id in found}


MEAN_PANEL = "Mean TTFT by stage (range)"
SHARE_PANEL = "Share of D's TTFT spent waiting for KV (range)"


def ttft_dashboard_means(prom: PrometheusServer, job: str, model: str, at: float | None = None
                         ) -> dict[str, float]:
    """The row's exact panels as Grafana shows them over the last hour: each stage's legend ->
    mean seconds, and "share" -> the share of D's TTFT spent waiting for KV."""
    dashboard = panels.build_dashboard()
    wanted = [p for p in panels.iter_panels(dashboard) if p["title"] in (MEAN_PANEL, SHARE_PANEL)]
    legends = {(p["title"], t["refId"]): t["legendFormat"] for p in wanted for t in p["targets"]}
    dashboard["panels"] = wanted
    variables = {"job": job, "model_name": model, "instance": ".*", "engine": ".*",
                 "__range": "1h", "__rate_interval": "1m"}
    out: dict[str, float] = {}
    for q in evaluate_dashboard(prom, dashboard, variables, at=at):
        for _, value in q.values():
            out["share" if q.panel == SHARE_PANEL else legends[(q.panel, q.ref_id)]] = value
    return out


def ttft_lines(splits: list[TtftSplit], means: dict[str, float]) -> tuple[list[str], int]:
    """The dashboard's stage means, then each traced request's split and how it adds up;
    (lines, requests whose stages do not add up)."""
    lines = [f"{name}: mean {value * 1e3:.0f} ms" for name, value in means.items() if name != "share"]
    if "share" in means:
        lines.append(f"share of D's TTFT spent waiting for KV: {means['share']:.1%}")
    lines.append("per request (traces): client TTFT = P prefill + P handoff + D after KV [+ D rest "
                 "of the answer, not streamed] + router")
    for sp in splits:
        rest = "" if sp.streamed else f" + {sp.d_rest * 1e3:.0f}"
        lines.append(f"  {sp.client_ttft * 1e3:6.0f} ms = {sp.p_prefill * 1e3:.0f} + {sp.p_handoff * 1e3:.0f}"
                     f" + {sp.d_after_kv * 1e3:.0f}{rest} + {sp.residual * 1e3:.0f} (router);  "
                     f"D waited {sp.kv_wait * 1e3:.0f} ms for KV (P's stages {sp.join * 1e3:+.0f} ms)")
    failed = 0
    for sp in splits:
        for problem in split_problems(sp):
            failed += 1
            lines.append(f"CHECK FAILED: {problem}")
    return lines, failed

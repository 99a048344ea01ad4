"""The dashboard and rules against a real Prometheus scraping a real P/D push.

One module-scoped run: the two-process push harness drives pushes over real NIXL; P's
and D's metrics front ends serve /metrics on two real ports; a real Prometheus scrapes
both (job "vllm", 1 s) with our rules loaded. Every query of every panel is evaluated
through Prometheus' HTTP API, once while idle and once after the pushes, with the
dashboard variables filled in the way Grafana would. The headline panels are evaluated
once more between two scrapes, over a range that starts inside the run and over one that
starts before the first scrape, and must equal the counters on the engines' /metrics.
"""

from __future__ import annotations

import math
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from connector import vocabulary as V
from connector.router import legs
from connector.vocabulary import Label
from dashboards import panels, promql, promrun, queries, rules
from dashboards.promrun import PanelQuery, PrometheusServer
from harness.poll import wait_until

pytestmark = [pytest.mark.real, pytest.mark.prometheus]

N_PUSHES = 8
JOB = "vllm"
RAW_JOB = "vllm-unrelabeled"
# Grafana's values for the variables: the job, the harness' model and engine label, every
# instance (the "All" value is the regex .*), and fixed intervals. A 30 s rate window
# comfortably covers the 1 s scrapes around the pushes.
VARIABLES = {"job": JOB, "model_name": "tiny-llama", "instance": ".*", "engine": "0",
             "__rate_interval": "30s", "__range": "5m", "__interval": "5s"}


@dataclass
class Run:
    instances: dict[str, str]
    idle: list[PanelQuery]
    busy: list[PanelQuery]  # evaluated at D's last scrape
    busy_p: list[PanelQuery]  # evaluated at P's last scrape
    stats: dict[str, list[dict[str, Any]]]
    shape: dict[str, int]
    absent_at_idle: set[str]
    variable_values: dict[str, list[str]]
    rules: list[dict[str, Any]]
    alerts: list[dict[str, Any]]
    recorded_share: float | None
    raw_names: list[str]
    headlines: dict[str, list[PanelQuery]]  # range name -> headline panels' answers
    counters: dict[str, Samples]  # range name -> the engines' /metrics changes over it
    expositions: dict[str, str] = field(default_factory=dict)

    def panel(self, title: str, ref: str = "A", when: str = "D") -> PanelQuery:
        for q in {"D": self.busy, "P": self.busy_p, "idle": self.idle}[when]:
            if q.panel == title and q.ref_id == ref:
                return q
        raise KeyError(title)

    def handshakes(self, engine: str) -> list[dict[str, Any]]:
        return [hs for data in self.stats[engine] for hs in data.get(V.StatKey.HANDSHAKES, [])]


def _drain(h: Any, stats: dict[str, list[dict[str, Any]]],
           done: Callable[[dict[str, list[dict[str, Any]]]], bool]) -> None:
    """Poll the engines' stats (they arrive asynchronously) until `done(stats)` holds."""

    def complete() -> bool:
        for name in stats:
            stats[name] += h.stats(name)
        return done(stats)

    wait_until(complete, "the engines' stats of the pushes", 30, 0.3, last=lambda: stats)


# ------------------------------------------------------------------- the engines' counters
Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape_metrics(instances: dict[str, str]) -> Samples:
    """Every sample on the engines' /metrics (text format), summed over the engines."""
    out: Samples = {}
    for inst in instances.values():
        with urllib.request.urlopen(f"http://{inst}/metrics", timeout=10) as resp:
            text = resp.read().decode()
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                key = (s.name, frozenset(s.labels.items()))
                out[key] = out.get(key, 0.0) + s.value
    return out


def minus(now: Samples, before: Samples) -> Samples:
    return {key: value - before.get(key, 0.0) for key, value in now.items()}


def total_of(samples: Samples, name: str, by: tuple[str, ...] = (),
             **where: str | tuple[str, ...]) -> dict[tuple[str, ...], float]:
    """Sum of one sample name's values whose labels match `where`, grouped by `by`."""
    out: dict[tuple[str, ...], float] = {}
    for (sample, labels), value in samples.items():
        found = dict(labels)
        if sample != name or any(found.get(k) not in ((v,) if isinstance(v, str) else v)
                                 for k, v in where.items()):
            continue
        group = tuple(found[x] for x in by)
        out[group] = out.get(group, 0.0) + value
    return out


def _share(samples: Samples) -> dict[tuple[str, ...], float]:
    count = V.HANDSHAKE_DURATION.name + "_count"
    d_to_p = V.Direction.D_TO_P.value
    notif = total_of(samples, count, direction=d_to_p, notif_agents_only=V.bool_label(True)).get((), 0.0)
    every = total_of(samples, count, direction=d_to_p).get((), 0.0)
    return {(): notif / every} if every else {}


def _mean_phase(samples: Samples) -> dict[tuple[str, ...], float]:
    name, per = V.HANDSHAKE_PHASE_DURATION.name, (Label.DIRECTION, Label.PHASE)
    sums, counts = total_of(samples, name + "_sum", per), total_of(samples, name + "_count", per)
    return {k: sums[k] / n for k, n in counts.items() if n > 0}


def _one(name: str, **where: str | tuple[str, ...]) -> Callable[[Samples], dict[tuple[str, ...], float]]:
    return lambda samples: total_of(samples, name, **where)


def _mean_of(spec: V.MetricSpec, **where: str) -> Callable[[Samples], dict[tuple[str, ...], float]]:
    def mean(samples: Samples) -> dict[tuple[str, ...], float]:
        n = total_of(samples, spec.name + "_count", **where).get((), 0.0)
        return {(): total_of(samples, spec.name + "_sum", **where)[()] / n} if n else {}
    return mean


def _no_vllm_ttft(samples: Samples) -> dict[tuple[str, ...], float]:
    """The harness's front ends export the connector's metrics, not vLLM's request metrics:
    the panels reading vLLM's TTFT show nothing here (tests/test_e2e_serve.py checks them
    against real engines)."""
    assert not total_of(samples, V.VLLM_TTFT.name + "_count")
    return {}


# What each headline panel (title, query refId) must show: its count from the engines'
# /metrics, as {label values of the panel's grouping: value}.
Truth = Callable[[Samples], dict[tuple[str, ...], float]]
HEADLINE_TRUTH: dict[tuple[str, str], tuple[tuple[str, ...], Truth]] = {
    ("D->P handshakes that were notification-only", "A"): ((), _share),
    ("Full D->P handshakes", "A"): ((), _one(V.HANDSHAKE_DURATION.name + "_count",
                                          direction=V.Direction.D_TO_P.value,
                                          notif_agents_only=V.bool_label(False))),
    ("Descriptor registrations saved", "A"): ((), _one(V.DESCRIPTOR_REGISTRATIONS_SAVED.series_names[0])),
    ("Descriptors saved", "A"): ((), _one(V.DESCRIPTORS_SAVED.series_names[0])),
    ("Descriptors registered vs saved (range)", "A"): (
        (Label.DIRECTION, Label.LIST),
        lambda s: total_of(s, V.DESCRIPTORS_REGISTERED.series_names[0], (Label.DIRECTION, Label.LIST))),
    ("Descriptors registered vs saved (range)", "B"): (
        (Label.DIRECTION,), lambda s: total_of(s, V.DESCRIPTORS_SAVED.series_names[0], (Label.DIRECTION,))),
    ("Mean time per phase (range)", "A"): ((Label.DIRECTION, Label.PHASE), _mean_phase),
    ("KV leases renewed by heartbeats", "A"): (
        (), _one(V.KV_LEASE_RENEWALS.series_names[0], outcome=V.LeaseRenewal.RENEWED.value)),
    ("Heartbeat ids matching nothing", "A"): (
        (), _one(V.KV_LEASE_RENEWALS.series_names[0], outcome=V.LeaseRenewal.UNKNOWN_REQUEST.value)),
    ("Peers that restarted", "A"): ((), _one(V.PEER_RESTARTS.series_names[0])),
    ("Mean TTFT by stage (range)", "A"): ((), _mean_of(V.KV_WAIT, outcome=V.ReceiveOutcome.SUCCESS.value)),
    ("Mean TTFT by stage (range)", "B"): ((), _no_vllm_ttft),
    ("Mean TTFT by stage (range)", "C"): ((), _mean_of(V.PUSH_WRITE_WAIT)),
    ("Mean TTFT by stage (range)", "D"): ((), _mean_of(V.PUSH_WRITE_DURATION)),
    ("Share of D's TTFT spent waiting for KV (range)", "A"): ((), _no_vllm_ttft),
    ("KV leases expired while the decoder waited", "A"): (
        (), _one(V.KV_LEASE_EXPIRIES.series_names[0],
                 fate=(V.LeaseFate.WAITING.value, V.LeaseFate.REGISTERED.value))),
}


# The router's row is checked against a real router (test_router_* below), not the harness.
ROUTER_PANELS = panels.row_titles(panels.ROUTER_ROW)


def without_row(dashboard: dict[str, Any], title: str) -> dict[str, Any]:
    dashboard["panels"] = [p for p in dashboard["panels"] if p.get("title") != title]
    return dashboard


def only_row(dashboard: dict[str, Any], title: str) -> dict[str, Any]:
    row = next(p for p in dashboard["panels"] if p.get("title") == title)
    dashboard["panels"] = row["panels"]
    return dashboard


def variable_lists(prom: PrometheusServer, values: dict[str, str]) -> dict[str, list[str]]:
    """What each query variable lists, its query's selector filled in as Grafana does."""
    return {name: prom.label_values(read, promrun.fill_variables(source, values))
            for name, (_, source, read) in panels.QUERY_VARIABLES.items()}


def _count(stats: list[dict[str, Any]], key: str) -> int:
    return sum(sum(data.get(key, [])) for data in stats)


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    from harness import PushHarness

    dashboard = without_row(panels.build_dashboard(), panels.ROUTER_ROW)
    with PushHarness.pd(connector="fork") as h:
        fronts = {name: h.frontend(name) for name in ("P", "D")}
        try:
            instances = {name: f"127.0.0.1:{fe.serve()}" for name, fe in fronts.items()}
            jobs = [promrun.scrape_job(JOB, instances.values()),
                    # The same targets without the colon fix, to show why it is there.
                    promrun.scrape_job(RAW_JOB, instances.values(), restore_vllm_colon=False)]
            with PrometheusServer(jobs, rule_files=[promrun.RULES_PATH],
                                  workdir=tmp_path_factory.mktemp("prometheus")) as prom:
                # Both targets up and their zero-valued series stored before anything happens.
                prom.wait_for(f'count(up{{job="{JOB}"}} == 1)', lambda v: v == 2, what="targets up")
                prom.wait_for(f'min(count_over_time(up{{job="{JOB}"}}[1m]))', lambda v: (v or 0) >= 3,
                              what="three scrapes of both front ends (rates need two samples)")
                prom.wait_for(f"count(count by (instance) ({V.PUSHES.series_names[0]}))",
                              lambda v: v == 2, what="zero-valued series of both front ends")
                idle = promrun.evaluate_dashboard(prom, dashboard, VARIABLES)
                absent_at_idle = {
                    series for series in queries.series_index()
                    if not prom.query(f'{series}{{job="{JOB}"}}')}
                # The run's range starts here: Prometheus holds the idle counters already.
                run_start, at_idle = time.time(), scrape_metrics(instances)
                # Prometheus holds a sample of both inside the run's range before anything
                # changes (else increase() over the range can see no change at all).
                prom.wait_scraped_after(JOB, instances.values(), run_start)

                report = h.push(N_PUSHES)
                assert report.ok, report
                stats: dict[str, list[dict[str, Any]]] = {"P": [], "D": []}
                _drain(h, stats, lambda s: (
                    _count(s["P"], V.StatKey.PUSHES_COMPLETED) == N_PUSHES
                    and any(d.get(V.StatKey.HANDSHAKES) for d in s["D"])
                    and any(d.get(V.StatKey.HANDSHAKES) for d in s["P"])))
                for name, fe in fronts.items():
                    fe.observe(stats[name])

                saved = sum(hs["saved_descriptors"] for d in stats["D"] for hs in d.get("handshakes", ()))
                d_saved = f'sum({V.DESCRIPTORS_SAVED.series_names[0]}{{instance="{instances["D"]}"}})'
                prom.wait_for(d_saved, lambda v: v == saved, what="D's saved descriptors scraped")
                prom.wait_for(f'sum({V.PUSHES.series_names[0]}{{outcome="completed"}})',
                              lambda v: v == N_PUSHES, what="P's completed pushes scraped")
                # One more scrape of both, so both changes precede what is evaluated.
                scraped = prom.wait_scraped_after(JOB, instances.values(), time.time())
                last = {name: scraped[inst] for name, inst in instances.items()}
                busy = promrun.evaluate_dashboard(prom, dashboard, VARIABLES, at=last["D"])
                busy_p = promrun.evaluate_dashboard(prom, dashboard, VARIABLES, at=last["P"])

                # Headline panels between two scrapes (where increase() extrapolates), over
                # the run's range and over a range starting before Prometheus' first scrape.
                at = max(last.values()) + 0.5
                prom.wait_scraped_after(JOB, instances.values(), at)
                counters_now = scrape_metrics(instances)
                ranges = {"run": f"{math.floor(at - run_start)}s", "before the first scrape": "1h"}
                headline_titles = panels.headline_titles() - ROUTER_PANELS
                headlines = {
                    name: [q for q in promrun.evaluate_dashboard(prom, dashboard,
                                                                 {**VARIABLES, "__range": window}, at=at)
                           if q.panel in headline_titles]
                    for name, window in ranges.items()}
                counters = {"run": minus(counters_now, at_idle), "before the first scrape": counters_now}

                variable_values = variable_lists(prom, {"job": JOB, "model_name": ".*", "instance": ".*"})
                share_rule = "instance:vllm_nixl_handshakes_d_to_p_notif_only:ratio1h"
                recorded_share = prom.wait_for(
                    f'{share_rule}{{instance="{instances["D"]}"}}', lambda v: v is not None,
                    timeout_s=15, what="recording rule evaluated")
                raw_names = prom.label_values("__name__", f'{{job="{RAW_JOB}"}}')
                loaded = [r for g in prom.api("/api/v1/rules")["data"]["groups"] for r in g["rules"]]
                alerts = prom.api("/api/v1/alerts")["data"]["alerts"]
            expositions = {name: fe.exposition() for name, fe in fronts.items()}
        finally:
            for fe in fronts.values():
                fe.close()
        spec_p = h.specs["P"]
        shape = {"pairs": 1, "remote_ranks": 1,
                 "descriptors_per_registration": spec_p.num_layers * spec_p.num_blocks}
    return Run(instances, idle, busy, busy_p, stats, shape, absent_at_idle, variable_values, loaded,
               alerts, recorded_share, raw_names, headlines, counters, expositions)


# Panels that must show data after the pushes, with what the data must be. Each check
# gets {labels-tuple: value} for the query and the Run.
def _by(q: PanelQuery, *labels: str) -> dict[tuple[str, ...], float]:
    return {tuple(m.get(x, "") for x in labels): v for m, v in q.values()}


CORE = {
    "D->P handshakes that were notification-only", "Full D->P handshakes",
    "KV delivery error budget left (range)", "KV wait error budget left (range)",
    "Descriptor registrations saved", "Descriptors saved", "Handshakes/s by direction and flavor",
    "Descriptor registrations saved/s", "Descriptors saved/s", "Descriptors registered vs saved (range)",
    "Descriptor lists prepared/s by full handshakes", "Descriptors registered/s by full handshakes",
    "Handshake latency p50 / p95 / p99 by flavor", "PUSH_REG notifications/s",
    "KV pushes/s: started / completed / failed", "NIXL transfers/s and failures/s",
    "KV receive latency p50 / p95 / p99 by outcome", "KV receives/s by outcome",
    "NIXL transfer and post time p50 / p99", "NIXL bytes transferred/s",
    "Descriptors per NIXL transfer (mean)",
    # Series the connector pre-creates at 0 (rate()/increase() cannot see a series'
    # first sample, so these would stay empty for a single handshake otherwise).
    "Handshakes/s by trigger and outcome", "Handshake failure ratio by direction",
    "Executor queue wait p50 / p95 / p99", "Per-phase latency p95", "Mean time per phase (range)",
    # Reliability: gauges set to 0 and counters created at 0 at start-up (0 is data).
    "Handshakes in flight", "Oldest handshake in flight", "Handshake retries/s", "Peer input rejected/s",
    "Telemetry errors/s",
    # KV leases: gauges set to 0, counters created at 0 (ours and vLLM's) at start-up.
    "KV leases held now", "KV leases renewed by heartbeats", "Heartbeat ids matching nothing",
    "KV leases expired while the decoder waited", "KV leases held (P) and requests waiting for KV (D)",
    "Oldest KV lease (P) and oldest wait for KV (D)", "KV lease expiries/s by fate",
    "Heartbeat ids/s by what they matched (P)", "Heartbeats sent/s (D)",
    "Completion notifications after lease expiry/s",
    # Peers: counters created at 0 at start-up.
    "Peers that restarted", "Peer connections dropped/s", "Receives failed/s by reason (D)",
    "Peers refused/s by channel and reason",
    # Push state: counters and gauges created at 0 at start-up.
    "Receives given up/s (D)", "PUSH_FAILs owed/s (P)", "WRITEs aborted/s (P)", "Peers forgotten",
    "Internal errors",
    # KV integrity: counters and the digest histogram created at start-up; every push checked.
    "KV integrity checks/s", "KV mismatches", "KV digest time p50 / p99",
    # Where TTFT goes: the connector's own stages.
    "D: wait for KV p50 / p95 / p99 by outcome", "P: prefill done -> WRITE posted p50 / p95 / p99",
    "P: PUSH_REG matched -> WRITE done p50 / p95 / p99",
}
# Panels that also read vLLM's own TTFT, which the harness's front ends do not export: their
# other queries show data here, those over vLLM's TTFT nothing (tests/test_e2e_serve.py checks
# them against real engines).
WITH_VLLM_TTFT = {"Mean TTFT by stage (range)", "Share of D's TTFT spent waiting for KV (range)",
                  "Mean TTFT on D: waiting for KV, then D's own work",
                  "Share of D's TTFT spent waiting for KV"}
# NIXL's own exporter's row: the harness runs no NIXL exporter, so its queries parse and answer
# nothing here; tests/test_e2e_serve.py evaluates the row on real `vllm serve` with data.
NIXL_EXPORTER_ROW = panels.row_titles(panels.NIXL_AGENTS_ROW)
# Panels whose series are born at their first failure: empty in a healthy run.
QUIET = {"Handshake failures/s by phase and error type"}
# Panels over series the connector creates at their first event (not at start-up), if
# any: they would be empty for a single event. See dashboards/README.md.
BORN_LATE: set[str] = set()


def test_every_panel_query_parses_and_has_no_nan(run: Run) -> None:
    assert len(run.busy) == len(run.busy_p) == len(run.idle) > 20
    for q in run.idle + run.busy + run.busy_p:
        assert q.ok, f"{q.panel} {q.ref_id}: {q.answer.get('errorType')}: {q.answer.get('error')}\n{q.expr}"
        assert not q.nan_series(), f"{q.panel} {q.ref_id} returned NaN for {q.nan_series()}"


def test_panels_are_classified(run: Run) -> None:
    titles = {q.panel for q in run.busy}
    assert titles == CORE | QUIET | BORN_LATE | WITH_VLLM_TTFT | NIXL_EXPORTER_ROW
    assert not NIXL_EXPORTER_ROW & (CORE | QUIET | BORN_LATE | WITH_VLLM_TTFT)
    nixl = {name for spec in V.NIXL_EXPORTER_METRICS for name in spec.series_names}
    for q in (q for q in run.busy if q.panel in NIXL_EXPORTER_ROW):  # (the engines' own lines: data)
        assert bool(q.series) != bool(promql.metric_names(q.expr) & nixl), (q.panel, q.ref_id)
    assert not (CORE & QUIET) and not (CORE & BORN_LATE) and not (QUIET & BORN_LATE)
    assert not (WITH_VLLM_TTFT & (CORE | QUIET | BORN_LATE))
    # A panel may only be excused as born-late if one of its metrics really had no series
    # before the first handshake; once the connector pre-creates them, move it to CORE.
    index = queries.series_index()
    dashboard = panels.build_dashboard()
    for panel in panels.iter_panels(dashboard):
        if panel["title"] in BORN_LATE:
            names = set().union(*(promql.metric_names(t["expr"]) for t in panel["targets"]))
            assert names & run.absent_at_idle, (panel["title"], names, "all pre-created: make it CORE")
            assert names <= index.keys()


def test_core_panels_return_data(run: Run) -> None:
    for title in CORE:
        for q in (q for q in run.busy if q.panel == title):
            assert q.series, f"{title} {q.ref_id} returned no data: {q.expr}"


def test_ttft_panels_show_the_connectors_stages_and_no_vllm_ttft_in_the_harness(run: Run) -> None:
    for q in (q for q in run.busy if q.panel in WITH_VLLM_TTFT):
        if V.VLLM_TTFT.name in q.expr:
            assert q.series == [], (q.panel, q.ref_id)
        else:
            assert q.series, f"{q.panel} {q.ref_id} returned no data: {q.expr}"


def test_idle_panels_show_zero_or_nothing(run: Run) -> None:
    # Before any handshake: the share has no denominator (empty, not NaN or 0%), the totals
    # of pre-created counters are 0, rates of pre-created counters are 0.
    assert run.panel("D->P handshakes that were notification-only", when="idle").series == []
    for title in ("Descriptor registrations saved", "Descriptors saved", "Full D->P handshakes"):
        assert [v for _, v in run.panel(title, when="idle").values()] == [0.0], title
    for title in ("KV pushes/s: started / completed / failed", "Descriptors saved/s"):
        values = run.panel(title, when="idle").values()
        assert values and all(v == 0.0 for _, v in values), (title, values)
    assert run.panel("Handshake latency p50 / p95 / p99 by flavor", when="idle").series == []


def test_saved_totals_equal_harness_ground_truth(run: Run) -> None:
    d_to_p = [hs for hs in run.handshakes("D") if hs["direction"] == V.Direction.D_TO_P.value]
    # Harness shape: one P/D pair -> exactly one D->P handshake, notification-only, reaching
    # P's single rank; a full one would have prepared one remote list of layers x blocks.
    assert len(d_to_p) == run.shape["pairs"]
    assert all(hs["notif_only"] and hs["outcome"] == "success" for hs in d_to_p)
    truth_regs = sum(hs["saved_registrations"] for hs in d_to_p)
    truth_descs = sum(hs["saved_descriptors"] for hs in d_to_p)
    assert truth_regs == run.shape["pairs"] * run.shape["remote_ranks"]
    assert truth_descs == truth_regs * run.shape["descriptors_per_registration"]

    assert run.panel("Descriptor registrations saved").values() == [({}, float(truth_regs))]
    assert run.panel("Descriptors saved").values() == [({}, float(truth_descs))]
    contrast = run.panel("Descriptors registered vs saved (range)", "B")
    assert _by(contrast, "direction")[("d_to_p",)] == truth_descs
    assert _by(contrast, "direction")[("p_to_d",)] == 0


def test_registered_by_full_handshakes_equals_ground_truth(run: Run) -> None:
    p_to_d = [hs for hs in run.handshakes("P") if hs["direction"] == V.Direction.P_TO_D.value]
    assert p_to_d and not any(hs["notif_only"] for hs in p_to_d)
    truth = {which: sum(hs["descriptors"].get(which, 0) for hs in p_to_d) for which in ("remote", "local")}
    assert truth["remote"] == run.shape["descriptors_per_registration"]
    registered = _by(run.panel("Descriptors registered vs saved (range)", "A", when="P"),
                     "direction", "list")
    assert registered[("p_to_d", "remote")] == truth["remote"]
    assert registered[("p_to_d", "local")] == truth["local"]
    assert registered[("d_to_p", "remote")] == 0  # push mode: D prepares nothing for P
    lists = _by(run.panel("Descriptor lists prepared/s by full handshakes"), "direction", "list")
    assert lists[("p_to_d", "remote")] > 0 and lists[("d_to_p", "remote")] == 0


def test_headline_panels_equal_the_engines_counters(run: Run) -> None:
    """Each headline panel, evaluated between two scrapes with $__range filled in as Grafana
    does, equals the change of its counters on the engines' own /metrics: over the run (the
    range starts inside Prometheus' data: `offset`) and over a range starting before the
    first scrape (series born inside the range count from 0)."""
    assert {(q.panel, q.ref_id) for q in run.headlines["run"]} == set(HEADLINE_TRUTH), \
        "every headline panel needs its count from /metrics in HEADLINE_TRUTH"
    for name, answers in run.headlines.items():
        for q in answers:
            assert q.ok, (name, q.panel, q.answer)
            labels, truth = HEADLINE_TRUTH[(q.panel, q.ref_id)]
            expected, got = truth(run.counters[name]), _by(q, *labels)
            assert got.keys() == expected.keys(), (name, q.panel, q.ref_id, got, expected)
            for key, value in expected.items():
                assert math.isclose(got[key], value, rel_tol=1e-12), (name, q.panel, q.ref_id, key, got)


def test_handshake_panels(run: Run) -> None:
    assert run.panel("D->P handshakes that were notification-only").values() == [({}, 1.0)]
    assert run.panel("Full D->P handshakes").values() == [({}, 0.0)]
    rates = _by(run.panel("Handshakes/s by direction and flavor"), "direction", "notif_agents_only")
    assert rates[("d_to_p", "true")] > 0
    assert rates[("p_to_d", "false")] > 0
    assert rates[("d_to_p", "false")] == 0
    assert _by(run.panel("Descriptor registrations saved/s"), "direction")[("d_to_p",)] > 0
    assert _by(run.panel("Descriptors saved/s"), "direction")[("d_to_p",)] > 0


def test_latency_quantiles(run: Run) -> None:
    durations = {(hs["direction"], "true" if hs["notif_only"] else "false"): hs["duration"]
                 for engine in ("P", "D") for hs in run.handshakes(engine)}
    buckets = V.HANDSHAKE_DURATION.buckets
    quantiles = {ref: _by(run.panel("Handshake latency p50 / p95 / p99 by flavor", ref),
                          "direction", "notif_agents_only") for ref in "ABC"}
    for flavor, seconds in durations.items():
        # One observation: every quantile lies inside the bucket holding it.
        upper = min(b for b in buckets if b >= seconds)
        lower = max([0.0] + [b for b in buckets if b < seconds])
        p50, p95, p99 = (quantiles[ref][flavor] for ref in "ABC")
        assert lower <= p50 <= p95 <= p99 <= upper, (flavor, seconds, p50, p95, p99)
    # Flavors without handshakes are dropped, not NaN.
    assert ("d_to_p", "false") not in quantiles["C"]


def test_push_flow_and_stock_panels(run: Run) -> None:
    notifs = _by(run.panel("PUSH_REG notifications/s"), "outcome")
    assert notifs[("sent",)] > 0 and notifs[("failed",)] == 0
    pushes = _by(run.panel("KV pushes/s: started / completed / failed"), "outcome")
    assert pushes[("started",)] > 0 and pushes[("completed",)] > 0 and pushes[("failed",)] == 0
    assert run.panel("NIXL transfers/s and failures/s", "A").values()[0][1] > 0
    assert run.panel("NIXL transfers/s and failures/s", "B").values()[0][1] == 0
    assert run.panel("NIXL bytes transferred/s").values()[0][1] > 0
    descs = [n for data in run.stats["P"] for n in data.get("num_descriptors", [])]
    assert descs
    mean = run.panel("Descriptors per NIXL transfer (mean)").values()[0][1]
    assert math.isclose(mean, sum(descs) / len(descs))


def test_dashboard_variables_resolve(run: Run) -> None:
    assert run.variable_values["job"] == [JOB]
    assert run.variable_values["model_name"] == [VARIABLES["model_name"]]
    assert sorted(run.variable_values["instance"]) == sorted(run.instances.values())
    assert run.variable_values["engine"] == [VARIABLES["engine"]]


def test_rules_load_evaluate_and_stay_quiet(run: Run) -> None:
    generated = rules.build_rules()
    names = {r.get("alert") or r.get("record") for g in generated["groups"] for r in g["rules"]}
    loaded = {r["name"]: r for r in run.rules}
    assert set(loaded) == names
    for name, rule in loaded.items():
        assert rule["health"] == "ok", (name, rule.get("lastError"))
    # A healthy push run: notification-only D->P handshakes, nothing failing or slow.
    assert [a for a in run.alerts if a["labels"]["alertname"] in names] == []
    assert run.recorded_share == 1.0


def test_promtool_check_metrics(run: Run) -> None:
    """promtool's lint on both /metrics texts: only the `vllm:` colon is reported.

    vLLM names every metric `vllm:...`; promtool's linter says "metric names should not
    contain ':'" (colons are meant for recording rules). We cannot rename vLLM's namespace,
    so that exact complaint, for `vllm:` names only, is the one accepted; with the colon
    replaced, promtool must find nothing at all (counters end in _total, units, help...).
    """
    for name, text in run.expositions.items():
        assert V.PUSHES.series_names[0] in text
        code, lines = promrun.check_metrics(text)
        assert lines, "expected promtool to report the vllm: colon"
        for line in lines:
            metric, _, problem = line.partition(" ")
            assert problem == "metric names should not contain ':'", (name, line)
            assert metric.startswith("vllm:"), (name, line)
        code, lines = promrun.check_metrics(text.replace("vllm:", "vllm_"))
        assert (code, lines) == (0, []), (name, lines)


def test_prometheus_2_scrape_needs_the_colon_fix(run: Run) -> None:
    """Why every scrape config here (and the stack's) carries RESTORE_VLLM_COLON.

    Scraped without it, Prometheus 2.x stores `vllm_nixl_...` (client_python#1177), so no
    `vllm:` query would find anything. If this starts failing, the exposition got fixed
    for this Prometheus and the relabeling can go.
    """
    ours = [n for n in run.raw_names if "nixl" in n]
    assert ours, run.raw_names
    assert not [n for n in ours if n.startswith("vllm:")], ours
    assert V.PUSHES.series_names[0].replace("vllm:", "vllm_") in ours


# --------------------------------------------------------------- the Router row, real router
ROUTER_JOB = "router"
ROUTER_VARIABLES = {**VARIABLES, "job": ROUTER_JOB}


Groups = dict[tuple[str, ...], float]


def _ratio(num: Groups, den: Groups) -> Groups:
    return {k: num.get(k, 0.0) / n for k, n in den.items() if n > 0}


def _router_ok_share(s: Samples) -> dict[tuple[str, ...], float]:
    name = V.ROUTER_REQUESTS.series_names[0]
    every = total_of(s, name).get((), 0.0)
    return {(): total_of(s, name, outcome=V.RouterOutcome.OK.value).get((), 0.0) / every} if every else {}


def _mean(spec: V.MetricSpec, by: str, **where: str) -> Truth:
    return lambda s: _ratio(total_of(s, spec.name + "_sum", (by,), **where),
                            total_of(s, spec.name + "_count", (by,), **where))


ROUTER_TRUTH: dict[tuple[str, str], tuple[tuple[str, ...], Truth]] = {
    ("Router requests by outcome (range)", "A"): (
        (Label.OUTCOME,), lambda s: total_of(s, V.ROUTER_REQUESTS.series_names[0], (Label.OUTCOME,))),
    ("Router requests answered ok (range)", "A"): ((), _router_ok_share),
    ("Mean client TTFT and leg latency (range)", "A"): (
        (V.RouterLabel.STREAM,), _mean(V.ROUTER_TTFT, V.RouterLabel.STREAM)),
    ("Mean client TTFT and leg latency (range)", "B"): (
        (V.RouterLabel.LEG,), _mean(V.ROUTER_LEG_DURATION, V.RouterLabel.LEG, outcome=V.LegOutcome.OK.value)),
}


@dataclass
class RouterRun:
    instance: str
    idle: list[PanelQuery]
    busy: list[PanelQuery]
    headlines: dict[str, list[PanelQuery]]
    counters: dict[str, Samples]
    variable_values: dict[str, list[str]]
    rules: list[dict[str, Any]]
    outcomes: dict[str, float]

    def panel(self, title: str, ref: str = "A", when: str = "busy") -> PanelQuery:
        return next(q for q in (self.busy if when == "busy" else self.idle)
                    if q.panel == title and q.ref_id == ref)


@pytest.fixture(scope="module")
def router_run(tmp_path_factory: pytest.TempPathFactory) -> RouterRun:
    """The real router in front of two P/D pairs (pair 0 answers, pair 1's P fails) on loopback,
    scraped by a real Prometheus with our rules; a known mix of requests in between."""
    import httpx

    from connector.router.app import build_app
    from connector.router.config import PrefillTarget, RouterConfig
    from connector.router.metrics import RouterMetrics
    from tests.support.fake_engines import Engine, Journal, Served

    dashboard = only_row(panels.build_dashboard(), panels.ROUTER_ROW)
    journal = Journal()
    servers = [Served(Engine("P0", journal, "ok", waits_for="D")), Served(Engine("P1", journal, "fail")),
               Served(Engine("D0", journal, "ok", waits_for="P")), Served(Engine("D1", journal, "hang"))]
    config = RouterConfig(tuple(PrefillTarget(srv.url, f"prefill-{i}", "127.0.0.1", 5600 + i)
                                for i, srv in enumerate(servers[:2])), tuple(srv.url for srv in servers[2:]))
    router = Served(build_app(config, metrics=RouterMetrics()))
    servers.append(router)
    instance = f"127.0.0.1:{router.port}"
    try:
        with PrometheusServer([promrun.scrape_job(ROUTER_JOB, [instance])], rule_files=[promrun.RULES_PATH],
                              workdir=tmp_path_factory.mktemp("prometheus-router")) as prom, \
                httpx.Client(base_url=router.url, timeout=60) as client:
            prom.wait_for(f'min(count_over_time(up{{job="{ROUTER_JOB}"}}[1m]))', lambda v: (v or 0) >= 3,
                          what="three scrapes of the router (rates need two samples)")
            idle = promrun.evaluate_dashboard(prom, dashboard, ROUTER_VARIABLES)
            run_start, at_idle = time.time(), scrape_metrics({"router": instance})
            prom.wait_scraped_after(ROUTER_JOB, [instance], run_start)
            body = {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 3}
            # Round robin over the pairs: 0 ok, 1 prefill_failed, 0 ok (streamed),
            # 1 prefill_failed (streamed), 0 ok (chat); a bad body takes no pair.
            statuses = [client.post(legs.COMPLETIONS, json=body).status_code,
                        client.post(legs.COMPLETIONS, json=body).status_code,
                        client.post(legs.COMPLETIONS, json={**body, "stream": True}).status_code,
                        client.post(legs.COMPLETIONS, json={**body, "stream": True}).status_code,
                        client.post(legs.CHAT, json={"model": "tiny", "messages": []}).status_code,
                        client.post(legs.COMPLETIONS, content=b"{").status_code]
            assert statuses == [200, 502, 200, 502, 200, 400], statuses
            reqs = V.ROUTER_REQUESTS.series_names[0]
            prom.wait_for(f'sum({reqs}{{job="{ROUTER_JOB}"}})', lambda v: v == len(statuses),
                          what="every request counted and scraped")
            last = prom.wait_scraped_after(ROUTER_JOB, [instance], time.time())[instance]
            busy = promrun.evaluate_dashboard(prom, dashboard, ROUTER_VARIABLES, at=last)
            at = last + 0.5
            prom.wait_scraped_after(ROUTER_JOB, [instance], at)
            counters_now = scrape_metrics({"router": instance})
            ranges = {"run": f"{math.floor(at - run_start)}s", "before the first scrape": "1h"}
            headlines = {name: [q for q in promrun.evaluate_dashboard(
                prom, dashboard, {**ROUTER_VARIABLES, "__range": window}, at=at) if q.panel in
                panels.headline_titles()] for name, window in ranges.items()}
            variable_values = variable_lists(prom, {"job": ROUTER_JOB, "model_name": ".*", "instance": ".*"})
            loaded = [r for g in prom.api("/api/v1/rules")["data"]["groups"] for r in g["rules"]]
    finally:
        for srv in reversed(servers):
            srv.stop()
    outcomes = {k[0]: v for k, v in total_of(counters_now, V.ROUTER_REQUESTS.series_names[0],
                                             (Label.OUTCOME,)).items()}
    return RouterRun(instance, idle, busy, headlines,
                     {"run": minus(counters_now, at_idle), "before the first scrape": counters_now},
                     variable_values, loaded, outcomes)


def test_router_panels_parse_have_no_nan_and_show_data(router_run: RouterRun) -> None:
    assert {q.panel for q in router_run.busy} == ROUTER_PANELS
    for q in router_run.idle + router_run.busy:
        assert q.ok, f"{q.panel} {q.ref_id}: {q.answer.get('error')}\n{q.expr}"
        assert not q.nan_series(), (q.panel, q.ref_id, q.nan_series())
        if router_run.panel(q.panel, q.ref_id) is q:
            assert q.series, f"{q.panel} {q.ref_id} returned no data: {q.expr}"
    # While idle: no ok share (no denominator, not NaN), every outcome at 0.
    assert router_run.panel("Router requests answered ok (range)", when="idle").series == []
    idle_outcomes = router_run.panel("Router requests by outcome (range)", when="idle").values()
    every_outcome = set(V.allowed_values(V.ROUTER_REQUESTS.name, Label.OUTCOME))
    assert {m["outcome"] for m, _ in idle_outcomes} == every_outcome
    assert all(v == 0 for _, v in idle_outcomes)


def test_router_headline_panels_equal_the_routers_counters(router_run: RouterRun) -> None:
    assert router_run.outcomes == {"ok": 3, "prefill_failed": 2, "decode_failed": 0,
                                   "client_disconnected": 0, "bad_request": 1}
    titles = panels.headline_titles() & ROUTER_PANELS
    assert {(q.panel, q.ref_id) for q in router_run.headlines["run"]} == set(ROUTER_TRUTH)
    assert {t for t, _ in ROUTER_TRUTH} == titles
    for name, answers in router_run.headlines.items():
        for q in answers:
            assert q.ok, (name, q.panel, q.answer)
            labels, truth = ROUTER_TRUTH[(q.panel, q.ref_id)]
            expected, got = truth(router_run.counters[name]), _by(q, *labels)
            assert got.keys() == expected.keys(), (name, q.panel, q.ref_id, got, expected)
            for key, value in expected.items():
                assert math.isclose(got[key], value, rel_tol=1e-12), (name, q.panel, q.ref_id, key, got)


def test_router_rate_and_latency_panels(router_run: RouterRun) -> None:
    rates = _by(router_run.panel("Router requests/s by route and outcome"), "route", "outcome")
    assert rates[(legs.COMPLETIONS, "ok")] > 0 and rates[(legs.COMPLETIONS, "prefill_failed")] > 0
    assert rates[(legs.CHAT, "ok")] > 0 and rates[(legs.COMPLETIONS, "decode_failed")] == 0
    cancelled = _by(router_run.panel("Legs cancelled/s by leg and reason"), "leg", "reason")
    assert cancelled[("decode", "other_leg_failed")] > 0 and cancelled[("prefill", "other_leg_failed")] == 0
    assert [v for _, v in router_run.panel("Router requests in flight").values()] == [0.0, 0.0]
    # One quantile per stream value that had requests, each inside the TTFT buckets.
    p99 = _by(router_run.panel("Client TTFT p50 / p95 / p99", "C"), "stream")
    assert set(p99) == {("true",), ("false",)}
    assert all(0 < v <= max(V.ROUTER_TTFT.buckets) for v in p99.values())
    legs_p95 = _by(router_run.panel("Leg latency p50 / p95 by leg", "B"), "leg")
    assert set(legs_p95) == {("prefill",), ("decode",)}


def test_router_variables_and_rules(router_run: RouterRun) -> None:
    assert router_run.variable_values["job"] == [ROUTER_JOB]
    assert router_run.variable_values["instance"] == [router_run.instance]
    assert router_run.variable_values["model_name"] == [] and router_run.variable_values["engine"] == []
    loaded = {r["name"]: r for r in router_run.rules}
    assert loaded["NixlRouterLegErrorRatioHigh"]["health"] == "ok"

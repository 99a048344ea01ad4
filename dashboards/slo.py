"""Service levels of the KV handoff, and multi-window, multi-burn-rate alerts on them.

Two SLIs, from counters the decode engines already export (one observation per
remote-prefill request, at its end), per served model (`job`, `model_name`):
- KV delivery: the share of remote-prefill requests whose KV arrived over NIXL, not
  recomputed and not failed: `vllm:nixl_push_receive_duration_seconds_count`, outcome
  `success` over all outcomes. Objective 99.5% by default: a receive that fails costs
  its request a recompute (seconds of TTFT), not a wrong answer, and the fault campaign
  shows single failures come from peer restarts and expired leases; a budget of 1 in
  200 leaves room for rolling restarts while a broken link or a lease defect (every
  request, or a large share) still burns it within minutes.
- KV wait: of the requests whose KV arrived, the share that waited at most 2.5 s for it
  from their arrival at the decoder (`vllm:nixl_push_kv_wait_seconds`, the `le="2.5"`
  bucket of outcome `success`). Objective 99%. The wait spans the prefill's queue, the
  prefill and the handoff; 2.5 s is the interactive TTFT users of chat front ends expect at
  most, and the threshold must be a bucket boundary of that histogram (checked).

Alerts as the SRE Workbook ("Alerting on SLOs") recommends: a page when the budget burns
14.4 times too fast over 1 h and 5 min (2% of a 30-day budget in an hour), or 6 times
over 6 h and 30 min (5% in six hours); a ticket when it burns faster than it accrues
over 3 days and 6 h. The short window of each pair ends the alert soon after the burn
stops. The objectives and the wait threshold are `OBJECTIVES` below.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from connector import vocabulary as V
from connector.vocabulary import Label
from dashboards.queries import NOT_SUCCESS, RECEIVE_SUCCESS, bucket, by, hcount, sel

SLO_LABELS = ("job", Label.MODEL_NAME)
WINDOWS = ("5m", "30m", "1h", "6h", "3d")
# (burn rate, long window, short window): two page pairs and one ticket pair.
PAGE_PAIRS = ((14.4, "1h", "5m"), (6.0, "6h", "30m"))
TICKET_PAIR = (1.0, "3d", "6h")


@dataclass(frozen=True)
class Objectives:
    kv_delivery: float = 0.995
    kv_wait: float = 0.99
    kv_wait_threshold_s: float = 2.5

    def errors(self) -> list[str]:
        out = [f"SLO objective {name} must be between 0 and 1 (exclusive), got {value}"
               for name, value in (("kv_delivery", self.kv_delivery), ("kv_wait", self.kv_wait))
               if not 0.0 < value < 1.0]
        if self.kv_wait_threshold_s not in V.KV_WAIT.buckets:
            out.append(f"SLO kv_wait threshold {self.kv_wait_threshold_s}s is no bucket boundary of "
                       f"{V.KV_WAIT.name} {V.KV_WAIT.buckets}")
        return out


# The objectives the rules and the dashboard's budget panels use: a deployment sets its own
# here before it generates (`python -m dashboards.generate`), as it sets the alert
# thresholds in dashboards/rules.py.
OBJECTIVES = Objectives()


@dataclass(frozen=True)
class Sli:
    key: str  # kv_delivery | kv_wait
    alert: str  # the alert name's stem
    what: str  # for the annotations
    objective: float
    bad: str  # PromQL of the bad events' rate over `[W]` (W replaced per window)
    valid: str

    def record(self, window: str) -> str:
        return f"job_model:nixl_push_{self.key}_errors:ratio_rate{window}"

    def expr(self, window: str) -> str:
        rate = f"sum {by(*SLO_LABELS)} ({{}})"
        bad = rate.format(self.bad.replace("[W]", f"[{window}]"))
        valid = rate.format(self.valid.replace("[W]", f"[{window}]"))
        return f"{bad}\n/\n({valid} > 0)"


def slis(objectives: Objectives) -> tuple[Sli, Sli]:
    count, waits = hcount(V.RECEIVE_DURATION), hcount(V.KV_WAIT)
    every = sel(count, scoped=False)
    landed = sel(waits, RECEIVE_SUCCESS, scoped=False)
    le = f'le="{objectives.kv_wait_threshold_s:g}"'
    in_time = sel(bucket(V.KV_WAIT), RECEIVE_SUCCESS, le, scoped=False)
    return (
        Sli("kv_delivery", "NixlKvDelivery", "remote-prefill requests whose KV did not arrive over NIXL",
            objectives.kv_delivery,
            f"rate({sel(count, NOT_SUCCESS, scoped=False)}[W])",
            f"rate({every}[W])"),
        Sli("kv_wait", "NixlKvWait",
            f"requests whose KV arrived after more than {objectives.kv_wait_threshold_s:g}s",
            objectives.kv_wait, f"rate({landed}[W]) - ignoring (le) rate({in_time}[W])",
            f"rate({landed}[W])"),
    )


def recording_rules(objectives: Objectives) -> list[dict[str, Any]]:
    return [{"record": sli.record(w), "expr": sli.expr(w)} for sli in slis(objectives) for w in WINDOWS]


def _pair(sli: Sli, rate: float, long: str, short: str) -> str:
    limit = f"{rate * (1 - sli.objective):.6g}"
    return f"({sli.record(long)} > {limit}\nand\n{sli.record(short)} > {limit})"


def alerts(objectives: Objectives) -> list[dict[str, Any]]:
    out = []
    where = "({{ $labels.job }}, model {{ $labels.model_name }})"
    (fast, _, _), (medium, _, _) = PAGE_PAIRS
    for sli in slis(objectives):
        budget, target = f"{1 - sli.objective:.4g}", f"{sli.objective:.4g}"
        value = f"{{{{ $value | humanizePercentage }}}} of {sli.what} {where}"
        out += [
            {"alert": f"{sli.alert}ErrorBudgetBurn",
             "expr": "\nor\n".join(_pair(sli, *pair) for pair in PAGE_PAIRS),
             "labels": {"severity": "critical"},
             "annotations": {
                 "summary": f"{sli.key} error budget of {{{{ $labels.model_name }}}} burning fast",
                 "description": f"{value}: the budget of the {target} objective ({budget}) burns "
                                f"{fast:g} times too fast over 1h and 5m, or {medium:g} times over 6h "
                                "and 30m. At this pace a 30-day budget is gone within days: page."}},
            {"alert": f"{sli.alert}ErrorBudgetSlowBurn",
             "expr": _pair(sli, *TICKET_PAIR),
             "labels": {"severity": "warning"},
             "annotations": {
                 "summary": f"{sli.key} error budget of {{{{ $labels.model_name }}}} burning",
                 "description": f"{value} over 3d, and over the last 6h: more than the budget of the "
                                f"{target} objective ({budget}). A slow bleed: open a ticket."}},
        ]
    return out

"""NIXL's own exporter as an independent witness of the bytes the engines report.

The engines' byte counts (vLLM's `vllm:nixl_bytes_transferred`, observed once per WRITE
vLLM sees done) come from the process that moves the bytes, through vLLM's stats, to the
API server's `/metrics`. NIXL's exporter counts the same agent's transfers in NIXL itself
(`agent_tx_bytes_total`) and serves them on a port of its own. The two series live on
different scrape targets: `vllm:nixl_push_agent_info` (one per worker, value 1) maps
NIXL's `agent_name` to the engine's `instance`, `model_name`, `engine` and `tp_rank`, so
`* on (agent_name) group_left (...)` gives NIXL's series the engine's labels.

The rules record both byte rates per engine and alert when they part
(`NixlTelemetryDisagrees`): over `WINDOW` they differ by more than `DISAGREE_RATIO` for
`DISAGREE_FOR`, or NIXL's exporter is there but none of its agents joins an engine that
reports bytes. Both count a WRITE when it completes, at different moments (vLLM when its
next step polls the handle; its stats reach /metrics one step later), and the two targets
are scraped at different instants: over a window of minutes the two agree to a WRITE or
two in flight, which the ratio and `for` absorb; a count that drops or doubles a share of
WRITEs does not.
"""

from __future__ import annotations

from typing import Any

from connector import vocabulary as V
from connector.vocabulary import AgentLabel, Label
from dashboards.queries import by, hsum, sel, total

WITNESS_LABELS = ("instance", Label.MODEL_NAME)  # the engine's target, copied by the join
JOINED = ("instance", Label.MODEL_NAME, Label.ENGINE, AgentLabel.TP_RANK)
WINDOW = "30m"
DISAGREE_RATIO = 0.02
DISAGREE_FOR = "15m"
OURS_RECORD = "instance:vllm_nixl_bytes_transferred:rate30m"
NIXL_RECORD = "instance:nixl_agent_tx_bytes:rate30m"


def joined(expr: str, *, scoped: bool = False) -> str:
    """`expr` over NIXL's series, with each agent's engine labels (JOINED) from the info
    metric (`scoped`: the info selected by the dashboard's variables)."""
    info = sel(V.NIXL_AGENT_INFO.name, scoped=scoped)
    return (f"{expr}\n* on ({AgentLabel.AGENT_NAME}) group_left ({', '.join(JOINED)})\n"
            f"max {by(AgentLabel.AGENT_NAME, *JOINED)} ({info})")


def recording_rules() -> list[dict[str, Any]]:
    ours = sel(hsum(V.VLLM_BYTES_TRANSFERRED), scoped=False)
    nixl = sel(total(V.NIXL_TX_BYTES), scoped=False)
    return [
        {"record": OURS_RECORD,
         "expr": f"sum {by(*WITNESS_LABELS)} (rate({ours}[{WINDOW}]))"},
        {"record": NIXL_RECORD,
         "expr": f"sum {by(*WITNESS_LABELS)} (\n" + joined(f"rate({nixl}[{WINDOW}])") + "\n)"},
    ]


def alerts() -> list[dict[str, Any]]:
    nixl = sel(total(V.NIXL_TX_BYTES), scoped=False)
    return [
        {"alert": "NixlTelemetryDisagrees",
         "expr": f"abs({OURS_RECORD} - {NIXL_RECORD})\n/\nclamp_min({NIXL_RECORD}, 1)\n> {DISAGREE_RATIO}\n"
                 f"or\n(({OURS_RECORD} > 0) * 0 + 1 unless on ({', '.join(WITNESS_LABELS)}) {NIXL_RECORD})\n"
                 f"and on () group({nixl})",
         "for": DISAGREE_FOR,
         "labels": {"severity": "warning"},
         "annotations": {
             "summary": "The bytes {{ $labels.instance }} reports moving differ from NIXL's own count",
             "description": "Over " + WINDOW + ", the bytes per second engine {{ $labels.instance }} "
                            "(model {{ $labels.model_name }}) reports in vllm:nixl_bytes_transferred "
                            "and what NIXL's own exporter counts for its agents (agent_tx_bytes_total) "
                            "differ by {{ $value | humanizePercentage }} of NIXL's (threshold "
                            f"{DISAGREE_RATIO:.0%}), or NIXL counts none for an engine that reports "
                            "bytes (its agents do not join: vllm:nixl_push_agent_info missing, or "
                            "NIXL's exporter not scraped for it). One of the two counts is wrong: "
                            "every byte figure of this dashboard is in doubt until it is explained."}},
    ]

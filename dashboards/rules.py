"""Prometheus recording rules and alerts, built from `connector.vocabulary`.

Thresholds are the constants below; dashboards/README.md lists every rule and
dashboards/rules/nixl-push.rules.test.yaml tests each alert firing and quiet.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from connector import vocabulary as V
from connector.vocabulary import Label
from dashboards import runbooks, slo, witness
from dashboards.queries import (
    D_TO_P,
    FAILURE,
    FLAVOR,
    FULL,
    INSTANCE,
    NOT_SUCCESS,
    NOTIF_ONLY,
    QUEUE_WAIT,
    RECEIVE_SUCCESS,
    STILL_WANTED,
    UNKNOWN_REQUEST,
    by,
    eq,
    hcount,
    hsum,
    one_of,
    quantile,
    sel,
    total,
)

RULES_FILE = "rules/nixl-push.rules.yaml"

# Alert thresholds (seconds / ratios / windows); see dashboards/README.md.
FAILURE_RATIO_THRESHOLD = 0.10
P99_LATENCY_THRESHOLD_S = 2.5
QUEUE_WAIT_P95_THRESHOLD_S = 0.5
RECEIVE_P99_THRESHOLD_S = 5.0
FULL_D_TO_P_WINDOW = "15m"
# Three default side-channel timeouts (5 s each): past this a handshake is hung, not slow.
STUCK_THRESHOLD_S = 15
LEASE_EXPIRY_WINDOW = "10m"
# Heartbeats go out every 5 s (a 30 s lease / 6): ids matching nothing for this long are
# no stray late heartbeat but a decoder heartbeating the wrong prefill, or an id mismatch.
UNKNOWN_HEARTBEAT_FOR = "15m"
PEER_RESTART_WINDOW = "10m"
# A decode request waiting this long for its KV waits on something that will not come
# soon: a network partition between it and its prefill, or a prefill that never answers
# (vLLM's own watchdog, push_registration_timeout, is 480 s).
REMOTE_PREFILL_WAIT_THRESHOLD_S = 120
# Clients getting an engine error through the router: the share of its requests that
# failed on a leg (bad bodies and clients that went away are not the deployment's fault).
ROUTER_ERROR_RATIO_THRESHOLD = 0.05
ROUTER_WINDOW = "10m"
# The share of decode engines' TTFT spent waiting for KV: an alert when, for 15 minutes, it is
# at least this high and this many points above its own mean over the 6 hours that ended an
# hour before (so the rise itself is not in the baseline while the alert decides).
KV_WAIT_SHARE_FLOOR = 0.5
KV_WAIT_SHARE_RISE = 0.15
KV_WAIT_SHARE_BASELINE = "6h"
KV_WAIT_SHARE_BASELINE_ENDS = "1h"
KV_WAIT_SHARE_FOR = "15m"
KV_WAIT_SHARE_RECORD = "instance:vllm_nixl_push_kv_wait:ttft_share_rate5m"


def s(series: str, *matchers: str) -> str:
    """A selector without the dashboard variables: rules see every job and instance."""
    return sel(series, *matchers, scoped=False)


def _lease_alerts() -> list[dict[str, Any]]:
    """KV leases: lost while a decoder still wanted them; heartbeats renewing nothing."""
    expiries, renewals = total(V.KV_LEASE_EXPIRIES), total(V.KV_LEASE_RENEWALS)
    win = LEASE_EXPIRY_WINDOW
    return [
        {"alert": "NixlKvLeaseExpiredWhileWanted",
         "expr": f"sum {by(*INSTANCE, Label.FATE)} (increase({s(expiries, STILL_WANTED)}[{win}]))\n> 0",
         "labels": {"severity": "warning"},
         "annotations": {
             "summary": "KV leases expired while a decoder waited, on {{ $labels.instance }}",
             "description": "{{ $value }} KV lease(s) on prefill engine {{ $labels.instance }} "
                            f"expired in the last {win} with fate {{{{ $labels.fate }}}}: a "
                            "decoder still wanted the request (waiting: it heartbeated but sent no "
                            "PUSH_REG in time; registered: its PUSH_REG arrived but no WRITE was "
                            "posted). The blocks are released and the decoder recomputes or "
                            "fails the request."}},
        {"alert": "NixlHeartbeatsMatchNothing",
         "expr": f"sum {by(*INSTANCE)} (rate({s(renewals, UNKNOWN_REQUEST)}[5m]))\n> 0",
         "for": UNKNOWN_HEARTBEAT_FOR,
         "labels": {"severity": "warning"},
         "annotations": {
             "summary": "Heartbeats renew nothing on {{ $labels.instance }}",
             "description": "Decoders' heartbeats have named request ids that prefill engine "
                            "{{ $labels.instance }} neither holds nor recently held "
                            "({{ printf \"%.2f\" $value }} ids/s) for "
                            f"{UNKNOWN_HEARTBEAT_FOR}: a decoder heartbeats the wrong prefill, "
                            "this engine restarted, or request ids no longer match. Those leases "
                            "are not renewed, so requests queued on a decoder can lose their KV."}},
    ]


def _peer_alerts() -> list[dict[str, Any]]:
    """A remote engine came back with a new NIXL agent: the requests it held were lost.
    A request waits for its KV far longer than a lease: its prefill is out of reach."""
    restarts = total(V.PEER_RESTARTS)
    win = PEER_RESTART_WINDOW
    return [
        {"alert": "NixlPeerRestarted",
         "expr": f"sum {by(*INSTANCE, Label.DIRECTION)} (increase({s(restarts)}[{win}]))\n> 0",
         "labels": {"severity": "info"},
         "annotations": {
             "summary": "A NIXL peer of {{ $labels.instance }} restarted",
             "description": "{{ $value }} re-handshake(s) of engine {{ $labels.instance }} "
                            f"({{{{ $labels.direction }}}}) in the last {win} found the peer back "
                            "under the same engine id with a new NIXL agent. The requests whose "
                            "KV the old instance held were failed at once (recomputed or failed "
                            "per kv_load_failure_policy); new requests use the new connection."}},
        {"alert": "NixlRemotePrefillWaitingLong",
         "expr": f"max {by(*INSTANCE)} ({s(V.REMOTE_PREFILL_OLDEST_WAIT.name)})"
                 f" > {REMOTE_PREFILL_WAIT_THRESHOLD_S}",
         "for": "1m",
         "labels": {"severity": "warning"},
         "annotations": {
             "summary": "A request on {{ $labels.instance }} waits long for its KV",
             "description": "The oldest request on decode engine {{ $labels.instance }} has waited "
                            "{{ $value | humanizeDuration }} for KV from a prefill engine (threshold "
                            f"{REMOTE_PREFILL_WAIT_THRESHOLD_S}s). Nothing failed: the path to its "
                            "prefill may be partitioned (NIXL queues what it cannot send), or the "
                            "prefill never answers; vLLM fails it after push_registration_timeout."}},
    ]


def _push_state_alerts() -> list[dict[str, Any]]:
    """NIXL would not release a WRITE past its timeout: its lease's blocks stay held. A
    step of the data path raised: a defect, its request failed by the failure path."""
    aborts = total(V.WRITE_ABORTS)
    failed = eq(Label.OUTCOME, V.WriteAbort.ABORT_FAILED.value)
    internal = total(V.INTERNAL_ERRORS)
    return [
        {"alert": "NixlInternalError",
         "expr": f"sum {by(*INSTANCE, Label.STEP)} (increase({s(internal)}[{PEER_RESTART_WINDOW}]))\n> 0",
         "labels": {"severity": "warning"},
         "annotations": {
             "summary": "The NIXL push connector on {{ $labels.instance }} hit an internal error",
             "description": "{{ $value }} step(s) of the push's data path ({{ $labels.step }}) raised "
                            f"on engine {{{{ $labels.instance }}}} in the last {PEER_RESTART_WINDOW}: a "
                            "defect of the connector. The requests concerned ended by the failure "
                            "path (recomputed or failed per kv_load_failure_policy), none was left "
                            "waiting. The engine's ERROR log line \"Internal error\" has the traceback: "
                            "please report it."}},
        {"alert": "NixlPushWriteAbortFailed",
         "expr": f"sum {by(*INSTANCE)} (increase({s(aborts, failed)}[{PEER_RESTART_WINDOW}]))\n> 0",
         "labels": {"severity": "warning"},
         "annotations": {
             "summary": "NIXL keeps a stuck WRITE on {{ $labels.instance }}",
             "description": "{{ $value }} WRITE(s) of prefill engine {{ $labels.instance }} did "
                            "not settle within push_write_timeout_s and NIXL refused to release "
                            f"them in the last {PEER_RESTART_WINDOW}. Their KV blocks stay held "
                            "(nothing is freed under a running WRITE) and the abort is retried "
                            "every step; the link to the decoder is likely broken."}},
    ]


KV_MISMATCH_WINDOW = "5m"


def _integrity_alerts() -> list[dict[str, Any]]:
    """A decoder found received KV that is not what its prefill sent: any is an incident."""
    verify = total(V.KV_VERIFY)
    mismatch = eq(Label.OUTCOME, V.KvVerifyOutcome.MISMATCH.value)
    return [
        {"alert": "NixlKvIntegrityMismatch",
         "expr": f"sum {by(*INSTANCE)} (increase({s(verify, mismatch)}[{KV_MISMATCH_WINDOW}]))\n> 0",
         "labels": {"severity": "critical"},
         "annotations": {
             "summary": "KV received on {{ $labels.instance }} differed from what its prefill sent",
             "description": "{{ $value }} sampled receive(s) of decode engine {{ $labels.instance }} "
                            f"in the last {KV_MISMATCH_WINDOW} held KV whose digest differed from the "
                            "one its prefill computed before the WRITE. With kv_verify_action=fail they "
                            "were failed and recomputed (or failed, per kv_load_failure_policy); with "
                            "observe they were answered from that KV. The engine's ERROR line \"KV "
                            "integrity\" names the request, the prefill and the layers."}},
    ]


UNAUTHENTICATED_WINDOW = "10m"


def _trust_alerts() -> list[dict[str, Any]]:
    """A peer without the deployment's secret reached an engine (side_channel_secret_file)."""
    refused, win = total(V.PEER_AUTH_REFUSALS), UNAUTHENTICATED_WINDOW
    return [
        {"alert": "NixlUnauthenticatedPeer",
         "expr": f"sum {by(*INSTANCE, Label.CHANNEL, Label.REASON)} (increase({s(refused)}[{win}]))\n> 0",
         "labels": {"severity": "warning"},
         "annotations": {
             "summary": "A peer without the deployment's secret reached {{ $labels.instance }}",
             "description": "{{ $value }} {{ $labels.channel }} exchange(s) with engine "
                            f"{{{{ $labels.instance }}}} in the last {win} were refused as "
                            "{{ $labels.reason }}: something without the secret asked for this "
                            "engine's NIXL metadata or sent it a notification (no_proof, bad_proof), "
                            "or a peer it asked did not prove the secret (peer_not_authenticating, "
                            "peer_bad_proof). Nothing was sent to it and nothing it sent was acted on; "
                            "the engine's WARNING \"Refused peer\" or \"Refused a notification from\" "
                            "names it."}},
    ]


def _router_alerts() -> list[dict[str, Any]]:
    """The router's clients get errors: a leg failed for a share of its requests."""
    reqs, win = total(V.ROUTER_REQUESTS), ROUTER_WINDOW
    target = ("job", "instance")
    failed = one_of(Label.OUTCOME, V.RouterOutcome.PREFILL_FAILED, V.RouterOutcome.DECODE_FAILED)
    counted = f'{Label.OUTCOME}!="{V.RouterOutcome.BAD_REQUEST.value}"'
    return [
        {"alert": "NixlRouterLegErrorRatioHigh",
         "expr": f"sum {by(*target)} (rate({s(reqs, failed)}[{win}]))\n/\n"
                 f"(sum {by(*target)} (rate({s(reqs, counted)}[{win}])) > 0)\n"
                 f"> {ROUTER_ERROR_RATIO_THRESHOLD}",
         "for": "5m",
         "labels": {"severity": "warning"},
         "annotations": {
             "summary": "Router requests failing on a leg on {{ $labels.instance }}",
             "description": "{{ $value | humanizePercentage }} of the requests router "
                            f"{{{{ $labels.instance }}}} handled over {win} failed on their prefill "
                            "or decode leg (threshold "
                            f"{ROUTER_ERROR_RATIO_THRESHOLD:.0%}): clients got an engine's error. See "
                            "the Router row for which leg, and the engines' rows for why."}},
    ]


def _ttft_alerts() -> list[dict[str, Any]]:
    """TTFT shifts to waiting for KV: the prefill side (queue, prefill, handoff) slowed."""
    share, base = KV_WAIT_SHARE_RECORD, KV_WAIT_SHARE_BASELINE
    return [
        {"alert": "NixlKvWaitShareRising",
         "expr": f"{share} - avg_over_time({share}[{base}] offset {KV_WAIT_SHARE_BASELINE_ENDS})\n"
                 f"> {KV_WAIT_SHARE_RISE}\nand\n{share} > {KV_WAIT_SHARE_FLOOR}",
         "for": KV_WAIT_SHARE_FOR,
         "labels": {"severity": "warning"},
         "annotations": {
             "summary": "TTFT on {{ $labels.instance }} goes more and more to waiting for KV",
             "description": "The share of decode engine {{ $labels.instance }}'s TTFT spent "
                            "waiting for KV from a prefill engine rose by {{ $value | "
                            f"humanizePercentage }}}} (points) over its mean of the {base} that ended "
                            f"{KV_WAIT_SHARE_BASELINE_ENDS} ago (threshold {KV_WAIT_SHARE_RISE:.0%}, "
                            f"with at least {KV_WAIT_SHARE_FLOOR:.0%} of TTFT waiting). The "
                            "prefill side slowed: its queue, its prefill, or the handoff (see the "
                            "Where TTFT goes row, and an exemplar's trace for one slow request)."}},
    ]


@dataclass(frozen=True)
class RuleSettings:
    """What a deployment may set when it generates its rules (`python -m dashboards.generate`)."""

    runbook_base_url: str = runbooks.DEFAULT_BASE_URL


DEFAULT_SETTINGS = RuleSettings()


def build_rules(settings: RuleSettings = DEFAULT_SETTINGS) -> dict[str, Any]:
    """The rule groups: recording rules, then alerts (one per engine: `INSTANCE`, the SLO
    burn rates per served model), each alert with a `runbook_url` to its section of
    docs/runbooks.md under the settings' base URL."""
    dur_count, hs_total = hcount(V.HANDSHAKE_DURATION), total(V.HANDSHAKES)

    full_d_to_p = s(hs_total, D_TO_P, FULL)
    recording = [
        {"record": "instance:vllm_nixl_handshakes:rate5m",
         "expr": f"sum {by(*INSTANCE, *FLAVOR)} (\n  rate({dur_count}[5m])\n)"},
        {"record": "instance:vllm_nixl_handshakes_d_to_p_notif_only:ratio1h",
         "expr": f"sum {by(*INSTANCE)} (increase({s(dur_count, D_TO_P, NOTIF_ONLY)}[1h]))\n"
                 f"/\n(sum {by(*INSTANCE)} (increase({s(dur_count, D_TO_P)}[1h])) > 0)"},
        {"record": "instance:vllm_nixl_handshake_failures:ratio_rate5m",
         "expr": f"(\n  sum {by(*INSTANCE, Label.DIRECTION)} (rate({s(hs_total, FAILURE)}[5m]))\n"
                 f"  or\n  sum {by(*INSTANCE, Label.DIRECTION)} (rate({hs_total}[5m])) * 0\n)\n"
                 f"/\n(sum {by(*INSTANCE, Label.DIRECTION)} (rate({hs_total}[5m])) > 0)"},
        {"record": "instance:vllm_nixl_handshake_duration_seconds:p99_rate5m",
         "expr": quantile(0.99, V.HANDSHAKE_DURATION, (*INSTANCE, *FLAVOR), "5m", scoped=False,
                          multiline=True)},
        {"record": "instance:vllm_nixl_handshake_queue_wait_seconds:p95_rate5m",
         "expr": quantile(0.95, V.HANDSHAKE_PHASE_DURATION, (*INSTANCE, Label.DIRECTION), "5m",
                          QUEUE_WAIT, scoped=False, multiline=True)},
        {"record": "instance:vllm_nixl_push_receive_duration_seconds:p99_rate5m",
         "expr": quantile(0.99, V.RECEIVE_DURATION, (*INSTANCE, Label.OUTCOME), "5m",
                          scoped=False, multiline=True)},
        {"record": KV_WAIT_SHARE_RECORD,
         "expr": f"sum {by(*INSTANCE)} (rate({hsum(V.KV_WAIT)}[5m]))\n/\n"
                 f"(sum {by(*INSTANCE)} (rate({hsum(V.VLLM_TTFT)}[5m])) > 0)"},
        {"record": "instance:vllm_nixl_descriptors_saved:rate5m",
         "expr": f"sum {by(*INSTANCE, Label.DIRECTION)} (\n  rate({total(V.DESCRIPTORS_SAVED)}[5m])\n)"},
        *witness.recording_rules(),
    ]
    win = FULL_D_TO_P_WINDOW
    alerts = [
        {"alert": "NixlFullDToPHandshake",
         "expr": f"(sum {by(*INSTANCE)} (increase({full_d_to_p}[{win}])) > 0)\nor\n"
                 f"count {by(*INSTANCE)} (({full_d_to_p} > 0) unless {full_d_to_p} offset {win})",
         "labels": {"severity": "warning"},
         "annotations": {
             "summary": "Full D->P NIXL handshake in push mode on {{ $labels.instance }}",
             "description": "{{ $value }} full (descriptor-preparing) decode-to-prefill "
                            f"handshake(s) in the last {win} on {{{{ $labels.instance }}}} "
                            "(engine {{ $labels.engine }}). In push mode D only needs P's agent "
                            "for notifications, so the notification-only handshake has "
                            "regressed. The second branch catches a series born by its first "
                            "handshake, which increase() cannot see."}},
        {"alert": "NixlHandshakeFailureRatioHigh",
         "expr": f"sum {by(*INSTANCE, Label.DIRECTION)} (rate({s(hs_total, FAILURE)}[15m]))\n"
                 f"/\nsum {by(*INSTANCE, Label.DIRECTION)} (rate({hs_total}[15m]))\n"
                 f"> {FAILURE_RATIO_THRESHOLD}",
         "for": "5m",
         "labels": {"severity": "warning"},
         "annotations": {
             "summary": "NIXL handshakes failing on {{ $labels.instance }}",
             "description": "{{ $value | humanizePercentage }} of {{ $labels.direction }} "
                            "handshakes failed over 15m (threshold "
                            f"{FAILURE_RATIO_THRESHOLD:.0%}); see the failures by phase and "
                            "error type on the NIXL push handshakes dashboard."}},
        {"alert": "NixlHandshakeLatencyP99High",
         "expr": quantile(0.99, V.HANDSHAKE_DURATION, (*INSTANCE, *FLAVOR), "10m", scoped=False,
                          drop_nan=False, multiline=True) + f" > {P99_LATENCY_THRESHOLD_S}",
         "for": "5m",
         "labels": {"severity": "warning"},
         "annotations": {
             "summary": "Slow NIXL handshakes on {{ $labels.instance }}",
             "description": "p99 of {{ $labels.direction }} handshakes (notif_agents_only="
                            "{{ $labels.notif_agents_only }}) is {{ $value | humanizeDuration }} "
                            f"over 10m (threshold {P99_LATENCY_THRESHOLD_S}s)."}},
        {"alert": "NixlHandshakeQueueWaitHigh",
         "expr": quantile(0.95, V.HANDSHAKE_PHASE_DURATION, (*INSTANCE, Label.DIRECTION), "10m",
                          QUEUE_WAIT, scoped=False, drop_nan=False, multiline=True)
         + f" > {QUEUE_WAIT_P95_THRESHOLD_S}",
         "for": "5m",
         "labels": {"severity": "warning"},
         "annotations": {
             "summary": "NIXL handshakes queueing in the executor on {{ $labels.instance }}",
             "description": "p95 executor queue wait of {{ $labels.direction }} handshakes is "
                            "{{ $value | humanizeDuration }} over 10m (threshold "
                            f"{QUEUE_WAIT_P95_THRESHOLD_S}s): handshakes wait behind each "
                            "other in vLLM's handshake executor."}},
        {"alert": "NixlHandshakeStuck",
         "expr": f"max {by(*INSTANCE, Label.DIRECTION)} ({V.HANDSHAKE_OLDEST_IN_FLIGHT.name})"
                 f" > {STUCK_THRESHOLD_S}",
         "for": "1m",
         "labels": {"severity": "warning"},
         "annotations": {
             "summary": "NIXL handshake stuck on {{ $labels.instance }}",
             "description": "A {{ $labels.direction }} handshake has been in flight for "
                            "{{ $value | humanizeDuration }} (threshold "
                            f"{STUCK_THRESHOLD_S}s, three side-channel timeouts): it is hung, "
                            "and every handshake queued behind it in vLLM's one-thread "
                            "executor waits too."}},
        {"alert": "NixlPushRegRejected",
         "expr": f"sum {by(*INSTANCE, Label.REASON)} (increase({s(total(V.PUSH_REG_REJECTED))}[10m]))"
                 "\n> 0",
         "labels": {"severity": "warning"},
         "annotations": {
             "summary": "Malformed PUSH_REG notifications on {{ $labels.instance }}",
             "description": "{{ $value }} PUSH_REG notification(s) dropped as "
                            "{{ $labels.reason }} in the last 10m: a decoder runs an "
                            "incompatible build, or something else sends to this agent."}},
        {"alert": "NixlPushesFailing",
         "expr": f"sum {by(*INSTANCE)} "
                 f"(increase({s(total(V.PUSHES), eq(Label.OUTCOME, V.PushEvent.FAILED))}[10m]))\n> 0",
         "labels": {"severity": "warning"},
         "annotations": {
             "summary": "KV pushes failing on {{ $labels.instance }}",
             "description": "{{ $value }} KV push(es) failed on prefill engine "
                            "{{ $labels.instance }} in the last 10m."}},
        {"alert": "NixlReceivesFailing",
         "expr": f"sum {by(*INSTANCE, Label.OUTCOME)} (increase({s(hcount(V.RECEIVE_DURATION), NOT_SUCCESS)}"
                 f"[10m]))\n> 0",
         "labels": {"severity": "warning"},
         "annotations": {
             "summary": "KV receives failing on {{ $labels.instance }}",
             "description": "{{ $value }} KV receive(s) ended with outcome {{ $labels.outcome }} "
                            "on decode engine {{ $labels.instance }} in the last 10m: the request "
                            "got no pushed KV (failure: handshake or PUSH_REG failed; expired: "
                            "nothing landed within the registration timeout). Open an exemplar "
                            "of the receive latency panel for the request's trace."}},
        {"alert": "NixlReceiveLatencyP99High",
         "expr": quantile(0.99, V.RECEIVE_DURATION, INSTANCE, "10m", RECEIVE_SUCCESS,
                          scoped=False, drop_nan=False, multiline=True)
         + f" > {RECEIVE_P99_THRESHOLD_S}",
         "for": "5m",
         "labels": {"severity": "warning"},
         "annotations": {
             "summary": "Slow KV receives on {{ $labels.instance }}",
             "description": "p99 of successful KV receives on decode engine {{ $labels.instance }} "
                            "is {{ $value | humanizeDuration }} over 10m (threshold "
                            f"{RECEIVE_P99_THRESHOLD_S}s), from registration to KV landed."}},
        *_lease_alerts(),
        *_peer_alerts(),
        *_push_state_alerts(),
        *_integrity_alerts(),
        *_trust_alerts(),
        *_router_alerts(),
        *_ttft_alerts(),
    ]
    alerts += witness.alerts()
    alerts += slo.alerts(slo.OBJECTIVES)
    for alert in alerts:
        alert["annotations"]["runbook_url"] = runbooks.link(alert["alert"], settings.runbook_base_url)
    return {"groups": [
        {"name": "nixl-push.recording", "rules": recording},
        {"name": "nixl-push.slo", "rules": slo.recording_rules(slo.OBJECTIVES)},
        {"name": "nixl-push.alerts", "rules": alerts},
    ]}

"""The one place that names things: handshake phases, span names, attribute keys,
metric names, label names and every value a label may take.

Everything else (worker glue, stats, Prometheus, tracing, dashboards, rules) imports
from here, so a renamed metric or phase cannot drift between code and dashboards.
Label value sets are closed enums: no request ids, engine ids or hosts ever become
metric labels.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class _Vocab(StrEnum):
    """String enum whose members compare and format as their value."""


class Phase(_Vocab):
    """Handshake phases, in the order they run for one remote rank."""

    QUEUE_WAIT = "queue_wait"
    METADATA_FETCH = "metadata_fetch"
    METADATA_DECODE = "metadata_decode"
    AGENT_LOAD = "agent_load"
    TRANSFER_PLAN = "transfer_plan"
    DESCRIPTOR_REGISTRATION = "descriptor_registration"


# Phases that only a full (descriptor-preparing) handshake runs.
FULL_ONLY_PHASES = frozenset({Phase.TRANSFER_PLAN, Phase.DESCRIPTOR_REGISTRATION})


class Direction(_Vocab):
    D_TO_P = "d_to_p"
    P_TO_D = "p_to_d"


class Trigger(_Vocab):
    PUSH_REG = "push_reg"
    HEARTBEAT = "heartbeat"
    PUSH_WRITE = "push_write"
    OTHER = "other"


class Outcome(_Vocab):
    SUCCESS = "success"
    FAILURE = "failure"


class ErrorType(_Vocab):
    """Bounded failure classes; `classify_error` maps exceptions onto them."""

    UNREACHABLE = "unreachable"
    TIMEOUT = "timeout"
    COMPAT_HASH_MISMATCH = "compat_hash_mismatch"
    ENGINE_ID_MISMATCH = "engine_id_mismatch"
    CONFIG_MISMATCH = "config_mismatch"
    DECODE_ERROR = "decode_error"
    NIXL_ERROR = "nixl_error"
    OTHER = "other"


class DescriptorList(_Vocab):
    """Which side a prepared descriptor list describes."""

    REMOTE = "remote"
    LOCAL = "local"


class PushEvent(_Vocab):
    STARTED = "started"
    COMPLETED = "completed"
    FAILED = "failed"


class NotifOutcome(_Vocab):
    SENT = "sent"
    FAILED = "failed"


BOOL_VALUES = ("true", "false")


def bool_label(value: bool) -> str:
    """Prometheus label value for a boolean (lower-case, like OTel)."""
    return "true" if value else "false"


# --------------------------------------------------------------------------- spans
TRACER_NAME = "connector.nixl_push"

SPAN_HANDSHAKE = "nixl.handshake"
SPAN_PHASE_PREFIX = "nixl.handshake."
SPAN_PUSH_REGISTER = "nixl.push.register"
SPAN_PUSH_WRITE = "nixl.push.write"
SPAN_PUSH_RECEIVE = "nixl.push.receive"


def phase_span_name(phase: Phase) -> str:
    return SPAN_PHASE_PREFIX + phase.value


class Attr:
    """Span attribute keys (OTel semantic conventions where one exists)."""

    NOTIF_AGENTS_ONLY = "vllm.nixl.notif_agents_only"
    DIRECTION = "vllm.nixl.handshake.direction"
    TRIGGER = "vllm.nixl.handshake.trigger"
    OUTCOME = "vllm.nixl.handshake.outcome"
    UPGRADE = "vllm.nixl.handshake.upgrade"
    PHASE = "vllm.nixl.handshake.phase"
    REMOTE_ENGINE_ID = "vllm.nixl.remote_engine_id"
    LOCAL_ENGINE_ID = "vllm.nixl.engine_id"
    REMOTE_TP_SIZE = "vllm.nixl.remote_tp_size"
    REMOTE_PP_SIZE = "vllm.nixl.remote_pp_size"
    REMOTE_TP_RANK = "vllm.nixl.remote_tp_rank"
    REMOTE_PP_RANK = "vllm.nixl.remote_pp_rank"
    LOCAL_TP_RANK = "vllm.nixl.local_tp_rank"
    DESCRIPTOR_REGISTRATIONS = "vllm.nixl.descriptor_registrations"
    DESCRIPTORS_REGISTERED = "vllm.nixl.descriptors_registered"
    DESCRIPTOR_REGISTRATIONS_SAVED = "vllm.nixl.descriptor_registrations_saved"
    DESCRIPTORS_SAVED = "vllm.nixl.descriptors_saved"
    REQUEST_ID = "gen_ai.request.id"
    REMOTE_REQUEST_ID = "vllm.nixl.remote_request_id"
    NUM_BLOCKS = "vllm.nixl.push.num_blocks"
    SERVER_ADDRESS = "server.address"
    SERVER_PORT = "server.port"
    ERROR_TYPE = "error.type"


# Extra key carried inside the PUSH_REG msgpack dict. A stock peer reads the dict
# with .get() and ignores it; a payload without it is handled like before.
PUSH_REG_TRACE_KEY = "otel_trace_context"


# ------------------------------------------------------------------------- metrics
class Label:
    MODEL_NAME = "model_name"  # vLLM's own labels, kept first
    ENGINE = "engine"
    DIRECTION = "direction"
    TRIGGER = "trigger"
    NOTIF_AGENTS_ONLY = "notif_agents_only"
    OUTCOME = "outcome"
    PHASE = "phase"
    ERROR_TYPE = "error_type"
    LIST = "list"


# Allowed values per label (the dashboards and the label-cardinality test use these).
LABEL_VALUES: dict[str, tuple[str, ...]] = {
    Label.DIRECTION: tuple(d.value for d in Direction),
    Label.TRIGGER: tuple(t.value for t in Trigger),
    Label.NOTIF_AGENTS_ONLY: BOOL_VALUES,
    Label.OUTCOME: tuple(dict.fromkeys(
        [o.value for o in Outcome] + [o.value for o in NotifOutcome] + [e.value for e in PushEvent])),
    Label.PHASE: tuple(p.value for p in Phase),
    Label.ERROR_TYPE: tuple(e.value for e in ErrorType),
    Label.LIST: tuple(x.value for x in DescriptorList),
}


class MetricKind(_Vocab):
    COUNTER = "counter"
    HISTOGRAM = "histogram"


@dataclass(frozen=True)
class MetricSpec:
    """A metric as exposed on /metrics (counters get `_total` from the client)."""

    name: str
    kind: MetricKind
    labels: tuple[str, ...]
    help: str
    unit: str = ""
    buckets: tuple[float, ...] = ()

    @property
    def series_names(self) -> tuple[str, ...]:
        """Sample names Prometheus stores for this metric."""
        if self.kind is MetricKind.COUNTER:
            return (self.name + "_total",)
        return (self.name + "_bucket", self.name + "_sum", self.name + "_count")


# Handshakes span ~1 ms (in-process notif-only) to many seconds (timeouts, 1M descs).
HANDSHAKE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
                     30.0)
PHASE_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                 5.0, 10.0)

HANDSHAKES = MetricSpec(
    "vllm:nixl_handshakes",
    MetricKind.COUNTER,
    (Label.DIRECTION, Label.TRIGGER, Label.NOTIF_AGENTS_ONLY, Label.OUTCOME),
    "NIXL handshakes started by this engine's push workers, by direction, trigger, "
    "flavor (notif_agents_only) and outcome.",
)
HANDSHAKE_DURATION = MetricSpec(
    "vllm:nixl_handshake_duration_seconds",
    MetricKind.HISTOGRAM,
    (Label.DIRECTION, Label.NOTIF_AGENTS_ONLY, Label.OUTCOME),
    "Wall time of a NIXL handshake from submission to vLLM's handshake executor "
    "until it finished (includes queue_wait).",
    unit="s",
    buckets=HANDSHAKE_BUCKETS,
)
HANDSHAKE_PHASE_DURATION = MetricSpec(
    "vllm:nixl_handshake_phase_duration_seconds",
    MetricKind.HISTOGRAM,
    (Label.DIRECTION, Label.NOTIF_AGENTS_ONLY, Label.PHASE),
    "Time one handshake spent in one phase, summed over the remote ranks it reached.",
    unit="s",
    buckets=PHASE_BUCKETS,
)
HANDSHAKE_PHASE_FAILURES = MetricSpec(
    "vllm:nixl_handshake_phase_failures",
    MetricKind.COUNTER,
    (Label.DIRECTION, Label.PHASE, Label.ERROR_TYPE),
    "Failed NIXL handshakes by the phase that failed and a bounded error type.",
)
DESCRIPTOR_REGISTRATIONS = MetricSpec(
    "vllm:nixl_descriptor_registrations",
    MetricKind.COUNTER,
    (Label.DIRECTION, Label.LIST),
    "Descriptor lists prepared (NIXL prep_xfer_dlist calls) during handshakes.",
)
DESCRIPTORS_REGISTERED = MetricSpec(
    "vllm:nixl_descriptors_registered",
    MetricKind.COUNTER,
    (Label.DIRECTION, Label.LIST),
    "Descriptors in the lists prepared during handshakes.",
)
DESCRIPTOR_REGISTRATIONS_SAVED = MetricSpec(
    "vllm:nixl_descriptor_registrations_saved",
    MetricKind.COUNTER,
    (Label.DIRECTION,),
    "Descriptor lists a full handshake would have prepared for the same peer but "
    "the notification-only handshake skipped.",
)
DESCRIPTORS_SAVED = MetricSpec(
    "vllm:nixl_descriptors_saved",
    MetricKind.COUNTER,
    (Label.DIRECTION,),
    "Descriptors a full handshake would have prepared for the same peer but the "
    "notification-only handshake skipped.",
)
PUSH_REG_NOTIFS = MetricSpec(
    "vllm:nixl_push_reg_notifs",
    MetricKind.COUNTER,
    (Label.OUTCOME,),
    "PUSH_REG notifications sent by decode workers to prefill agents (one per agent).",
)
PUSHES = MetricSpec(
    "vllm:nixl_pushes",
    MetricKind.COUNTER,
    (Label.OUTCOME,),
    "KV pushes (WRITEs of one request) on prefill workers: started, completed, failed.",
)

ALL_METRICS: tuple[MetricSpec, ...] = (
    HANDSHAKES,
    HANDSHAKE_DURATION,
    HANDSHAKE_PHASE_DURATION,
    HANDSHAKE_PHASE_FAILURES,
    DESCRIPTOR_REGISTRATIONS,
    DESCRIPTORS_REGISTERED,
    DESCRIPTOR_REGISTRATIONS_SAVED,
    DESCRIPTORS_SAVED,
    PUSH_REG_NOTIFS,
    PUSHES,
)

# `outcome` is a different closed set per metric; LABEL_VALUES holds the union.
METRIC_LABEL_VALUES: dict[tuple[str, str], tuple[str, ...]] = {
    (HANDSHAKES.name, Label.OUTCOME): tuple(o.value for o in Outcome),
    (HANDSHAKE_DURATION.name, Label.OUTCOME): tuple(o.value for o in Outcome),
    (PUSH_REG_NOTIFS.name, Label.OUTCOME): tuple(o.value for o in NotifOutcome),
    (PUSHES.name, Label.OUTCOME): tuple(e.value for e in PushEvent),
}


def allowed_values(metric: str, label: str) -> tuple[str, ...]:
    """The closed set of values `label` may take on `metric`."""
    return METRIC_LABEL_VALUES.get((metric, label), LABEL_VALUES.get(label, ()))


# Stock vLLM NIXL metrics we keep emitting unchanged (dashboards may query them).
STOCK_METRICS: tuple[MetricSpec, ...] = (
    MetricSpec("vllm:nixl_xfer_time_seconds", MetricKind.HISTOGRAM, (), "NIXL transfer duration.", "s"),
    MetricSpec("vllm:nixl_post_time_seconds", MetricKind.HISTOGRAM, (), "NIXL transfer post time.", "s"),
    MetricSpec("vllm:nixl_bytes_transferred", MetricKind.HISTOGRAM, (), "Bytes per NIXL transfer.", "bytes"),
    MetricSpec("vllm:nixl_num_descriptors", MetricKind.HISTOGRAM, (), "Descriptors per NIXL transfer."),
    MetricSpec("vllm:nixl_num_failed_transfers", MetricKind.COUNTER, (), "Failed NIXL transfers."),
    MetricSpec("vllm:nixl_num_failed_notifications", MetricKind.COUNTER, (), "Failed NIXL notifications."),
    MetricSpec("vllm:nixl_num_kv_expired_reqs", MetricKind.COUNTER, (), "Requests whose KV lease expired."),
    MetricSpec(
        "vllm:nixl_num_notifications_after_expiry",
        MetricKind.COUNTER,
        (),
        "Completion notifications after a lease expired.",
    ),
)


# ------------------------------------------------------- worker -> frontend stats
class StatKey:
    """Keys this fork adds to vLLM's serializable NIXL stats dict."""

    HANDSHAKES = "handshakes"
    PUSH_REG_SENT = "push_reg_notifs_sent"
    PUSH_REG_FAILED = "push_reg_notifs_failed"
    PUSHES_STARTED = "pushes_started"
    PUSHES_COMPLETED = "pushes_completed"
    PUSHES_FAILED = "pushes_failed"


OUR_STAT_KEYS = (
    StatKey.HANDSHAKES,
    StatKey.PUSH_REG_SENT,
    StatKey.PUSH_REG_FAILED,
    StatKey.PUSHES_STARTED,
    StatKey.PUSHES_COMPLETED,
    StatKey.PUSHES_FAILED,
)


# ------------------------------------------------------------------ router (connector.router)
ROUTER_TRACER_NAME = "connector.router"
SPAN_ROUTER_REQUEST = "router.request"  # SERVER span, one per client request
SPAN_ROUTER_LEG_PREFIX = "router.leg."  # CLIENT span per leg: router.leg.prefill / router.leg.decode


class RouterLeg(_Vocab):
    PREFILL = "prefill"
    DECODE = "decode"


def router_leg_span_name(leg: RouterLeg) -> str:
    return SPAN_ROUTER_LEG_PREFIX + leg.value


class RouterAttr:
    """Router span attribute keys (OTel HTTP semantic conventions where one exists)."""

    HTTP_ROUTE = "http.route"
    HTTP_METHOD = "http.request.method"
    HTTP_STATUS = "http.response.status_code"
    URL = "url.full"
    STREAM = "vllm.router.stream"
    LEG = "vllm.router.leg"
    REQUEST_ID = "gen_ai.request.id"
    TRANSFER_ID = "vllm.nixl.transfer_id"
    PREFILL_ENGINE_ID = "vllm.nixl.remote_engine_id"
    ERROR_TYPE = "error.type"

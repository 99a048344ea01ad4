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
    # Waiting for another handshake of this worker to finish its NIXL/vLLM registration
    # (they run one at a time: vLLM's NIXL agent has no thread synchronisation).
    REGISTRATION_WAIT = "registration_wait"
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
    # P started its P->D handshake when D's PUSH_REG arrived, before the prefill was
    # done, so the WRITE finds the connection ready.
    PUSH_REG_EARLY = "push_reg_early"
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
    # The side channel's authentication failed (side_channel_secret_file): the peer has no
    # secret, or another one (connector/trust).
    UNAUTHENTICATED = "unauthenticated"
    OTHER = "other"


class DescriptorList(_Vocab):
    """Which side a prepared descriptor list describes."""

    REMOTE = "remote"
    LOCAL = "local"


class NoSaving(_Vocab):
    """Why a notification-only handshake saved nothing: a full one would prepare nothing."""

    PP_PRODUCER = "pp_producer"  # vLLM never prepares descriptors for a PP producer
    # Local block size not a multiple of the remote's (vLLM 0.32/0.33; 0.34 refuses such a handshake).
    BLOCK_SIZE_MISMATCH = "block_size_mismatch"


class PushEvent(_Vocab):
    STARTED = "started"
    COMPLETED = "completed"
    FAILED = "failed"


class NotifOutcome(_Vocab):
    SENT = "sent"
    FAILED = "failed"


class ReceiveOutcome(_Vocab):
    """How a D-side receive ended: KV landed, failed, or the registration timed out."""

    SUCCESS = "success"
    FAILURE = "failure"
    EXPIRED = "expired"


class TelemetryError(_Vocab):
    """Why a piece of telemetry was lost (the push itself never is)."""

    SAVINGS = "savings_failed"  # could not size what a notif-only handshake skipped
    DESCRIPTOR_COUNT = "descriptor_count_failed"  # a prepared list NIXL could not count
    SPAN = "span_failed"  # a span could not be started, ended or emitted
    STATS = "stats_failed"  # a worker-side stats record could not be written
    MALFORMED_RECORD = "malformed_record"  # API server: a stats record dropped whole
    TABLE_FULL = "table_full"  # per-request state past its bound: oldest dropped
    TRACE_CONTEXT = "trace_context_invalid"  # a peer sent an unusable trace context
    # -- trace export back-end: counted per span, never blocking a push --
    SPANS_DROPPED = "spans_dropped"  # batch span queue full (exporter slow or down): span dropped
    SPAN_EXPORT_FAILED = "span_export_failed"  # exporter gave up on a batch or raised: per span


class PushRegRejection(_Vocab):
    """Why P dropped a PUSH_REG notification (a bad one costs no other request)."""

    UNDECODABLE = "undecodable"
    NOT_A_MAP = "not_a_map"
    MISSING_FIELD = "missing_field"
    WRONG_TYPE = "wrong_type"
    OVERSIZED = "oversized"
    FAILED = "processing_failed"  # valid fields, but acting on it raised
    AFTER_LEASE = "after_lease_expired"  # arrived after P's KV lease for the request ended
    UNMATCHED = "unmatched"  # no request on P matched it within unmatched_push_reg_timeout_s
    # Two live requests of this prefill share the PUSH_REG's base request id (a router
    # reused a client's id as the transfer id): P cannot tell whose KV it is, so it refuses.
    AMBIGUOUS = "ambiguous_request_id"
    # The decoder's prompt digest differs from the prefill request's it matched by id.
    PROMPT_MISMATCH = "prompt_mismatch"
    # The same decoder request registered again (a duplicated notification): dropped.
    DUPLICATE = "duplicate"


class PushFailReason(_Vocab):
    """Why P told a decoder that its request's KV will never be pushed."""

    LEASE_EXPIRED = "lease_expired"  # P's lease ended before the PUSH_REG or before the WRITE
    PUSH_FAILED = "push_failed"  # P's WRITE into the decoder's blocks failed
    NO_PREFILL = "no_prefill"  # no request on P matched the PUSH_REG in time (P restarted?)
    AMBIGUOUS = "ambiguous_request_id"  # two of P's live requests share the request id
    PROMPT_MISMATCH = "prompt_mismatch"  # the request id matched a prefill of another prompt
    # P's WRITE did not settle within push_write_timeout_s and was aborted.
    WRITE_TIMEOUT = "write_timeout"
    # The decoder last asked for the KV longer than a lease ago: it may have let the
    # blocks go, so P does not WRITE into them.
    REGISTRATION_STALE = "registration_stale"


class ReceiveFailure(_Vocab):
    """Why a decode worker failed a receive (vLLM then recomputes or fails the request,
    per `kv_load_failure_policy`) instead of waiting for `push_registration_timeout`."""

    HANDSHAKE_FAILED = "handshake_failed"  # D->P handshake failed after its retries
    LEASE_EXPIRED = "lease_expired"  # PUSH_FAIL: P's lease ended first
    PUSH_FAILED = "push_failed"  # PUSH_FAIL: P's WRITE failed
    NO_PREFILL = "no_prefill"  # PUSH_FAIL: P never had the request (restarted?)
    AMBIGUOUS = "ambiguous_request_id"  # PUSH_FAIL: P holds two requests of this id
    PROMPT_MISMATCH = "prompt_mismatch"  # PUSH_FAIL: the id named another prompt on P
    WRITE_TIMEOUT = "write_timeout"  # PUSH_FAIL: P's WRITE was aborted
    REGISTRATION_STALE = "registration_stale"  # PUSH_FAIL: P saw no recent request for it
    # Given up here, then failed once no WRITE into its blocks can still come (see
    # ReceiveAbandon for why it was given up).
    ABANDONED = "abandoned"
    # The KV landed but its digest differed from what P sent (kv_verify_action=fail).
    KV_MISMATCH = "kv_mismatch"
    # Sampled, but the digest of a prefill that sends them was lost (kv_verify_action=fail).
    KV_UNVERIFIED = "kv_unverified"
    PEER_RESTARTED = "peer_restarted"  # P came back with a new NIXL agent: the KV died with it
    PEER_UNREACHABLE = "peer_unreachable"  # P unreachable for longer than its lease lasts
    OTHER = "other"  # failed by vLLM for a reason it did not tell us


class ReceiveAbandon(_Vocab):
    """Why a decode worker gave up a registered receive before its KV landed. Its blocks
    stay held until no WRITE into them can come (a lease plus the WRITE timeout after the
    last time the decoder asked for them), then the receive fails (`abandoned`)."""

    CLIENT_GONE = "client_gone"  # the request was aborted (client disconnected) while it waited
    TIMED_OUT = "registration_timeout"  # no KV within push_registration_timeout
    PEER_UNREACHABLE = "peer_unreachable"  # P answered nothing for longer than a lease
    INTERNAL_ERROR = "internal_error"  # a step of the receive raised (a defect): logged at ERROR


class LeaseState(_Vocab):
    """A prefill's KV lease, from its grant to its end (docs/architecture.md, "Push state")."""

    HELD = "held"  # blocks kept for the decoder; renewable; released at its deadline
    CLAIMED = "claimed"  # a PUSH_REG matched: never released until its WRITE settles
    POSTING = "posting"  # the writer is posting the WRITEs
    WRITING = "writing"  # WRITEs posted, not all settled
    FAILED = "failed"  # no WRITE in flight and none will be: released at the next step
    RELEASED = "released"  # blocks given back to vLLM (expired or failed)
    PUSHED = "pushed"  # every WRITE done: vLLM freed the blocks


class PushFailOutcome(_Vocab):
    SENT = "sent"  # the notification reached the decoder's agents
    UNDELIVERABLE = "undeliverable"  # the decoder could not be reached, or was forgotten


class WriteAbort(_Vocab):
    ABORTED = "aborted"  # NIXL released the WRITE's handles: no byte moves after this
    ABORT_FAILED = "abort_failed"  # NIXL refused: blocks kept until it lets go


class PeerReset(_Vocab):
    """Why a worker dropped its NIXL connection to a remote engine (and will re-handshake)."""

    NOTIFICATION_FAILED = "notification_failed"  # a notification to its agent failed
    TRANSFER_FAILED = "transfer_failed"  # a WRITE into its blocks failed
    SILENT = "silent"  # its side channel did not answer a liveness probe


class InternalStep(_Vocab):
    """A step of the push's data path that raised (a defect of the connector, never a peer's
    input): its request ended by the failure path, logged at ERROR with the traceback."""

    PUSH_FAILURE = "push_failure"  # P: ending a failed push (the lease failed, its peer suspected)
    REGISTRATION = "registration"  # D: what a PUSH_REG reached, into the receive ledger
    NOTIFICATION = "notification"  # writer: a peer's notification handed to its owner
    WRITER_PASS = "writer_pass"  # writer: its due work (owed PUSH_FAILs, unmatched PUSH_REGs)
    STEP = "step"  # main: the step's push state (peers tended, receives timed out, results)
    PEER_RESTART = "peer_restart"  # D: failing the receives of a prefill that restarted
    KV_DIGEST = "kv_digest"  # P: a WRITE's KV digest (sent as skipped); D: a receive's check (failed)


class KvVerifyOutcome(_Vocab):
    """D's check of a received request's KV against the digest its prefill sent."""

    MATCH = "match"  # every layer's digest equal
    MISMATCH = "mismatch"  # some layer differed: failed (kv_verify_action=fail) or observed
    SKIPPED = "skipped"  # sampled, but not checkable: see KvVerifySkip


class KvVerifySkip(_Vocab):
    """Why a sampled receive was not checked (span attribute and DEBUG log; not a label)."""

    STOCK_PREFILL = "stock_prefill"  # no digest came from a prefill that never sent one
    # A prefill that sends digests sent none (MISSING), or not from every rank or for every
    # layer (INCOMPLETE): lost on the way. Not checkable: with kv_verify_action=fail the
    # receive fails (recomputed), since the KV might be the one thing that went wrong.
    MISSING = "missing"
    INCOMPLETE = "incomplete"
    SHAPE = "shape"  # a layout the digest does not cover (see docs/reliability.md)
    # The two sides speak different digest versions (a fork of another release): the
    # prefill answered an ask it cannot compute that way, or a digest named another version.
    VERSION = "digest_version"


class KvVerifyReason(_Vocab):
    """Why a decoder checked a receive (D's scheduler decides, the same for every rank)."""

    SAMPLED = "sampled"  # kv_verify_ratio drew it (at ratio 1: every receive)
    # Its prefill sent a mismatch within kv_verify_escalate_s (each restarts the window).
    ESCALATED = "escalated"
    # Among the first kv_verify_new_peer_requests after a new connection to its prefill,
    # or after that prefill restarted.
    NEW_PEER = "new_peer"
    # It waited longer than a lease before its blocks were allocated: its KV was kept on
    # the prefill by heartbeats alone (docs/reliability.md: why that is a risk).
    AT_RISK = "at_risk"


class KvVerifyAction(_Vocab):
    FAIL = "fail"  # a mismatch fails the receive: kv_load_failure_policy decides
    OBSERVE = "observe"  # a mismatch is counted and logged; the request decodes anyway


class LeaseRenewal(_Vocab):
    """What one request id named in a heartbeat matched on P (one count per P worker)."""

    RENEWED = "renewed"  # a lease P holds: extended
    PREFILLING = "prefilling"  # P is still computing it: its lease starts when it is done
    ALREADY_DONE = "already_done"  # P's lease for it already ended (pushed, or released)
    UNKNOWN_REQUEST = "unknown_request"  # nothing P holds or recently held


class LeaseFate(_Vocab):
    """What P knew of a request when its KV lease expired (its blocks were released)."""

    UNCLAIMED = "unclaimed"  # no decoder ever named it: D leg lost, cancelled, or D down
    WAITING = "waiting"  # a decoder heartbeated for it (queued on D), no PUSH_REG yet
    REGISTERED = "registered"  # D's PUSH_REG arrived, no WRITE was posted (handshake pending or failed)
    PUSH_FAILED = "push_failed"  # the WRITE was posted and failed


class SideChannelRejection(_Vocab):
    """Why an engine's side-channel listener dropped a metadata request (and kept serving)."""

    MALFORMED = "malformed"  # not the (GET_META_MSG, pp_rank, tp_rank) vLLM's handshake sends
    UNKNOWN_RANK = "unknown_rank"  # asked for a (pp, tp) rank this engine does not have


class AuthChannel(_Vocab):
    """Where a peer without the deployment's secret was refused (connector/trust)."""

    SIDE_CHANNEL = "side_channel"  # a metadata request, or the answer to ours
    NOTIFICATION = "notification"  # a NIXL notification (PUSH_REG, heartbeat, PUSH_FAIL, ...)


class AuthRefusal(_Vocab):
    """Why a peer was refused (only with `side_channel_secret_file`)."""

    NO_PROOF = "no_proof"  # it sent no proof: a stock engine, or a fork without the secret
    BAD_PROOF = "bad_proof"  # its proof failed: another secret, or a replayed or stale challenge
    PEER_NOT_AUTHENTICATING = "peer_not_authenticating"  # we asked; it answered without a challenge
    PEER_BAD_PROOF = "peer_bad_proof"  # we asked; its answer's proof failed


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


class SpanEvent(_Vocab):
    """Events our spans carry."""

    # On a span waiting for a handshake another trigger started (vLLM dedups by engine).
    HANDSHAKE_JOINED = "nixl.handshake.joined"
    # P's write span: each heartbeat that extended the request's lease, at its time.
    LEASE_RENEWED = "nixl.kv_lease.renewed"
    # P's write span, or D's receive span on PUSH_FAIL: the lease expired first.
    LEASE_EXPIRED = "nixl.kv_lease.expired"
    # P's write span: the stage boundaries of TTFT it does not start or end itself, at
    # their times: the prefill done (its KV lease granted; before the span's start when
    # the PUSH_REG came later) and the WRITE posted (the handshake and writer wait over).
    PREFILL_DONE = "nixl.push.prefill_done"
    WRITE_POSTED = "nixl.push.write_posted"
    # D's receive span: the KV digest differed (attributes: the layers and blocks).
    KV_MISMATCH = "nixl.kv_verify.mismatch"


class Attr:
    """Span attribute keys (OTel semantic conventions where one exists)."""

    NOTIF_AGENTS_ONLY = "vllm.nixl.notif_agents_only"
    # Whether the side channel's exchange proved the deployment's secret both ways (only
    # with side_channel_secret_file; false: no secret configured).
    PEER_AUTHENTICATED = "vllm.nixl.peer_authenticated"
    DIRECTION = "vllm.nixl.handshake.direction"
    TRIGGER = "vllm.nixl.handshake.trigger"
    OUTCOME = "vllm.nixl.handshake.outcome"
    UPGRADE = "vllm.nixl.handshake.upgrade"
    ATTEMPT = "vllm.nixl.handshake.attempt"
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
    # Set when a notification-only handshake saved nothing, with the NoSaving reason.
    NOTHING_SAVED_BECAUSE = "vllm.nixl.descriptors_saved.none_because"
    REQUEST_ID = "gen_ai.request.id"
    REMOTE_REQUEST_ID = "vllm.nixl.remote_request_id"
    NUM_BLOCKS = "vllm.nixl.push.num_blocks"
    # Seconds the WRITE of a request waited for its P->D handshake (0: it was ready).
    HANDSHAKE_WAIT = "vllm.nixl.push.handshake_wait_s"
    # D's receive span: seconds from the request's arrival at D until its KV landed or the
    # receive ended (the figure nixl_push_kv_wait_seconds observed for it).
    KV_WAIT = "vllm.nixl.push.kv_wait_s"
    # P's write span: seconds from the prefill done until the WRITE was posted.
    WRITE_WAIT = "vllm.nixl.push.write_wait_s"
    # D's receive span: the KV check's verdict (KvVerifyOutcome), and why it was
    # skipped; on the mismatch event: the layers and the block range that differed.
    KV_VERIFY = "vllm.nixl.kv_verify"
    KV_VERIFY_SKIPPED = "vllm.nixl.kv_verify.skipped_because"
    KV_VERIFY_REASON = "vllm.nixl.kv_verify.reason"  # KvVerifyReason: why it was checked
    KV_VERIFY_LAYERS = "vllm.nixl.kv_verify.layers"
    KV_VERIFY_BLOCKS = "vllm.nixl.kv_verify.blocks"
    SERVER_ADDRESS = "server.address"
    SERVER_PORT = "server.port"
    ERROR_TYPE = "error.type"
    # On a span link: what the linked context is (LinkRole).
    LINK_ROLE = "vllm.nixl.link.role"
    # On lease events: seconds of lease left after a renewal; what P knew at expiry.
    LEASE_REMAINING = "vllm.nixl.kv_lease.remaining_s"
    LEASE_FATE = "vllm.nixl.kv_lease.fate"
    # On P's write span: heartbeats that renewed the request's lease.
    LEASE_RENEWALS = "vllm.nixl.kv_lease.renewals"
    # On a handshake made after the connection to its peer was dropped: why (PeerReset),
    # and whether the peer came back with a new NIXL agent (it restarted).
    AFTER_RESET = "vllm.nixl.handshake.after_reset"
    PEER_RESTARTED = "vllm.nixl.handshake.peer_restarted"


class LinkRole(_Vocab):
    # P's write span links to the trace context P's own request arrived with.
    PREFILL_REQUEST = "prefill_request"


# Extra key carried inside the PUSH_REG msgpack dict. A stock peer reads the dict
# with .get() and ignores it; a payload without it is handled like before.
PUSH_REG_TRACE_KEY = "otel_trace_context"

# Extra key in the PUSH_REG a fork decoder sends: what it understands beyond upstream.
# A fork prefill sends a PUSH_FAIL notification only to a decoder that lists it.
PUSH_REG_CAPS_KEY = "nixl_observed_caps"
CAP_PUSH_FAIL = "push_fail"
# NIXL notification P -> D: "the KV for your registered request will never come".
# Payload: msgpack {"request_id": D's request id, "reason": PushFailReason value}.
PUSH_FAIL_NOTIF_PREFIX = b"NIXL_OBSERVED_PUSH_FAIL:"
MAX_PUSH_FAIL_BYTES = 1024
# KV integrity: a fork decoder that sampled a request sets this PUSH_REG key (a stock
# prefill ignores it); a fork prefill then sends, before the request's WRITE to each
# decoder rank, a KV digest notification to that rank's agent (connector/integrity).
# Its value is the digest version the decoder speaks (an older fork sent `true`: version 1).
PUSH_REG_KV_DIGEST_KEY = "nixl_observed_kv_digest"
KV_DIGEST_NOTIF_PREFIX = b"NIXL_OBSERVED_KV_DIGEST:"
MAX_KV_DIGEST_BYTES = 64 * 1024  # 4,096 layers x (index, value): far past any model

# W3C trace-context headers vLLM keeps in `Request.trace_headers` (and we carry).
TRACE_HEADER_KEYS = ("traceparent", "tracestate")
# Extra key in the registration dict D's scheduler stages for its worker: the W3C
# context the request arrived with (the parent of `nixl.push.receive`). vLLM's own
# code reads the dict by named keys only; a stock P ignores it inside PUSH_REG.
REGISTRATION_TRACE_KEY = "otel_request_trace_context"
# Extra key in the same dict: when the request arrived at D (vLLM's `arrival_time`, wall
# clock), so the worker can observe the whole wait for KV. Never sent in a PUSH_REG.
REGISTRATION_ARRIVAL_KEY = "nixl_observed_arrival_time"
# Extra key in the same dict: D's scheduler's decision on checking the receive's KV (a
# KvVerifyReason value, or "" for not checked), so every rank of the decoder decides
# alike. Never sent in a PUSH_REG.
REGISTRATION_VERIFY_KEY = "nixl_observed_kv_verify"
# Extra attribute of the `NixlConnectorMetadata` P's scheduler builds each step:
# {P request id: W3C context} for the requests whose finished blocks it ships.
METADATA_TRACE_ATTR = "otel_request_trace_contexts"

# Exemplar label names (OpenMetrics; what Grafana's exemplar data links read).
EXEMPLAR_TRACE_ID = "trace_id"
EXEMPLAR_SPAN_ID = "span_id"


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
    REASON = "reason"
    FATE = "fate"
    STEP = "step"
    CHANNEL = "channel"


# Allowed values per label (the dashboards and the label-cardinality test use these).
LABEL_VALUES: dict[str, tuple[str, ...]] = {
    Label.DIRECTION: tuple(d.value for d in Direction),
    Label.TRIGGER: tuple(t.value for t in Trigger),
    Label.NOTIF_AGENTS_ONLY: BOOL_VALUES,
    Label.OUTCOME: tuple(dict.fromkeys(
        [o.value for o in Outcome] + [o.value for o in NotifOutcome] + [e.value for e in PushEvent]
        + [r.value for r in ReceiveOutcome] + [r.value for r in LeaseRenewal]
        + [o.value for o in PushFailOutcome] + [o.value for o in WriteAbort]
        + [o.value for o in KvVerifyOutcome])),
    Label.PHASE: tuple(p.value for p in Phase),
    Label.ERROR_TYPE: tuple(e.value for e in ErrorType),
    Label.LIST: tuple(x.value for x in DescriptorList),
    Label.REASON: tuple(dict.fromkeys(
        [t.value for t in TelemetryError] + [r.value for r in PushRegRejection]
        + [r.value for r in SideChannelRejection] + [r.value for r in ReceiveFailure]
        + [r.value for r in PeerReset] + [r.value for r in PushFailReason]
        + [r.value for r in ReceiveAbandon] + [r.value for r in KvVerifyReason]
        + [r.value for r in AuthRefusal])),
    Label.FATE: tuple(f.value for f in LeaseFate),
    Label.STEP: tuple(x.value for x in InternalStep),
    Label.CHANNEL: tuple(c.value for c in AuthChannel),
}


class MetricKind(_Vocab):
    COUNTER = "counter"
    HISTOGRAM = "histogram"
    GAUGE = "gauge"


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
        if self.kind is MetricKind.GAUGE:
            return (self.name,)
        return (self.name + "_bucket", self.name + "_sum", self.name + "_count")


# Handshakes span ~1 ms (in-process notif-only) to many seconds (timeouts, 1M descs).
HANDSHAKE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
                     30.0)
PHASE_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                 5.0, 10.0)

# A receive spans the PUSH_REG, P's prefill finishing (when D registers first), any
# handshakes and the WRITE: milliseconds to minutes (the registration timeout).
RECEIVE_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
                   120.0, 300.0, 600.0)

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

RECEIVE_DURATION = MetricSpec(
    "vllm:nixl_push_receive_duration_seconds",
    MetricKind.HISTOGRAM,
    (Label.OUTCOME,),
    "Wall time of a KV receive on a decode worker, from the registration handed to the "
    "worker until the KV landed, failed, or the registration timed out (expired).",
    unit="s",
    buckets=RECEIVE_BUCKETS,
)
# -- where a request's time goes: TTFT by stage (docs/telemetry.md "Where TTFT goes") ------
# D's wait for KV spans P's queue and prefill, the PUSH_REG, handshakes and the WRITE; P's
# stages a millisecond (a WRITE on one host) to minutes (a late PUSH_REG, lease-long waits).
STAGE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
                 30.0, 60.0, 120.0, 300.0, 600.0)
KV_WAIT = MetricSpec(
    "vllm:nixl_push_kv_wait_seconds",
    MetricKind.HISTOGRAM,
    (Label.OUTCOME,),
    "Time a request on a decode engine waited for its remote KV: from its arrival at the "
    "engine (vLLM's arrival_time, where vllm:time_to_first_token_seconds starts) until its KV "
    "landed, the receive failed, or the registration timed out (expired).",
    unit="s",
    buckets=STAGE_BUCKETS,
)
PUSH_WRITE_WAIT = MetricSpec(
    "vllm:nixl_push_write_wait_seconds",
    MetricKind.HISTOGRAM,
    (),
    "Time a finished prefill's KV waited on a prefill engine before its WRITE was posted: "
    "from its KV lease granted (prefill done) until the WRITE started (a PUSH_REG still to "
    "come, a handshake, the writer busy). Completed pushes only.",
    unit="s",
    buckets=STAGE_BUCKETS,
)
PUSH_WRITE_DURATION = MetricSpec(
    "vllm:nixl_push_write_duration_seconds",
    MetricKind.HISTOGRAM,
    (),
    "Time of a completed push on a prefill engine: from the PUSH_REG matched to the finished "
    "prefill until NIXL reported its WRITE done (includes the write wait when the PUSH_REG "
    "came first). Completed pushes only.",
    unit="s",
    buckets=STAGE_BUCKETS,
)
HANDSHAKE_RETRIES = MetricSpec(
    "vllm:nixl_handshake_retries",
    MetricKind.COUNTER,
    (Label.DIRECTION,),
    "Handshake attempts re-queued after a transient failure (side channel unreachable "
    "or silent), within the retry budget.",
)
HANDSHAKES_IN_FLIGHT = MetricSpec(
    "vllm:nixl_handshakes_in_flight",
    MetricKind.GAUGE,
    (Label.DIRECTION, Label.NOTIF_AGENTS_ONLY),
    "NIXL handshakes submitted and not yet finished (queued or running), summed over "
    "the engine's workers.",
)
HANDSHAKE_OLDEST_IN_FLIGHT = MetricSpec(
    "vllm:nixl_handshake_oldest_in_flight_seconds",
    MetricKind.GAUGE,
    (Label.DIRECTION,),
    "Age of the oldest unfinished NIXL handshake (0 when none): a hung handshake shows "
    "here long before it times out or is counted.",
    unit="s",
)
PUSH_REG_REJECTED = MetricSpec(
    "vllm:nixl_push_reg_rejected",
    MetricKind.COUNTER,
    (Label.REASON,),
    "PUSH_REG notifications a prefill worker dropped as malformed, oversized or failing; "
    "each is logged and costs no other request.",
)
SIDE_CHANNEL_REJECTED = MetricSpec(
    "vllm:nixl_side_channel_rejected",
    MetricKind.COUNTER,
    (Label.REASON,),
    "Requests to this engine's NIXL side channel dropped as malformed or for an unknown "
    "rank. vLLM's listener thread dies on such a request (no handshake is answered after "
    "it); ours logs it, counts it here and keeps serving.",
)
PEER_AUTH_REFUSALS = MetricSpec(
    "vllm:nixl_peer_auth_refusals",
    MetricKind.COUNTER,
    (Label.CHANNEL, Label.REASON),
    "Peers refused for want of the deployment's secret (side_channel_secret_file): a metadata "
    "request or notification without a valid proof, or a peer whose answer to ours had none. The "
    "first refusal per peer address is logged at WARNING.",
)
TELEMETRY_ERRORS = MetricSpec(
    "vllm:nixl_telemetry_errors",
    MetricKind.COUNTER,
    (Label.REASON,),
    "Telemetry lost to an internal error (never the push itself): the first of each "
    "reason is logged at WARNING.",
)

# -- KV leases (P holds a finished prefill's blocks for D until pushed or expired) --------
LEASE_AGE_BUCKETS = (0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0)
KV_LEASES_HELD = MetricSpec(
    "vllm:nixl_kv_leases_held",
    MetricKind.GAUGE,
    (),
    "KV leases this prefill engine holds now: finished prefills whose blocks wait for their "
    "decoder's push (the largest of the engine's workers, which all hold the same requests).",
)
KV_LEASE_OLDEST_AGE = MetricSpec(
    "vllm:nixl_kv_lease_oldest_age_seconds",
    MetricKind.GAUGE,
    (),
    "Age of the oldest KV lease held (0 when none): how long a finished prefill's blocks "
    "have waited for their decoder.",
    unit="s",
)
KV_LEASE_RENEWALS = MetricSpec(
    "vllm:nixl_kv_lease_renewals",
    MetricKind.COUNTER,
    (Label.OUTCOME,),
    "Request ids named in decoders' heartbeats, by what they matched on this prefill "
    "(renewed: a held lease was extended). One count per prefill worker.",
)
KV_LEASE_EXPIRIES = MetricSpec(
    "vllm:nixl_kv_lease_expiries",
    MetricKind.COUNTER,
    (Label.FATE,),
    "KV leases that expired before their push, by what the prefill knew of the request "
    "(waiting/registered: a decoder still wanted it). vLLM's vllm:nixl_num_kv_expired_reqs "
    "counts the same releases without the fate.",
)
KV_LEASES_REAPED_LATE = MetricSpec(
    "vllm:nixl_kv_leases_reaped_late",
    MetricKind.COUNTER,
    (),
    "Expired KV leases still held past one reaper pass after their expiry (their blocks "
    "were released later than due).",
)
HEARTBEATS = MetricSpec(
    "vllm:nixl_heartbeats",
    MetricKind.COUNTER,
    (Label.OUTCOME,),
    "Heartbeat notifications a decode worker sent to prefill agents (one per agent), "
    "renewing the leases of its requests that wait for a remote prefill.",
)
REMOTE_PREFILLS_WAITING = MetricSpec(
    "vllm:nixl_remote_prefills_waiting",
    MetricKind.GAUGE,
    (),
    "Requests on this decode engine waiting for KV from a prefill engine: queued or "
    "registered, from arrival until the KV landed or the receive failed.",
)
REMOTE_PREFILL_OLDEST_WAIT = MetricSpec(
    "vllm:nixl_remote_prefill_oldest_wait_seconds",
    MetricKind.GAUGE,
    (),
    "How long the oldest request waiting for a remote prefill has waited (0 when none).",
    unit="s",
)

# -- peers that stop working, and what a decoder does about its waiting requests ----------
PEER_RESETS = MetricSpec(
    "vllm:nixl_peer_resets",
    MetricKind.COUNTER,
    (Label.DIRECTION, Label.REASON),
    "NIXL connections to a remote engine this engine's workers dropped because they stopped "
    "working (a notification or a WRITE to its agent failed); the next request re-handshakes.",
)
PEER_RESTARTS = MetricSpec(
    "vllm:nixl_peer_restarts",
    MetricKind.COUNTER,
    (Label.DIRECTION,),
    "Re-handshakes that found a remote engine back under the same engine id with a new NIXL "
    "agent (it restarted): the requests it held are failed at once, not left waiting.",
)
RECEIVE_FAILURES = MetricSpec(
    "vllm:nixl_receive_failures",
    MetricKind.COUNTER,
    (Label.REASON,),
    "KV receives a decode worker failed, by why, instead of waiting for "
    "push_registration_timeout (vLLM then recomputes or fails the request).",
)

# -- the push state's owner (connector/state): what it refused, aborted or gave up -------
PUSH_FAIL_NOTIFS = MetricSpec(
    "vllm:nixl_push_fail_notifs",
    MetricKind.COUNTER,
    (Label.REASON, Label.OUTCOME),
    "PUSH_FAIL notifications a prefill worker owed a decoder (its request gets no KV from "
    "here), by why, and whether they were sent or undeliverable (decoder unreachable or "
    "forgotten, or a stock decoder that does not understand them).",
)
WRITE_ABORTS = MetricSpec(
    "vllm:nixl_push_write_aborts",
    MetricKind.COUNTER,
    (Label.OUTCOME,),
    "WRITEs that did not settle within push_write_timeout_s: aborted (NIXL released them; "
    "the lease is then released and the decoder told) or abort_failed (NIXL kept them: the "
    "blocks stay held, and the abort is tried again next step).",
)
RECEIVES_ABANDONED = MetricSpec(
    "vllm:nixl_receives_abandoned",
    MetricKind.COUNTER,
    (Label.REASON,),
    "Registered receives a decode worker gave up (client gone, registration timeout, prefill "
    "silent). Their blocks stay held until no WRITE into them can come, then the receive "
    "fails (receive_failures{reason=abandoned}) and vLLM frees or recomputes.",
)
INTERNAL_ERRORS = MetricSpec(
    "vllm:nixl_internal_errors",
    MetricKind.COUNTER,
    (Label.STEP,),
    "Steps of the push's data path that raised: a defect of the connector (never a peer's "
    "input). The request it concerned ended by the failure path (a push failed and its "
    "decoder told, a receive given up), never left waiting; the ERROR log line has the "
    "traceback.",
)
KV_DIGEST_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
                     0.25, 1.0)
KV_VERIFY = MetricSpec(
    "vllm:nixl_push_kv_verify",
    MetricKind.COUNTER,
    (Label.OUTCOME, Label.REASON),
    "KV receives a decode worker checked against the digest its prefill computed before "
    "the WRITE: match, mismatch (the KV is not what was sent: failed and recomputed, or only "
    "logged with kv_verify_action=observe), or skipped (no digest came: a stock or verify-off "
    "prefill, a layout not covered, another digest version); by reason: sampled "
    "(kv_verify_ratio), escalated (its prefill mismatched lately), new_peer (a new or "
    "restarted prefill), at_risk (its KV was held by heartbeats alone).",
)
KV_DIGEST_DURATION = MetricSpec(
    "vllm:nixl_push_kv_digest_seconds",
    MetricKind.HISTOGRAM,
    (),
    "Time one KV digest took on this engine's worker (a prefill: before each WRITE of a "
    "sampled request; a decode: after its KV landed, before its first decode step).",
    unit="s",
    buckets=KV_DIGEST_BUCKETS,
)
PEERS_FORGOTTEN = MetricSpec(
    "vllm:nixl_peers_forgotten",
    MetricKind.COUNTER,
    (Label.DIRECTION,),
    "Remote engines forgotten after being dropped and silent for peer_forget_after_s: "
    "everything kept for them is released.",
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
    RECEIVE_DURATION,
    KV_WAIT,
    PUSH_WRITE_WAIT,
    PUSH_WRITE_DURATION,
    HANDSHAKE_RETRIES,
    HANDSHAKES_IN_FLIGHT,
    HANDSHAKE_OLDEST_IN_FLIGHT,
    PUSH_REG_REJECTED,
    SIDE_CHANNEL_REJECTED,
    PEER_AUTH_REFUSALS,
    TELEMETRY_ERRORS,
    KV_LEASES_HELD,
    KV_LEASE_OLDEST_AGE,
    KV_LEASE_RENEWALS,
    KV_LEASE_EXPIRIES,
    KV_LEASES_REAPED_LATE,
    HEARTBEATS,
    REMOTE_PREFILLS_WAITING,
    REMOTE_PREFILL_OLDEST_WAIT,
    PEER_RESETS,
    PEER_RESTARTS,
    RECEIVE_FAILURES,
    PUSH_FAIL_NOTIFS,
    WRITE_ABORTS,
    RECEIVES_ABANDONED,
    PEERS_FORGOTTEN,
    INTERNAL_ERRORS,
    KV_VERIFY,
    KV_DIGEST_DURATION,
)

# ------------------------------------------------ start-up guard (connector/glue/guard.py)
# Not in ALL_METRICS: one gauge per engine, no labels beyond vLLM's model_name/engine.
OBSERVED_DEGRADED = MetricSpec(
    "vllm:nixl_observed_degraded",
    MetricKind.GAUGE,
    (),
    "1 when nixl-push-observed runs on a vLLM outside its tested range or missing a piece "
    "it relies on (started with NIXL_PUSH_OBSERVED_ALLOW_UNTESTED=1): its handshake "
    "telemetry may be incomplete or wrong. 0 otherwise.",
)

# ------------------------------------------------ NIXL's own exporter (the witness)
# Not in ALL_METRICS: `agent_name` is NIXL's name for a worker's agent (vLLM makes it a
# random UUID), an open value. One series per worker of the running engine (at most
# MAX_NIXL_AGENTS per API server), born with the engine and gone with it: an info
# metric (value 1) whose only job is the join `* on (agent_name) group_left (...)`.
class AgentLabel:
    AGENT_NAME = "agent_name"
    TP_RANK = "tp_rank"


NIXL_AGENT_INFO = MetricSpec(
    "vllm:nixl_push_agent_info",
    MetricKind.GAUGE,
    (AgentLabel.AGENT_NAME, AgentLabel.TP_RANK),
    "1 for each NIXL agent of this engine's workers: joins NIXL's own exporter (labelled by "
    "agent_name) to this engine's model_name, engine and TP rank.",
)
MAX_NIXL_AGENTS = 256  # workers of one API server's engines: past any real TP x PP x DP

# What NIXL's Prometheus exporter serves (ai-dynamo/nixl, src/plugins/telemetry/prometheus and
# prometheus_mp), as the dashboards and rules read it: scraped as a job of its own, one endpoint
# per engine. Its labels are NIXL's, not ours: agent_name, hostname (and with prometheus_mp pid,
# agent_instance, optional local_rank); `status` on errors is NIXL's closed set of error kinds.
NIXL_JOB = "nixl"


class NixlLabel:
    AGENT_NAME = AgentLabel.AGENT_NAME
    HOSTNAME = "hostname"
    STATUS = "status"


_NIXL_LABELS = (NixlLabel.AGENT_NAME, NixlLabel.HOSTNAME)
NIXL_TX_BYTES = MetricSpec("agent_tx_bytes", MetricKind.COUNTER, _NIXL_LABELS,
                           "NIXL: bytes this agent's transfers sent (a WRITE's bytes).", "bytes")
NIXL_TX_REQUESTS = MetricSpec("agent_tx_requests_num", MetricKind.COUNTER, _NIXL_LABELS,
                              "NIXL: transfer requests this agent posted.")
NIXL_XFER_TIME = MetricSpec("agent_xfer_time_us", MetricKind.HISTOGRAM, _NIXL_LABELS,
                            "NIXL: transfer time, post to completion (microseconds).", "us")
NIXL_POST_TIME = MetricSpec("agent_xfer_post_time_us", MetricKind.HISTOGRAM, _NIXL_LABELS,
                            "NIXL: time to post a transfer (microseconds).", "us")
NIXL_MEMORY_REGISTERED = MetricSpec("agent_memory_registered", MetricKind.COUNTER, _NIXL_LABELS,
                                    "NIXL: bytes of memory this agent registered.", "bytes")
NIXL_ERRORS = MetricSpec("agent_errors", MetricKind.COUNTER, (*_NIXL_LABELS, NixlLabel.STATUS),
                         "NIXL: errors by status.")
NIXL_EVENTS_DROPPED = MetricSpec("agent_telemetry_events_dropped", MetricKind.COUNTER, _NIXL_LABELS,
                                 "NIXL: telemetry events its exporter dropped (its counts undercount).")
NIXL_TX_LAST_BYTES = "agent_tx_last_bytes"  # (a gauge: the latest transfer's bytes; the demo and tests)
NIXL_EXPORTER_METRICS: tuple[MetricSpec, ...] = (
    NIXL_TX_BYTES, NIXL_TX_REQUESTS, NIXL_XFER_TIME, NIXL_POST_TIME, NIXL_MEMORY_REGISTERED,
    NIXL_ERRORS, NIXL_EVENTS_DROPPED)
VLLM_BYTES_TRANSFERRED_SUM = "vllm:nixl_bytes_transferred_sum"
VLLM_TRANSFERS_COUNT = "vllm:nixl_bytes_transferred_count"

# Histograms whose observations carry a trace-id exemplar when tracing is on.
EXEMPLAR_METRICS: tuple[MetricSpec, ...] = (HANDSHAKE_DURATION, HANDSHAKE_PHASE_DURATION,
                                            RECEIVE_DURATION, KV_WAIT, PUSH_WRITE_WAIT,
                                            PUSH_WRITE_DURATION)

# `outcome` is a different closed set per metric; LABEL_VALUES holds the union.
METRIC_LABEL_VALUES: dict[tuple[str, str], tuple[str, ...]] = {
    (HANDSHAKES.name, Label.OUTCOME): tuple(o.value for o in Outcome),
    (HANDSHAKE_DURATION.name, Label.OUTCOME): tuple(o.value for o in Outcome),
    (PUSH_REG_NOTIFS.name, Label.OUTCOME): tuple(o.value for o in NotifOutcome),
    (PUSHES.name, Label.OUTCOME): tuple(e.value for e in PushEvent),
    (RECEIVE_DURATION.name, Label.OUTCOME): tuple(r.value for r in ReceiveOutcome),
    (KV_WAIT.name, Label.OUTCOME): tuple(r.value for r in ReceiveOutcome),
    (PUSH_REG_REJECTED.name, Label.REASON): tuple(r.value for r in PushRegRejection),
    (SIDE_CHANNEL_REJECTED.name, Label.REASON): tuple(r.value for r in SideChannelRejection),
    (TELEMETRY_ERRORS.name, Label.REASON): tuple(t.value for t in TelemetryError),
    (KV_LEASE_RENEWALS.name, Label.OUTCOME): tuple(r.value for r in LeaseRenewal),
    (HEARTBEATS.name, Label.OUTCOME): tuple(o.value for o in NotifOutcome),
    (PEER_RESETS.name, Label.REASON): tuple(r.value for r in PeerReset),
    (RECEIVE_FAILURES.name, Label.REASON): tuple(r.value for r in ReceiveFailure),
    (PUSH_FAIL_NOTIFS.name, Label.REASON): tuple(r.value for r in PushFailReason),
    (PUSH_FAIL_NOTIFS.name, Label.OUTCOME): tuple(o.value for o in PushFailOutcome),
    (WRITE_ABORTS.name, Label.OUTCOME): tuple(o.value for o in WriteAbort),
    (RECEIVES_ABANDONED.name, Label.REASON): tuple(r.value for r in ReceiveAbandon),
    (PEER_AUTH_REFUSALS.name, Label.REASON): tuple(r.value for r in AuthRefusal),
}


def allowed_values(metric: str, label: str) -> tuple[str, ...]:
    """The closed set of values `label` may take on `metric`."""
    return METRIC_LABEL_VALUES.get((metric, label), LABEL_VALUES.get(label, ()))


def series_bound(metrics: tuple[MetricSpec, ...] = ALL_METRICS) -> int:
    """Most samples `metrics` can expose per engine in the Prometheus text format:
    every closed label combination, times the samples of one series (a gauge: 1; a
    counter: `_total` and `_created`; a histogram: its buckets, `+Inf`, `_sum`,
    `_count` and `_created`). No label takes a peer- or request-derived value, so
    this bound holds whatever the traffic (the load test checks it)."""
    per_kind = {MetricKind.GAUGE: 1, MetricKind.COUNTER: 2}
    total = 0
    for metric in metrics:
        combos = 1
        for label in metric.labels:
            combos *= len(allowed_values(metric.name, label))
        total += combos * per_kind.get(metric.kind, len(metric.buckets) + 4)
    return total


# vLLM's count of the leases it released (its reaper; the fork's by fate is KV_LEASE_EXPIRIES).
VLLM_KV_EXPIRED = MetricSpec("vllm:nixl_num_kv_expired_reqs", MetricKind.COUNTER, (),
                             "Requests whose KV lease expired.")
# vLLM's per-transfer telemetry of each WRITE, counted when vLLM sees the transfer done: what
# the witness compares with NIXL's own agent counters (NIXL_TX_BYTES, NIXL_TX_REQUESTS).
VLLM_BYTES_TRANSFERRED = MetricSpec("vllm:nixl_bytes_transferred", MetricKind.HISTOGRAM, (),
                                    "Bytes per NIXL transfer.", "bytes")
# Stock vLLM NIXL metrics we keep emitting unchanged (dashboards may query them).
STOCK_METRICS: tuple[MetricSpec, ...] = (
    MetricSpec("vllm:nixl_xfer_time_seconds", MetricKind.HISTOGRAM, (), "NIXL transfer duration.", "s"),
    MetricSpec("vllm:nixl_post_time_seconds", MetricKind.HISTOGRAM, (), "NIXL transfer post time.", "s"),
    VLLM_BYTES_TRANSFERRED,
    MetricSpec("vllm:nixl_num_descriptors", MetricKind.HISTOGRAM, (), "Descriptors per NIXL transfer."),
    MetricSpec("vllm:nixl_num_failed_transfers", MetricKind.COUNTER, (), "Failed NIXL transfers."),
    MetricSpec("vllm:nixl_num_failed_notifications", MetricKind.COUNTER, (), "Failed NIXL notifications."),
    VLLM_KV_EXPIRED,
    MetricSpec(
        "vllm:nixl_num_notifications_after_expiry",
        MetricKind.COUNTER,
        (),
        "Completion notifications after a lease expired.",
    ),
)

# vLLM's own request metrics that the "Where TTFT goes" row reads beside ours: on a decode
# engine, vLLM's TTFT starts at the same arrival as nixl_push_kv_wait_seconds.
VLLM_TTFT = MetricSpec(
    "vllm:time_to_first_token_seconds",
    MetricKind.HISTOGRAM,
    (),
    "vLLM's time to first token: from the request's arrival at the engine until its first "
    "token (a decode engine's includes the wait for remote KV).",
    "s",
)
VLLM_REQUEST_METRICS: tuple[MetricSpec, ...] = (VLLM_TTFT,)
# Samples of vLLM's own that tests, benchmarks and the demo read off /metrics, as scraped:
# the leases vLLM released, and the prompt tokens whose KV came through the connector
# (vLLM's prompt-token counter by source; the proof that KV went over NIXL).
VLLM_KV_EXPIRED_TOTAL = VLLM_KV_EXPIRED.name + "_total"
VLLM_EXTERNAL_PROMPT_TOKENS: tuple[str, dict[str, str]] = (
    "vllm:prompt_tokens_by_source_total", {"source": "external_kv_transfer"})


# ------------------------------------------------------- worker -> frontend stats
class StatKey:
    """Keys this fork adds to vLLM's serializable NIXL stats dict."""

    HANDSHAKES = "handshakes"
    PUSH_REG_SENT = "push_reg_notifs_sent"
    PUSH_REG_FAILED = "push_reg_notifs_failed"
    PUSHES_STARTED = "pushes_started"
    PUSHES_COMPLETED = "pushes_completed"
    PUSHES_FAILED = "pushes_failed"
    RECEIVES = "receives"  # {"outcome", "duration", "kv_wait"?, "trace_id"?, "span_id"?}
    # P: one per completed push: {"wait": s, "write": s, "trace_id"?, "span_id"?}
    PUSH_STAGES = "push_stages"
    HANDSHAKE_RETRIES = "handshake_retries"  # list of direction values
    PUSH_REG_REJECTED = "push_reg_rejected"  # list of PushRegRejection values
    TELEMETRY_ERRORS = "telemetry_errors"  # list of TelemetryError values
    SIDE_CHANNEL_REJECTED = "side_channel_rejected"  # list of SideChannelRejection values (scheduler)
    # One snapshot per worker and stats interval: {"d_to_p|true": [count, oldest_s], ...}
    IN_FLIGHT = "handshakes_in_flight"
    LEASE_RENEWALS = "lease_renewals"  # list of LeaseRenewal values
    LEASE_EXPIRIES = "lease_expiries"  # list of LeaseFate values
    LEASES_REAPED_LATE = "leases_reaped_late"  # list of 1s
    # P worker snapshot when its leases changed: [[held, oldest_age_s]]
    LEASES = "kv_leases"
    HEARTBEATS_SENT = "heartbeats_sent"  # list of counts
    HEARTBEATS_FAILED = "heartbeats_failed"  # list of counts
    # D scheduler snapshot when its waiting requests changed: [[waiting, oldest_wait_s]]
    REMOTE_PREFILLS = "remote_prefills_waiting"
    PEER_RESETS = "peer_resets"  # list of "direction|reason"
    PEER_RESTARTS = "peer_restarts"  # list of direction values
    RECEIVE_FAILURES = "receive_failures"  # list of ReceiveFailure values
    PUSH_FAILS = "push_fail_notifs"  # list of "reason|outcome"
    WRITE_ABORTS = "write_aborts"  # list of WriteAbort values
    RECEIVES_ABANDONED = "receives_abandoned"  # list of ReceiveAbandon values
    PEERS_FORGOTTEN = "peers_forgotten"  # list of direction values
    INTERNAL_ERRORS = "internal_errors"  # list of InternalStep values
    KV_VERIFY = "kv_verify"  # list of "KvVerifyOutcome|KvVerifyReason"
    # D worker -> its scheduler (not exported): prefill engine ids whose KV mismatched,
    # and prefill engines that restarted (the escalation rules; engine ids are no label).
    KV_MISMATCH_FROM = "kv_mismatch_from"
    PREFILL_RESTARTED = "prefill_restarted"
    KV_DIGEST_SECONDS = "kv_digest_seconds"  # list of seconds
    AUTH_REFUSALS = "peer_auth_refusals"  # list of "AuthChannel|AuthRefusal"
    # A worker's NIXL agent, on its first interval and then once a minute: [[tp_rank, agent_name]]
    NIXL_AGENTS = "nixl_agents"


OUR_STAT_KEYS = (
    StatKey.HANDSHAKES,
    StatKey.PUSH_REG_SENT,
    StatKey.PUSH_REG_FAILED,
    StatKey.PUSHES_STARTED,
    StatKey.PUSHES_COMPLETED,
    StatKey.PUSHES_FAILED,
    StatKey.RECEIVES,
    StatKey.PUSH_STAGES,
    StatKey.HANDSHAKE_RETRIES,
    StatKey.PUSH_REG_REJECTED,
    StatKey.TELEMETRY_ERRORS,
    StatKey.SIDE_CHANNEL_REJECTED,
    StatKey.IN_FLIGHT,
    StatKey.LEASE_RENEWALS,
    StatKey.LEASE_EXPIRIES,
    StatKey.LEASES_REAPED_LATE,
    StatKey.LEASES,
    StatKey.HEARTBEATS_SENT,
    StatKey.HEARTBEATS_FAILED,
    StatKey.REMOTE_PREFILLS,
    StatKey.PEER_RESETS,
    StatKey.PEER_RESTARTS,
    StatKey.RECEIVE_FAILURES,
    StatKey.PUSH_FAILS,
    StatKey.WRITE_ABORTS,
    StatKey.RECEIVES_ABANDONED,
    StatKey.PEERS_FORGOTTEN,
    StatKey.INTERNAL_ERRORS,
    StatKey.KV_VERIFY,
    StatKey.KV_DIGEST_SECONDS,
    StatKey.KV_MISMATCH_FROM,
    StatKey.PREFILL_RESTARTED,
    StatKey.NIXL_AGENTS,
    StatKey.AUTH_REFUSALS,
)

# What a fork decoder adds to its PUSH_REG and heartbeats (a stock prefill ignores it):
# a digest of the request's prompt (P refuses a match whose prompt differs: request ids
# can be reused), and when it last asked for the KV, in its own perf_counter clock (P
# posts no WRITE more than a lease after that: see connector/state/receives.py).
PUSH_REG_DIGEST_KEY = "nixl_observed_prompt"
PUSH_REG_SENT_AT_KEY = "nixl_observed_sent_at"
HEARTBEAT_SENT_AT_PREFIX = "@"  # an extra heartbeat "id": "@<perf_counter>"
# Step metadata attributes our scheduler adds (a stock worker never reads them): P's
# prompt digests of the finished requests, D's receives given up (client gone).
METADATA_DIGEST_ATTR = "nixl_observed_prompt_digests"
METADATA_GIVEN_UP_ATTR = "nixl_observed_given_up"

# PUSH_REG fields P acts on, with the types it needs (validated before use).
PUSH_REG_FIELDS: dict[str, tuple[type, ...]] = {
    "request_id": (str,),
    "decode_engine_id": (str,),
    "decode_host": (str,),
    "decode_port": (int,),
    "decode_tp_size": (int,),
    "local_block_ids": (list, tuple),
}
# Bounds on what a peer controls (the side channel and PUSH_REG are unauthenticated).
MAX_PUSH_REG_BYTES = 1 << 20  # a PUSH_REG with 1M block ids is far past any real request
MAX_PEER_STRING = 256  # engine ids, hosts, request ids kept on spans or in logs

# -- trust boundary: error text that can quote what a peer sent -----------
MAX_ERROR_MESSAGE = 1024  # a handshake error's message (logs, span events)

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
    # On router.request: the client's time to first token, as nixl_router_time_to_first_token_seconds
    # observed it (so one request's trace carries the figure its stages add up to).
    TTFT = "vllm.router.time_to_first_token_s"


# ======================================================== router metrics (connector.router)
# The router's own Prometheus metrics, served by the router itself (GET ROUTER_METRICS_PATH on
# its HTTP port), not by vLLM. Kept out of ALL_METRICS: they carry neither `model_name` nor
# `engine` (the router serves every model behind it and a label naming an engine would be
# unbounded); Prometheus adds `job` and `instance`. Names and meaning follow the Gateway API
# Inference Extension's endpoint picker (inference_objective_request_total,
# inference_objective_running_requests, inference_objective_request_ttft_seconds), llm-d's
# pd-proxy (its `true_ttft_ms` span attribute; ours is a histogram, up to the first token the
# client receives) and OpenTelemetry's HTTP metrics (http.server.active_requests,
# http.client.request.duration; `route` is http.route) where they fit.
ROUTER_METRICS_PATH = "/metrics"
ROUTE_COMPLETIONS = "/v1/completions"
ROUTE_CHAT = "/v1/chat/completions"
ROUTER_ROUTES = (ROUTE_COMPLETIONS, ROUTE_CHAT)


class RouterLabel:
    ROUTE = "route"  # the OpenAI route the client called (OTel http.route)
    LEG = "leg"  # RouterLeg
    STREAM = "stream"  # the client asked `stream: true`


class RouterOutcome(_Vocab):
    """How one client request through the router ended."""

    OK = "ok"  # D's answer reached the client
    PREFILL_FAILED = "prefill_failed"  # P answered an error or could not be reached
    DECODE_FAILED = "decode_failed"  # D answered an error, could not be reached, or its stream broke
    CLIENT_DISCONNECTED = "client_disconnected"  # the client went away first: both legs stopped
    BAD_REQUEST = "bad_request"  # the router refused the body (400); no leg was sent


class LegOutcome(_Vocab):
    OK = "ok"  # a 2xx answer, read to its end
    FAILED = "failed"  # an error status, no answer (unreachable, timeout), or a broken stream
    CANCELLED = "cancelled"  # the router stopped it (see LegCancel)


class LegCancel(_Vocab):
    """Why the router stopped a leg still in flight (its connection closed, so vLLM aborts it)."""

    OTHER_LEG_FAILED = "other_leg_failed"  # D must not wait for KV that never comes, nor P push to nobody
    CLIENT_DISCONNECTED = "client_disconnected"
    REQUEST_SERVED = "request_served"  # D's stream ended before P's answer came: nothing waits for it


# Client TTFT spans a cache hit on a warm pair (milliseconds) to a long queue or prompt (minutes).
# Finer where a healthy pair answers (0.1 s to 1 s), so p50 and p95 there are not one bucket.
ROUTER_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 1.5,
                       2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
ROUTER_LEG_BUCKETS = ROUTER_TTFT_BUCKETS

ROUTER_REQUESTS = MetricSpec(
    "nixl_router_requests",
    MetricKind.COUNTER,
    (RouterLabel.ROUTE, Label.OUTCOME),
    "Client requests the router finished, by route and outcome (ok, prefill_failed, "
    "decode_failed, client_disconnected, bad_request).",
)
ROUTER_REQUESTS_IN_FLIGHT = MetricSpec(
    "nixl_router_requests_in_flight",
    MetricKind.GAUGE,
    (RouterLabel.ROUTE,),
    "Client requests the router is handling now: received, answer not yet delivered.",
)
ROUTER_TTFT = MetricSpec(
    "nixl_router_time_to_first_token_seconds",
    MetricKind.HISTOGRAM,
    (RouterLabel.ROUTE, RouterLabel.STREAM),
    "Time to first token as the client sees it: from the request's arrival at the router until "
    "its first token was sent to the client (streamed: D's first event; not streamed: the whole "
    "answer). Successful requests only.",
    unit="s",
    buckets=ROUTER_TTFT_BUCKETS,
)
ROUTER_LEG_DURATION = MetricSpec(
    "nixl_router_leg_duration_seconds",
    MetricKind.HISTOGRAM,
    (RouterLabel.LEG, Label.OUTCOME),
    "Wall time of one leg, from the router sending it until its answer was read to the end "
    "(D streamed: the last event), it failed, or the router cancelled it.",
    unit="s",
    buckets=ROUTER_LEG_BUCKETS,
)
ROUTER_LEGS_CANCELLED = MetricSpec(
    "nixl_router_legs_cancelled",
    MetricKind.COUNTER,
    (RouterLabel.LEG, Label.REASON),
    "Legs the router stopped while in flight, by leg and why (other_leg_failed, "
    "client_disconnected, request_served).",
)
ROUTER_METRICS: tuple[MetricSpec, ...] = (ROUTER_REQUESTS, ROUTER_REQUESTS_IN_FLIGHT, ROUTER_TTFT,
                                          ROUTER_LEG_DURATION, ROUTER_LEGS_CANCELLED)
# With tracing on, TTFT carries the router.request span's exemplar, a leg its router.leg.* span's.
ROUTER_EXEMPLAR_METRICS: tuple[MetricSpec, ...] = (ROUTER_TTFT, ROUTER_LEG_DURATION)

# The router's label values join the closed sets above (one vocabulary, one lookup).
LABEL_VALUES.update({
    RouterLabel.ROUTE: ROUTER_ROUTES,
    RouterLabel.LEG: tuple(leg.value for leg in RouterLeg),
    RouterLabel.STREAM: BOOL_VALUES,
})
METRIC_LABEL_VALUES.update({
    (ROUTER_REQUESTS.name, Label.OUTCOME): tuple(o.value for o in RouterOutcome),
    (ROUTER_LEG_DURATION.name, Label.OUTCOME): tuple(o.value for o in LegOutcome),
    (ROUTER_LEGS_CANCELLED.name, Label.REASON): tuple(r.value for r in LegCancel),
})

# ============================================= vLLM's request span and the TTFT split's tolerances
# Not ours: vLLM's own request span (one per engine and request, `OutputProcessor.do_tracing`)
# and the attributes the TTFT split reads from it. Named here, beside our spans, so the demo's
# report, the tests and the generated docs/telemetry.md spell them once (not a `SPAN_` name:
# docs/telemetry.md lists those as the connector's spans).
VLLM_REQUEST_SPAN = "llm_request"
VLLM_TTFT_ATTR = "gen_ai.latency.time_to_first_token"
VLLM_E2E_ATTR = "gen_ai.latency.e2e"
# How closely a request's TTFT stages must add up (seconds, plus a share of the figure compared):
# P's two stages make D's wait for KV within JOIN (the legs reach P and D a few ms apart, and
# each engine sees a boundary at its own step); the router's own share of the client's TTFT
# (its hops, JSON, and D's answer back) lies within ROUTER_SHARE. The demo's report and
# tests/test_e2e_serve.py hold each request to them; docs/telemetry.md states them.
TTFT_JOIN_TOLERANCE_S, TTFT_JOIN_TOLERANCE_SHARE = 0.1, 0.1
TTFT_ROUTER_SHARE_MIN_S, TTFT_ROUTER_SHARE_MAX_S, TTFT_ROUTER_SHARE_SHARE = -0.05, 0.25, 0.1

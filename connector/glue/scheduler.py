"""`ObservedPushScheduler`: vLLM's push scheduler, handing request trace context to workers.

vLLM keeps the W3C headers a request arrived with (`Request.trace_headers`, set
only when tracing is on) in the scheduler process; our request spans live in the
workers. This subclass passes the context along the two paths vLLM already has:
- D: the registration dict staged in `update_state_after_alloc` gets one extra key
  (`REGISTRATION_TRACE_KEY`), so the worker's `nixl.push.receive` joins the request's
  trace. vLLM reads that dict by named keys only (and a stock P ignores extra keys
  inside PUSH_REG), so the key changes nothing else.
- P: the step metadata gets one extra attribute (`METADATA_TRACE_ATTR`,
  {request id: context}) next to the finished blocks it ships, so the worker's
  `nixl.push.write` can link to P's own request. A stock worker never looks at it.
Nothing here raises into vLLM's scheduling: a telemetry fault is logged and dropped.

Two more facts travel the same way, so that P never hands a request another's KV
and D never frees blocks a WRITE can still reach:
- a digest of each request's prompt: D's goes into its registration (and so the
  PUSH_REG), P's into the step metadata with the finished blocks; P refuses a match
  whose digests differ (request ids can be reused by routers and clients);
- D: the requests aborted while they waited for their KV (the client went away),
  in the step metadata, so the worker gives up their receives (vLLM holds their blocks
  until the worker reports them; upstream that never happens when no KV comes).

D's registration also carries when the request arrived (vLLM's `arrival_time`), so the
worker observes the request's whole wait for KV, a stage of its TTFT, and whether the
worker checks the request's KV, and why (connector/integrity/escalation.py): decided
here, once, so every rank of the decoder checks the same receives. The workers tell it
which prefills sent KV that mismatched or restarted through their stats
(`update_connector_output`).

It also runs vLLM's side-channel listener under `listener.supervise` (see there): a
bad request no longer ends the listener, and a port that cannot be bound is an error
at start-up instead of a scheduler waiting forever; and on D it keeps how long each
request has waited for its remote prefill (vLLM's heartbeat tracking knows which do).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.nixl.push_scheduler import (
    NixlPushConnectorScheduler,
)

from connector import settings
from connector.glue import listener
from connector.glue.auth_listener import authenticated_listener
from connector.glue.wire import prompt_digest
from connector.integrity.escalation import Escalation
from connector.integrity.policy import VerifyPolicy
from connector.telemetry.tracing import trace_carrier
from connector.trust.secret import load_secret
from connector.vocabulary import (
    METADATA_DIGEST_ATTR,
    METADATA_GIVEN_UP_ATTR,
    METADATA_TRACE_ATTR,
    PUSH_REG_DIGEST_KEY,
    REGISTRATION_ARRIVAL_KEY,
    REGISTRATION_TRACE_KEY,
    REGISTRATION_VERIFY_KEY,
    StatKey,
)

if TYPE_CHECKING:
    from vllm.distributed.kv_transfer.kv_connector.utils import BlockIds
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)


def stage_trace_context(registration: dict[str, Any], trace_headers: Any) -> None:
    """Put the request's W3C context into a D registration dict (in place)."""
    if REGISTRATION_TRACE_KEY in registration:
        return
    carrier = trace_carrier(trace_headers)
    if carrier:
        registration[REGISTRATION_TRACE_KEY] = carrier


def attach_request_contexts(metadata: Any, contexts: dict[str, dict[str, str]]) -> None:
    """Add {P request id: W3C context} to a step's connector metadata."""
    if contexts:
        setattr(metadata, METADATA_TRACE_ATTR, dict(contexts))


def request_digest(request: Request) -> str | None:
    """The prompt digest of a vLLM request (token ids and multimodal identifiers)."""
    features = getattr(request, "mm_features", None) or ()
    return prompt_digest(request.prompt_token_ids,
                         [getattr(f, "identifier", "") for f in features])


class ObservedPushScheduler(NixlPushConnectorScheduler):
    """See module docstring."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        # P: contexts and prompt digests of requests whose finished blocks ship with the
        # next metadata; D: requests aborted while they waited for their KV.
        self._finished_trace_contexts: dict[str, dict[str, str]] = {}
        self._finished_digests: dict[str, str] = {}
        self._given_up: list[str] = []
        # D: requests given up whose receive the worker has not reported yet: the engine
        # keeps stepping for them (an idle engine would never free their blocks).
        self._given_up_open: set[str] = set()
        # D: request id -> when it arrived, while vLLM heartbeats P for it (arrival order).
        self._waiting_since: dict[str, float] = {}
        self._waiting_reported_at = 0.0
        self._waiting_report_owed = False
        # D: which receives the workers check (a bad setting stops the engine here too).
        kv = self.vllm_config.kv_transfer_config
        extra = kv.get_from_extra_config
        policy = VerifyPolicy.from_config(extra)
        forget_s = float(settings.read(extra, settings.PEER_FORGET_AFTER_S))
        self._escalation = (None if kv.kv_role == "kv_producer" else
                            Escalation(policy, lease_s=settings.lease_s(extra), forget_after_s=forget_s))
        # The deployment's secret: with it, the side channel answers only peers that prove it.
        self._peer_secret = load_secret(extra)

    def on_new_request(self, request: Request) -> None:
        super().on_new_request(request)
        tracked = self._heartbeat_req_engine.get(request.request_id)
        if tracked is None:
            return
        # D: the request waits for a remote prefill. Its heartbeats name it by this
        # engine's own request id, which P matches by base id as it matches PUSH_REGs
        # (vLLM names it by the router's id, which P never holds). A stock P matches
        # neither: its leases are not renewed either way.
        engine_id, router_id = tracked
        info = self._heartbeat_by_engine.get(engine_id)
        if info is not None and router_id != request.request_id:
            info.req_ids.discard(router_id)
            info.req_ids.add(request.request_id)
            self._heartbeat_req_engine[request.request_id] = (engine_id, request.request_id)
        self._waiting_since[request.request_id] = time.monotonic()
        self._waiting_report_owed = True

    def remote_prefills_waiting(self, interval_s: float = 1.0) -> tuple[int, float] | None:
        """(requests waiting for a remote prefill, oldest wait in s) at most once per
        `interval_s` while any wait, and once more when the last is done; else None."""
        if not self._waiting_since and not self._waiting_report_owed:
            return None
        now = time.monotonic()
        if now - self._waiting_reported_at < interval_s:
            return None
        tracked = self._heartbeat_req_engine
        for req_id in [r for r in self._waiting_since if r not in tracked]:
            del self._waiting_since[req_id]
        oldest = now - next(iter(self._waiting_since.values())) if self._waiting_since else 0.0
        self._waiting_reported_at = now
        self._waiting_report_owed = bool(self._waiting_since)
        return len(self._waiting_since), oldest

    def _nixl_handshake_listener(self, encoded_data: Any, ready_event: Any, stop_event: Any,
                                 host: str, port: int) -> None:
        """vLLM's listener (thread target), supervised; with the secret, ours
        (connector/glue/auth_listener.py: vLLM's has no seam for a check)."""
        serve = (NixlPushConnectorScheduler._nixl_handshake_listener if self._peer_secret is None
                 else authenticated_listener(self._peer_secret))
        listener.supervise(serve, encoded_data, ready_event, stop_event, host, port)

    def set_xfer_handshake_metadata(self, metadata: dict[tuple[int, int], Any]) -> None:
        super().set_xfer_handshake_metadata(metadata)
        exc = listener.take_bind_error(self.side_channel_port)
        if exc is not None:
            self._nixl_handshake_listener_t = None
            raise listener.SideChannelBindError(
                f"cannot listen for NIXL handshakes on {self.side_channel_host}:"
                f"{self.side_channel_port} ({type(exc).__name__}: {exc}); another process holds "
                "the port. Set VLLM_NIXL_SIDE_CHANNEL_PORT to a free port (with data parallel, "
                "each rank listens on that port plus its rank).") from exc

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        super().update_state_after_alloc(request, blocks, num_external_tokens)
        registration = self._push_pending_registrations.get(request.request_id)
        if registration is None:
            return
        digest = request_digest(request)
        if digest is not None:
            registration[PUSH_REG_DIGEST_KEY] = digest
        arrival = getattr(request, "arrival_time", None)
        if type(arrival) is float:  # the start of its wait for KV (nixl_push_kv_wait_seconds)
            registration[REGISTRATION_ARRIVAL_KEY] = arrival
        if self._escalation is not None:
            waited = time.time() - arrival if type(arrival) is float else 0.0
            reason = self._escalation.decide(request.request_id,
                                             str(registration.get("remote_engine_id", "")), waited)
            registration[REGISTRATION_VERIFY_KEY] = reason.value if reason is not None else ""
        if not request.trace_headers:  # tracing off, or no context sent: no work
            return
        try:
            stage_trace_context(registration, request.trace_headers)
        except Exception:
            logger.debug("registration trace context dropped", exc_info=True)

    def request_finished(self, request: Request,
                         block_ids: BlockIds) -> tuple[bool, dict[str, Any] | None]:
        # D: still waiting for its KV (vLLM heartbeats it until the KV lands).
        waiting = request.request_id in self._heartbeat_req_engine
        result = super().request_finished(request, block_ids)
        if waiting:
            self._given_up.append(request.request_id)
            self._given_up_open.add(request.request_id)
        if request.request_id in self._newly_finished_push_blocks:
            digest = request_digest(request)
            if digest is not None:
                self._finished_digests[request.request_id] = digest
            if request.trace_headers:
                try:
                    carrier = trace_carrier(request.trace_headers)
                    if carrier:
                        self._finished_trace_contexts[request.request_id] = carrier
                except Exception:
                    logger.debug("request trace context dropped", exc_info=True)
        return result

    def has_pending_push_work(self) -> bool:
        return super().has_pending_push_work() or bool(self._given_up_open)

    def update_connector_output(self, connector_output: Any) -> None:
        super().update_connector_output(connector_output)
        if self._given_up_open:
            self._given_up_open.difference_update(connector_output.finished_recving or ())
        stats = getattr(connector_output, "kv_connector_stats", None)
        data = getattr(stats, "data", None)
        if self._escalation is not None and isinstance(data, dict):
            mismatched = data.get(StatKey.KV_MISMATCH_FROM)
            if mismatched:
                self._escalation.mismatched(str(e) for e in mismatched)
            restarted = data.get(StatKey.PREFILL_RESTARTED)
            if restarted:
                self._escalation.restarted(str(e) for e in restarted)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = super().build_connector_meta(scheduler_output)
        if self._finished_digests:
            setattr(meta, METADATA_DIGEST_ATTR, self._finished_digests)
            self._finished_digests = {}
        if self._given_up:
            setattr(meta, METADATA_GIVEN_UP_ATTR, self._given_up)
            self._given_up = []
        if self._finished_trace_contexts:
            try:
                attach_request_contexts(meta, self._finished_trace_contexts)
            except Exception:
                logger.debug("request trace contexts dropped", exc_info=True)
            self._finished_trace_contexts.clear()
        return meta

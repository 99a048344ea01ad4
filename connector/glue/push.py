"""P-side flow: a matched PUSH_REG until the WRITE completed, observed.

Wrappers at the boundary of vLLM's push worker: they open the request's write span
under the trace context the PUSH_REG carried, tag the P->D handshake a WRITE starts,
and count pushes started and failed.
"""

from __future__ import annotations

import logging
from typing import Any

from opentelemetry.trace import SpanKind
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import ReqMeta

from connector.glue.receive import count_blocks
from connector.telemetry.span_table import MAX_TRACKED_REQUESTS
from connector.telemetry.tracing import SpanEmitter, activated, extract_context
from connector.vocabulary import PUSH_REG_TRACE_KEY, SPAN_PUSH_WRITE, Attr, StatKey, Trigger

logger = logging.getLogger(__name__)


class PushFlow:
    """Mixin for `NixlPushConnectorWorker`: the prefill side of a push."""

    def _do_start_push_kv(self, request_id: str, local_block_ids: Any,
                          registration_data: dict[str, Any]) -> None:
        span = None
        if self._spans.enabled:
            span = self._write_spans.get(request_id)
            if span is None:
                span = self._spans.start(
                    SPAN_PUSH_WRITE,
                    parent=extract_context(registration_data.get(PUSH_REG_TRACE_KEY)),
                    kind=SpanKind.CONSUMER,
                    attributes={Attr.REQUEST_ID: request_id,
                                Attr.REMOTE_REQUEST_ID: str(registration_data.get("request_id", "")),
                                Attr.REMOTE_ENGINE_ID: str(registration_data.get("decode_engine_id", "")),
                                Attr.LOCAL_ENGINE_ID: self.engine_id,
                                Attr.NUM_BLOCKS: count_blocks(local_block_ids)})
                self._write_spans.put(request_id, span)
        with activated(span), self._triggered_by(Trigger.PUSH_WRITE):
            super()._do_start_push_kv(request_id, local_block_ids, registration_data)

    def _xfer_blocks_for_req(self, req_id: str, meta: ReqMeta) -> None:
        try:
            super()._xfer_blocks_for_req(req_id, meta)
        except Exception:
            self._mark_push_failed(req_id, "transfer_setup_failed", "WRITE could not be planned")
            raise

    def _xfer_blocks(self, *args: Any, **kwargs: Any) -> int | None:
        handle = super()._xfer_blocks(*args, **kwargs)
        # Count here, before the caller publishes the handle: once published, the
        # main thread may see the WRITE done at any moment.
        if handle is not None:
            req_id = kwargs["request_id"] if "request_id" in kwargs else args[2]
            with self._push_lock:
                first = req_id not in self._pushing
                self._pushing.add(req_id)
            if first:
                self.xfer_stats.record_push(StatKey.PUSHES_STARTED)
        return handle

    def _mark_push_failed(self, req_id: str, failure_type: str, message: str) -> None:
        with self._push_lock:
            first = req_id not in self._push_failed
            self._push_failed.add(req_id)
            if len(self._push_failed) > MAX_TRACKED_REQUESTS:
                self._push_failed.pop()
        if first:
            self.xfer_stats.record_push(StatKey.PUSHES_FAILED)
        SpanEmitter.end(self._write_spans.pop(req_id), error_type=failure_type, message=message)


"""P-side flow: a matched PUSH_REG until the WRITE completed, observed.

Wrappers at the boundary of vLLM's push worker: they open the request's write span
under the trace context the PUSH_REG carried (linked to the context P's own request
arrived with, which our scheduler passes in the step metadata), tag the P->D
handshake a WRITE starts, and count pushes started and failed.
"""

from __future__ import annotations

import logging
from typing import Any

from opentelemetry.trace import SpanKind
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import (
    NixlConnectorMetadata,
    ReqMeta,
)

from connector.glue.receive import count_blocks
from connector.telemetry.span_table import MAX_TRACKED_REQUESTS
from connector.telemetry.tracing import SpanEmitter, activated, context_link, extract_context
from connector.vocabulary import (
    METADATA_TRACE_ATTR,
    PUSH_REG_TRACE_KEY,
    REGISTRATION_TRACE_KEY,
    SPAN_PUSH_WRITE,
    Attr,
    LinkRole,
    StatKey,
    Trigger,
)

logger = logging.getLogger(__name__)


class PushFlow:
    """Mixin for `NixlPushConnectorWorker`: the prefill side of a push."""

    def start_load_kv(self, metadata: NixlConnectorMetadata) -> None:
        if self._spans.enabled:
            contexts = getattr(metadata, METADATA_TRACE_ATTR, None)
            if contexts:
                try:
                    for req_id, carrier in contexts.items():
                        self._request_contexts.put(req_id, carrier)
                except Exception:
                    logger.debug("request trace contexts dropped", exc_info=True)
        super().start_load_kv(metadata)

    def _write_span_placement(self, request_id: str,
                              registration_data: dict[str, Any]) -> tuple[Any, list[Any] | None]:
        """Parent and links of a write span.

        Parent: the D register span the PUSH_REG names (one tree from D's receive
        down to P's write and the handshakes it starts); else D's request context
        (a D that does not trace but got one from its scheduler); else P's own
        request context; else a root. Link: P's own request context, when it is
        not already the parent.
        """
        own = extract_context(self._request_contexts.pop(request_id))
        parent = (extract_context(registration_data.get(PUSH_REG_TRACE_KEY))
                  or extract_context(registration_data.get(REGISTRATION_TRACE_KEY)))
        if parent is None:
            return own, None
        link = context_link(own, {Attr.LINK_ROLE: LinkRole.PREFILL_REQUEST.value})
        return parent, [link] if link is not None else None

    def _do_start_push_kv(self, request_id: str, local_block_ids: Any,
                          registration_data: dict[str, Any]) -> None:
        span = None
        if self._spans.enabled:
            span = self._write_spans.get(request_id)
            if span is None:
                parent, links = self._write_span_placement(request_id, registration_data)
                span = self._spans.start(
                    SPAN_PUSH_WRITE, parent=parent, links=links,
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


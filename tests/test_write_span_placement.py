"""Where P's write span goes: the parent rule and the link, over every kind of peer.

Pure logic over the contexts a PUSH_REG and P's step metadata can carry (our traced D,
a D whose workers do not trace, a stock D; P's request with or without a context).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from opentelemetry import trace

from connector.glue.push import PushFlow, write_span_links
from connector.telemetry.span_table import SpanTable
from connector.vocabulary import PUSH_REG_TRACE_KEY, REGISTRATION_TRACE_KEY, Attr, LinkRole

REGISTER = ("11111111111111111111111111111111", "aaaaaaaaaaaaaaaa")  # D's register span
D_REQUEST = ("22222222222222222222222222222222", "bbbbbbbbbbbbbbbb")  # D's request context
P_REQUEST = ("33333333333333333333333333333333", "cccccccccccccccc")  # P's request context


def carrier(ids: tuple[str, str]) -> dict[str, str]:
    return {"traceparent": f"00-{ids[0]}-{ids[1]}-01"}


def placement(reg_extra: dict, p_context: tuple[str, str] | None):
    worker = SimpleNamespace(_request_contexts=SpanTable(spans=False))
    if p_context is not None:
        worker._request_contexts.put("p-req", carrier(p_context))
    registration = {"request_id": "d-req", "decode_engine_id": "d", **reg_extra}
    parent, own = PushFlow._write_span_placement(worker, "p-req", registration)
    links = None if own is None else write_span_links(own)
    assert worker._request_contexts.get("p-req") is None  # consumed once
    ids = None
    if parent is not None:
        span = parent if isinstance(parent, trace.Span) else trace.get_current_span(parent)
        ctx = span.get_span_context()
        ids = (format(ctx.trace_id, "032x"), format(ctx.span_id, "016x"))
    link_ids = [(format(x.context.trace_id, "032x"), format(x.context.span_id, "016x"),
                 dict(x.attributes)) for x in links or []]
    return ids, link_ids


LINK_P = (*P_REQUEST, {Attr.LINK_ROLE: LinkRole.PREFILL_REQUEST.value})


@pytest.mark.parametrize("reg_extra, p_context, parent, links", [
    # Our traced D: parent is its register span; P's own request is a link.
    ({PUSH_REG_TRACE_KEY: carrier(REGISTER)}, P_REQUEST, REGISTER, [LINK_P]),
    ({PUSH_REG_TRACE_KEY: carrier(REGISTER)}, None, REGISTER, []),
    # Both keys (never sent by our D, which drops the request key): the register span wins.
    ({PUSH_REG_TRACE_KEY: carrier(REGISTER), REGISTRATION_TRACE_KEY: carrier(D_REQUEST)},
     P_REQUEST, REGISTER, [LINK_P]),
    # A D whose workers do not trace forwarded its scheduler's key: D's request context.
    ({REGISTRATION_TRACE_KEY: carrier(D_REQUEST)}, P_REQUEST, D_REQUEST, [LINK_P]),
    # A stock D: P's own request context becomes the parent, no link.
    ({}, P_REQUEST, P_REQUEST, []),
    # Nothing anywhere: a root, as before.
    ({}, None, None, []),
    # A malformed peer context is ignored, not fatal.
    ({PUSH_REG_TRACE_KEY: {"traceparent": "garbage"}}, P_REQUEST, P_REQUEST, []),
    ({PUSH_REG_TRACE_KEY: "not-a-map"}, None, None, []),
])
def test_parent_and_link(reg_extra, p_context, parent, links):
    assert placement(reg_extra, p_context) == (parent, links)

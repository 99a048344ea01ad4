"""P starts its P->D handshake when D's PUSH_REG arrives, not at the WRITE.

Real engines: a fork P with the early handshake (default), a fork P with it switched
off (`early_p_to_d_handshake: false`, upstream's order), and one fork D. For each P,
D registers a request while P's "prefill" is still running (P has not finished the
request yet): the early P is connected to D before its blocks are ready, and its
WRITE waits 0 s for a handshake; the other P only connects once the WRITE needs it.
A third P (also upstream's order) takes a request whose trace the sampler dropped.
"""

from __future__ import annotations

import secrets

import pytest

from connector.vocabulary import SPAN_HANDSHAKE, SPAN_PUSH_REGISTER, SPAN_PUSH_WRITE, Attr
from harness import PushHarness
from harness.config import FORK, EngineSpec
from harness.runner import free_port
from tests.conftest import drain_stats, handshakes, has_handshakes

pytestmark = pytest.mark.real


@pytest.fixture(scope="module")
def trio_early(tmp_path_factory):
    work = str(tmp_path_factory.mktemp("early"))
    common = dict(num_layers=2, num_blocks=64, tracing="memory", workdir=work, connector=FORK)
    specs = [
        EngineSpec(name="P", engine_id="prefill-early", kv_role="kv_producer",
                   side_channel_port=free_port(), **common),
        EngineSpec(name="L", engine_id="prefill-late", kv_role="kv_producer",
                   side_channel_port=free_port(),
                   extra_config={"early_p_to_d_handshake": False}, **common),
        EngineSpec(name="U", engine_id="prefill-unsampled", kv_role="kv_producer",
                   side_channel_port=free_port(),
                   extra_config={"early_p_to_d_handshake": False}, **common),
        EngineSpec(name="D", engine_id="decode-early", kv_role="kv_consumer",
                   side_channel_port=free_port(), **common),
    ]
    with PushHarness(specs) as h:
        yield h


def push_with_slow_prefill(h: PushHarness, prefill: str, wait_connected: bool = False) -> dict:
    """D registers first; P finishes only after its PUSH_REG is waiting on P (and, with
    `wait_connected`, after P's connection to D is ready: a prefill long enough)."""
    p, d = h[prefill], h["D"]
    base = f"cmpl-{secrets.token_hex(6)}"
    p_id, d_id = f"{base}-{secrets.token_hex(4)}", f"{base}-{secrets.token_hex(4)}"
    p_blocks, d_blocks = p.allocate(2), d.allocate(2)
    p.call("fill", p_blocks, 1234)
    d.call("register", d_id, d_blocks, p.address, p_id, False)
    h.wait_for(prefill, lambda pending: d_id in pending, command="pending_registrations")
    if wait_connected:
        # Usable = what vLLM's `_ensure_handshake` checks (the agent is in `_remote_agents`,
        # set when the handshake's future completes); descriptors alone are set earlier.
        h.wait_for(prefill, lambda c: c["dst_handles"].get(d.info["engine_id"]) == 1
                   and d.info["engine_id"] in c["remote_agents"])
    connected_before_finish = h.wait_for(prefill, lambda c: True)["dst_handles"].get(
        d.info["engine_id"], 0)
    p.call("finish", p_id, p_blocks, 30.0)
    h.wait_for("D", lambda r: d_id in r["finished_recving"], command="results")
    return {"p_id": p_id, "d_id": d_id, "connected_before_finish": connected_before_finish,
            "bytes_ok": p.call("digest", p_blocks) == d.call("digest", d_blocks)}


def test_early_handshake_is_ready_before_the_prefill_ends(trio_early):
    h = trio_early
    # The P->D handshake runs while the request is still "prefilling": P is connected to
    # D (D's descriptors prepared) before P's blocks are ready.
    run = push_with_slow_prefill(h, "P", wait_connected=True)
    assert run["bytes_ok"] and run["connected_before_finish"] == 1
    [hs] = [x for x in handshakes(drain_stats(h, "P", has_handshakes(1)))
            if x["direction"] == "p_to_d"]
    assert (hs["trigger"], hs["notif_only"], hs["outcome"]) == ("push_reg_early", False, "success")
    spans = h["P"].call("spans")
    [write] = [s for s in spans if s["name"] == SPAN_PUSH_WRITE
               and s["attributes"][Attr.REQUEST_ID] == run["p_id"]]
    [hs_span] = [s for s in spans if s["name"] == SPAN_HANDSHAKE]
    assert hs_span["attributes"][Attr.TRIGGER] == "push_reg_early"
    # In the request's trace (under D's register span, through the PUSH_REG's context).
    assert hs_span["trace_id"] == write["trace_id"]
    assert write["attributes"].get(Attr.HANDSHAKE_WAIT) == 0.0, write
    # A second request from the same D: connected, no new handshake, no wait.
    again = push_with_slow_prefill(h, "P")
    assert again["bytes_ok"] and again["connected_before_finish"] == 1
    spans = h["P"].call("spans")
    [write2] = [s for s in spans if s["name"] == SPAN_PUSH_WRITE
                and s["attributes"][Attr.REQUEST_ID] == again["p_id"]]
    assert write2["attributes"][Attr.HANDSHAKE_WAIT] == 0.0
    assert len([s for s in spans if s["name"] == SPAN_HANDSHAKE]) == 1


def test_without_it_the_write_pays_for_the_handshake(trio_early):
    h = trio_early
    run = push_with_slow_prefill(h, "L")
    assert run["bytes_ok"]
    assert run["connected_before_finish"] == 0  # upstream order: nothing before the WRITE
    [hs] = [x for x in handshakes(drain_stats(h, "L", has_handshakes(1)))
            if x["direction"] == "p_to_d"]
    assert (hs["trigger"], hs["notif_only"]) == ("push_write", False)
    [write] = [s for s in h["L"].call("spans") if s["name"] == SPAN_PUSH_WRITE
               and s["attributes"][Attr.REQUEST_ID] == run["p_id"]]
    assert write["attributes"][Attr.HANDSHAKE_WAIT] > 0.0


def _headers(sampled: bool) -> dict[str, str]:
    return {"traceparent": f"00-{secrets.token_hex(16)}-{secrets.token_hex(8)}-{'01' if sampled else '00'}"}


def test_a_dropped_trace_costs_no_span_and_keeps_no_state(trio_early):
    """A request whose trace was dropped upstream (its traceparent unsampled): its KV
    arrives, the WRITE that waited for a handshake is retried with the same dropped
    context, no span of it is exported on either side, nothing of it stays in the
    span tables; the handshake is still counted. The next, sampled request is traced."""
    h = trio_early
    p, d = h["U"], h["D"]
    runs = []
    for sampled in (False, True):
        base = f"cmpl-{secrets.token_hex(6)}"
        p_id, d_id = f"{base}-{secrets.token_hex(4)}", f"{base}-{secrets.token_hex(4)}"
        p_blocks, d_blocks = p.allocate(2), d.allocate(2)
        p.call("fill", p_blocks, 99)
        d.call("register", d_id, d_blocks, p.address, p_id, False, _headers(sampled))
        h.wait_for("U", lambda pending, d_id=d_id: d_id in pending, command="pending_registrations")
        p.call("finish", p_id, p_blocks, 30.0, _headers(True))  # P's own request: sampled
        h.wait_for("D", lambda r, d_id=d_id: d_id in r["finished_recving"], command="results")
        assert p.call("digest", p_blocks) == d.call("digest", d_blocks)
        runs.append((p_id, d_id))
    (p_dropped, d_dropped), (p_kept, d_kept) = runs
    [hs] = [x for x in handshakes(drain_stats(h, "U", has_handshakes(1))) if x["direction"] == "p_to_d"]
    assert (hs["trigger"], hs["outcome"]) == ("push_write", "success")  # the dropped one's WRITE
    p_spans, d_spans = p.call("spans"), d.call("spans")
    request_ids = {s["attributes"].get(Attr.REQUEST_ID) for s in p_spans + d_spans}
    assert not {p_dropped, d_dropped} & request_ids
    assert not [s for s in p_spans if s["name"] == SPAN_HANDSHAKE]  # in the dropped trace
    [write] = [s for s in p_spans if s["name"] == SPAN_PUSH_WRITE]
    assert write["attributes"][Attr.REQUEST_ID] == p_kept
    [register] = [s for s in d_spans if s["name"] == SPAN_PUSH_REGISTER
                  and s["attributes"][Attr.REQUEST_ID] == d_kept]
    assert (write["trace_id"], write["parent_span_id"]) == (register["trace_id"], register["span_id"])
    for engine, tables in (("U", ("write_spans", "write_deferred_at", "request_contexts")),
                           ("D", ("receive_spans", "register_spans"))):
        sizes = h.wait_for(engine, lambda s, tables=tables: not any(s[t] for t in tables),
                           command="state_sizes")
        assert not any(sizes[t] for t in tables), sizes

"""Handshakes to different remote engines run at once, and safely, on real engines with
real NIXL agents.

The fork runs handshakes on a bounded pool, one at a time per remote engine, with
every NIXL/vLLM registration call serialised under a lock (vLLM builds its NIXL agent
with NIXL_THREAD_SYNC_NONE). Upstream, one worker's handshakes queue on a one-thread
executor: the M-th new peer waits for all the others.

Rig: fork decoder D0 and fork producers P1..P4 (the D side), plus fork decoders D1, D2
(the P side: P1 with D0..D2), memory tracing on D0 and P1. Each side channel under
test sits behind a relay that holds every request until the test opens it, once the
relays of all peers hold one: a handshake can only finish if all of them were in
their metadata fetch at the same time, so the overlap the spans show is forced by the
worker's concurrency, not by luck (a one-thread executor would wait on the first
relay until its side-channel timeout). Then every push between the engines is checked
byte for byte.
"""

from __future__ import annotations

import itertools
import secrets
import threading
from typing import Any

import msgspec
import pytest
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import NixlAgentMetadata

from connector.vocabulary import SPAN_HANDSHAKE, Attr, Phase, phase_span_name
from harness import PushHarness
from harness.cluster import rank_context
from harness.config import FORK, EngineSpec
from harness.poll import wait_until
from harness.runner import EngineHandle, free_port
from tests.conftest import drain_stats, handshakes
from tests.support.side_channel import SideChannelRelay

pytestmark = [pytest.mark.real, pytest.mark.timeout(1200)]

PRODUCERS = ("P1", "P2", "P3", "P4")
DECODERS = ("D0", "D1", "D2")
NUM_BLOCKS = 64
# Long enough that a held side-channel request never times out while the test waits
# for the other relays to fill (a slow, shared machine).
HANDSHAKE_TIMEOUT_MS = 60_000
START_TIMEOUT_S = 600.0
REGISTRATION_PHASES = {phase_span_name(p) for p in (
    Phase.AGENT_LOAD, Phase.TRANSFER_PLAN, Phase.DESCRIPTOR_REGISTRATION)}
FETCH = phase_span_name(Phase.METADATA_FETCH)


class HeldSideChannel(SideChannelRelay):
    """A relay in front of one engine's side channel: it holds every request until
    `open()`, then forwards each to the engine and relays the reply."""

    def __init__(self, upstream_port: int):
        super().__init__(upstream_port, forward_timeout_ms=30_000)
        self.received = 0
        self._opened = threading.Event()
        self.start()

    def open(self) -> None:
        self._opened.set()

    def _serve(self) -> None:
        held: list[tuple[bytes, bytes]] = []
        while not self._stop.is_set():
            if self._sock.poll(10):
                identity, _empty, msg = self._sock.recv_multipart()
                held.append((identity, msg))
                self.received += 1
            while held and self._opened.is_set():
                identity, msg = held.pop(0)
                self._sock.send_multipart([identity, b"", *self._forward(msg)])


def held_until_all_arrive(relays: list[HeldSideChannel], what: str) -> None:
    """Wait until every relay holds a request, then open them all (also on failure, so
    the engines' handshakes end)."""
    try:
        wait_until(lambda: all(r.received >= 1 for r in relays), what, timeout_s=60.0,
                   last=lambda: [r.received for r in relays])
    finally:
        for relay in relays:
            relay.open()


def agent_name(engine: EngineHandle) -> str:
    """The NIXL agent name an engine serves on its side channel, read from its own
    handshake payload (NIXL's serialized agent metadata: `|Agent` + u64 length + name)."""
    payload = engine.call("handshake_payload")
    blob = msgspec.msgpack.decode(payload.agent_metadata_bytes, type=NixlAgentMetadata).agent_metadata
    at = blob.index(b"|Agent") + len(b"|Agent")
    size = int.from_bytes(blob[at:at + 8], "little")
    return blob[at + 8:at + 8 + size].decode()


class Rig:
    def __init__(self, h: PushHarness):
        self.h = h
        # Blocks written by pushes the harness's `push` did not drive (its check of
        # untouched blocks does not know them).
        self.written_elsewhere: dict[str, set[int]] = {d: set() for d in DECODERS}

    def disconnect(self, engine: str, peers: tuple[str, ...]) -> None:
        """`engine` drops its connections to `peers` (vLLM's TTL eviction path)."""
        connected = self.h[engine].call("connections")["remote_agents"]
        for peer in peers:
            eid = self.h[peer].info["engine_id"]
            if eid in connected:
                self.h[engine].call("forget", eid)

    def new_handshake_spans(self, engine: str, before: int, remote: set[str]) -> dict[str, Any]:
        """The handshake spans `engine` finished since span number `before` whose peer is
        in `remote`, each with its phase spans: {remote engine id: (span, [phases])}."""
        spans = self.h[engine].call("spans")[before:]
        out = {}
        for s in spans:
            if s["name"] == SPAN_HANDSHAKE and s["attributes"][Attr.REMOTE_ENGINE_ID] in remote:
                phases = [c for c in spans if c["parent_span_id"] == s["span_id"]]
                assert s["attributes"][Attr.REMOTE_ENGINE_ID] not in out, "two handshakes to one peer"
                out[s["attributes"][Attr.REMOTE_ENGINE_ID]] = (s, phases)
        return out


def overlap(a: dict, b: dict) -> bool:
    return a["start"] < b["end"] and b["start"] < a["end"]


def all_overlap(spans: list[dict]) -> bool:
    """One instant lies inside every span."""
    return max(s["start"] for s in spans) < min(s["end"] for s in spans)


def assert_one_at_a_time(times: list[tuple[str, str, float, float]], agents: int) -> None:
    """No two of these NIXL registration calls ran at the same time (and there were
    agent loads for this many agents)."""
    assert len({agent for call, agent, _, _ in times if call == "add_remote_agent"}) == agents, times
    ordered = sorted((start, end) for _, _, start, end in times)
    overlaps = [(a, b) for a, b in itertools.pairwise(ordered) if b[0] < a[1]]
    assert overlaps == [], overlaps


@pytest.fixture(scope="module")
def rig(tmp_path_factory: pytest.TempPathFactory) -> Any:
    work = str(tmp_path_factory.mktemp("concurrent-hs"))
    run = secrets.token_hex(3)
    common = dict(num_layers=2, num_blocks=NUM_BLOCKS, block_size=32, workdir=work, connector=FORK,
                  extra_config={"handshake_timeout_ms": HANDSHAKE_TIMEOUT_MS})
    traced = {"D0", "P1"}
    specs = [EngineSpec(name=n, engine_id=f"chs-{n.lower()}-{run}",
                        kv_role="kv_producer" if n.startswith("P") else "kv_consumer",
                        side_channel_port=free_port(), tracing="memory" if n in traced else None,
                        **common)
             for n in (*DECODERS, *PRODUCERS)]
    ctx = rank_context()
    h = PushHarness(specs, ctx=ctx)
    try:
        for name, spec in h.specs.items():
            h.engines[name] = EngineHandle(spec, ctx)
        for handle in h.engines.values():
            handle.wait_ready(timeout=START_TIMEOUT_S)
        yield Rig(h)
    finally:
        h.stop()


def test_decoder_handshakes_with_four_producers_at_once(rig: Rig) -> None:
    """D0 reaches P1..P4 at once: four notification-only handshakes, fetched concurrently,
    registered one at a time; one agent per producer, its own; then pushes from each."""
    h, d = rig.h, rig.h["D0"]
    rig.disconnect("D0", PRODUCERS)
    spans_before = len(d.call("spans"))
    calls_before = len(d.call("nixl_calls"))
    times_before = len(d.call("nixl_call_times"))
    h.stats("D0")
    relays = {p: HeldSideChannel(h[p].info["port"]) for p in PRODUCERS}
    try:
        outcome: dict[str, Any] = {}

        def handshake_all() -> None:  # (D0's command loop waits for all four)
            try:
                outcome["result"] = d.call("timed_handshakes",
                                           [{**h[p].address, "port": relays[p].port} for p in PRODUCERS],
                                           timeout=300)
            except Exception as exc:
                outcome["error"] = exc

        runner = threading.Thread(target=handshake_all)
        runner.start()
        held_until_all_arrive(list(relays.values()), "D0's four metadata requests in flight at once")
        runner.join(300)
        assert "error" not in outcome and "result" in outcome, outcome
    finally:
        for relay in relays.values():
            relay.close()
    # The harness's own clock on D0's handshake pool: all four jobs ran at the same time.
    assert outcome["result"]["executor"]["max_running"] == len(PRODUCERS)

    eids = {h[p].info["engine_id"]: p for p in PRODUCERS}
    records = handshakes(drain_stats(h, "D0", lambda s: len(handshakes(s)) >= len(PRODUCERS)))
    assert [(r["direction"], r["notif_only"], r["outcome"], r["attempt"]) for r in records] == [
        ("d_to_p", True, "success", 1)] * len(PRODUCERS)

    # One NIXL agent per producer, and it is that producer's (names from the producers' own
    # payloads vs what D0 asked NIXL to load); no descriptor list for any of them.
    names = {agent_name(h[p]): p for p in PRODUCERS}
    assert len(names) == len(PRODUCERS)
    new_calls = d.call("nixl_calls")[calls_before:]
    loaded = [agent for call, agent, _ in new_calls if call == "add_remote_agent"]
    assert sorted(loaded) == sorted(names)
    assert [c for c in new_calls if c[0] == "prep_xfer_dlist" and c[1] in names] == []
    conns = d.call("connections")
    for eid in eids:
        assert conns["remote_agents"][eid] == 1 and eid in conns["notif_only"]
        assert eid not in conns["dst_handles"]

    by_peer = rig.new_handshake_spans("D0", spans_before, set(eids))
    assert set(by_peer) == set(eids)
    for span, _ in by_peer.values():
        assert span["attributes"][Attr.NOTIF_AGENTS_ONLY] is True and span["status"] == "UNSET"
    fetches = [[c for c in phases if c["name"] == FETCH] for _, phases in by_peer.values()]
    assert all(len(f) == 1 for f in fetches), fetches
    assert all_overlap([f[0] for f in fetches])  # the four fetches ran at once
    loads = {eid: [c for c in phases if c["name"] == phase_span_name(Phase.AGENT_LOAD)]
             for eid, (_, phases) in by_peer.items()}
    assert all(len(x) == 1 for x in loads.values()), loads
    # The agent loads ran one at a time: NIXL's calls as the harness timed them.
    assert_one_at_a_time(d.call("nixl_call_times")[times_before:], len(PRODUCERS))

    for p in PRODUCERS:
        report = h.push(3, prefill=p, decode="D0", bulk=True)
        assert report.verified == 3 and not report.failed and not report.mismatched, (p, report)
        assert set(report.dirty_blocks) <= rig.written_elsewhere["D0"], (p, report.dirty_blocks)


def test_producer_handshakes_with_three_decoders_at_once(rig: Rig) -> None:
    """D0..D2 register with P1 at once; each PUSH_REG makes P1 start a full P->D
    handshake early: fetched concurrently, registered one at a time; every push lands."""
    h, p = rig.h, rig.h["P1"]
    rig.disconnect("P1", DECODERS)
    spans_before = len(p.call("spans"))
    calls_before = len(p.call("nixl_calls"))
    times_before = len(p.call("nixl_call_times"))
    h.stats("P1")
    every_block = list(range(NUM_BLOCKS))
    digests_before = {d: h[d].call("digest", every_block) for d in DECODERS}
    relays = {d: HeldSideChannel(h[d].info["port"]) for d in DECODERS}
    requests = {}
    try:
        for d in DECODERS:
            base = f"cmpl-{secrets.token_hex(6)}"
            p_id, d_id = f"{base}-{secrets.token_hex(4)}", f"{base}-{secrets.token_hex(4)}"
            p_blocks, d_blocks = p.allocate(2), h[d].allocate(2)
            p.call("fill", p_blocks, int.from_bytes(secrets.token_bytes(4), "little"))
            requests[d] = (p_id, d_id, p_blocks, d_blocks)
        # Each D's PUSH_REG names its relay as D's side channel: P1 handshakes through it.
        for d in DECODERS:
            p_id, d_id, _, d_blocks = requests[d]
            h[d].call("register_as", d_id, d_blocks, p.address, p_id, {"decode_port": relays[d].port})
        held_until_all_arrive(list(relays.values()), "P1's three metadata requests in flight at once")
        eids = {h[d].info["engine_id"]: d for d in DECODERS}
        h.wait_for("P1", lambda c: all(c["dst_handles"].get(e) == 1 and e in c["remote_agents"]
                                       for e in eids), timeout_s=120.0)
    finally:
        for relay in relays.values():
            relay.close()
    # The prefills finish in one P1 step; every decoder gets its bytes.
    p.call_all([("finish", (p_id, p_blocks, 30.0)) for p_id, _, p_blocks, _ in requests.values()],
               bulk=True)
    for d, (_, d_id, p_blocks, d_blocks) in requests.items():
        res = h.wait_for(d, lambda r, d_id=d_id: d_id in r["finished_recving"], command="results")
        assert d_id not in res["failed_recving"]
        assert p.call("digest", p_blocks) == h[d].call("digest", d_blocks), d
        after = h[d].call("digest", every_block)
        changed = {b for b in every_block if after[b] != digests_before[d][b]}
        assert changed == set(d_blocks), (d, changed)  # nothing else in D was written
        rig.written_elsewhere[d].update(d_blocks)

    records = [r for r in handshakes(drain_stats(h, "P1", lambda s: len(handshakes(s)) >= len(DECODERS)))
               if r["direction"] == "p_to_d"]
    assert [(r["trigger"], r["notif_only"], r["outcome"], r["attempt"]) for r in records] == [
        ("push_reg_early", False, "success", 1)] * len(DECODERS)
    # Full handshakes: P1 loaded each decoder's own agent and prepared its descriptors.
    names = {agent_name(h[d]): d for d in DECODERS}
    new_calls = p.call("nixl_calls")[calls_before:]
    assert sorted(a for call, a, _ in new_calls if call == "add_remote_agent") == sorted(names)
    assert {a for call, a, n in new_calls if call == "prep_xfer_dlist" and n > 0} >= set(names)

    by_peer = rig.new_handshake_spans("P1", spans_before, set(eids))
    assert set(by_peer) == set(eids)
    fetches = [[c for c in phases if c["name"] == FETCH] for _, phases in by_peer.values()]
    assert all(len(f) == 1 for f in fetches), fetches
    assert all_overlap([f[0] for f in fetches])
    registration = {eid: [c for c in phases if c["name"] in REGISTRATION_PHASES]
                    for eid, (_, phases) in by_peer.items()}
    for eid, spans in registration.items():
        assert {s["name"] for s in spans} == REGISTRATION_PHASES, (eid, [s["name"] for s in spans])
    # Registered one at a time: NIXL's calls as the harness timed them.
    assert_one_at_a_time(p.call("nixl_call_times")[times_before:], len(DECODERS))

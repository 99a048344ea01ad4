"""Unit tests of the pure pieces: phase clock, error classes, savings, signature binding."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import zmq

from connector.glue.compat import (
    ENSURE_HANDSHAKE_TAIL,
    RemoteAgentTable,
    accepted,
    bind_handshake_tail,
)
from connector.telemetry.record import HandshakeError, HandshakeRecord, classify_error
from connector.telemetry.savings import (
    LocalLayout,
    LocalListLedger,
    remote_descriptor_count,
    shape_aware_saving,
)
from connector.vocabulary import DescriptorList, Direction, ErrorType, Outcome, Phase, Trigger


def record(**kw):
    base = dict(direction=Direction.D_TO_P, trigger=Trigger.PUSH_REG, notif_only=True,
                remote_engine_id="p", host="h", port=1, remote_tp_size=1, remote_pp_size=1,
                local_tp_rank=0)
    return HandshakeRecord(**{**base, **kw})


def test_phase_clock_segments_are_contiguous_and_merge_same_phase():
    r = record(submitted_ns=0)
    r.set_rank(0, 0)
    r.enter(Phase.METADATA_FETCH, now_ns=10)
    r.enter(Phase.METADATA_FETCH, now_ns=15)  # same phase, same rank: no new segment
    r.enter(Phase.METADATA_DECODE, now_ns=20)
    r.set_rank(0, 1)
    r.enter(Phase.METADATA_DECODE, now_ns=30)  # other rank: new segment
    r.close_phase(now_ns=40)
    assert [(s.phase, s.start_ns, s.end_ns, s.remote_tp_rank) for s in r.segments] == [
        (Phase.METADATA_FETCH, 10, 20, 0), (Phase.METADATA_DECODE, 20, 30, 0),
        (Phase.METADATA_DECODE, 30, 40, 1)]
    assert r.phase_seconds() == {"metadata_fetch": 10e-9, "metadata_decode": 20e-9}


def test_finish_with_error_names_the_phase_that_was_running():
    r = record()
    r.enter(Phase.METADATA_DECODE)
    r.finish(HandshakeError(ErrorType.ENGINE_ID_MISMATCH, "boom"))
    assert r.outcome is Outcome.FAILURE
    assert r.failed_phase is Phase.METADATA_DECODE
    assert r.error_type is ErrorType.ENGINE_ID_MISMATCH
    stats = r.to_stats()
    assert stats["failed_phase"] == "metadata_decode" and stats["error_type"] == "engine_id_mismatch"
    assert r.segments[-1].end_ns > 0


@pytest.mark.parametrize(("exc", "expected"), [
    (zmq.Again(), ErrorType.TIMEOUT),
    (RuntimeError("NIXL compatibility hash mismatch. Local: a"), ErrorType.COMPAT_HASH_MISMATCH),
    (RuntimeError("Remote NIXL agent engine ID mismatch"), ErrorType.ENGINE_ID_MISMATCH),
    (RuntimeError("Failed to decode NixlHandshakePayload"), ErrorType.DECODE_ERROR),
    (NotImplementedError("hetero TP"), ErrorType.CONFIG_MISMATCH),
    (KeyError("x"), ErrorType.OTHER),
])
def test_classify_error_maps_onto_the_bounded_set(exc, expected):
    assert classify_error(exc) is expected


def test_registration_counting_by_list():
    r = record()
    r.count_registration(DescriptorList.REMOTE, 256)
    r.count_registration(DescriptorList.LOCAL, 64)
    assert r.to_stats()["registrations"] == {"remote": 1, "local": 1}
    assert r.to_stats()["descriptors"] == {"remote": 256, "local": 64}


def meta(**kw):
    base = dict(kv_caches_base_addr=[1, 2, 3], num_blocks=100, region_num_blocks=None, block_size=32)
    return SimpleNamespace(**{**base, **kw})


def test_savings_count_one_descriptor_per_remote_block_per_region():
    assert remote_descriptor_count(meta()) == 300
    assert remote_descriptor_count(meta(region_num_blocks=[10, 20, 30])) == 60
    # A PP layer slice only registers its window of the peer's regions.
    assert remote_descriptor_count(meta(region_num_blocks=[10, 20, 30]),
                                   LocalLayout(block_size=32, num_descs=0, pp_window=(1, 2))) == 50


def _saving(m, layout, registered_block_sizes):
    return shape_aware_saving(m, layout, local_tp_size=1, remote_tp_size=1, remote_pp_size=1,
                              registered_block_sizes=registered_block_sizes,
                              registered_tp_splits=set(), ledger=LocalListLedger())


def test_savings_include_the_first_smaller_block_size_local_list():
    layout = LocalLayout(block_size=32, num_descs=40)
    s = _saving(meta(block_size=16), layout, set())
    assert (s.registrations, s.descriptors) == (2, 300 + 40 * 2)
    again = _saving(meta(block_size=16), layout, {16})
    assert (again.registrations, again.descriptors) == (1, 300)


def test_bind_handshake_tail_follows_the_installed_signature():
    assert ENSURE_HANDSHAKE_TAIL[:3] == ("dcp_size", "pp_size", "notif_agents_only")
    assert bind_handshake_tail((1, 2, True), {}) == {"dcp_size": 1, "pp_size": 2, "notif_agents_only": True}
    assert bind_handshake_tail((), {"pp_size": 4}) == {"pp_size": 4}
    with pytest.raises(TypeError, match="optional positional"):
        bind_handshake_tail(tuple(range(len(ENSURE_HANDSHAKE_TAIL) + 1)), {})


def test_remote_agent_table_hides_an_engine_from_one_thread_only():
    import threading

    table = RemoteAgentTable({"p": {(0, 0): "agent"}})
    table.hide_from_this_thread("p")
    assert table.get("p", {}) == {}
    seen = []
    t = threading.Thread(target=lambda: seen.append(table.get("p")))
    t.start()
    t.join()
    assert seen == [{(0, 0): "agent"}]
    assert "p" in table  # membership (connectedness) is unchanged
    table.hide_from_this_thread(None)
    assert table.get("p") == {(0, 0): "agent"}


def test_accepted_passes_only_what_the_installed_signature_takes():
    def older(self, metadata, remote_tp_size):  # a release without remote_dcp_size
        ...

    def newer(self, metadata, remote_tp_size, remote_dcp_size=1, **extra):
        ...

    assert accepted(older, remote_tp_size=2, remote_dcp_size=1) == {"remote_tp_size": 2}
    assert accepted(newer, remote_tp_size=2, remote_dcp_size=1) == {"remote_tp_size": 2,
                                                                    "remote_dcp_size": 1}

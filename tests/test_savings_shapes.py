"""Unit tests of the shape-aware saving rules (pure arithmetic; the matrix in
tests/test_shapes.py checks the same rules against real stock handshakes)."""

from __future__ import annotations

from types import SimpleNamespace

from connector.telemetry.savings import (
    LocalLayout,
    LocalListLedger,
    shape_aware_saving,
    why_no_full_handshake,
)
from connector.vocabulary import NoSaving


def meta(block_size: int = 32, regions: int = 2, blocks: int = 24) -> SimpleNamespace:
    return SimpleNamespace(block_size=block_size, num_blocks=blocks, kv_caches_base_addr=[0] * regions,
                           region_num_blocks=None)


def saving(m: SimpleNamespace, ledger: LocalListLedger, *, local_tp: int = 1, remote_tp: int = 1,
           remote_pp: int = 1, local_block_size: int = 32, registered_splits=frozenset()):
    layout = LocalLayout(block_size=local_block_size, num_descs=48)
    s = shape_aware_saving(m, layout, local_tp_size=local_tp,
                           remote_tp_size=remote_tp, remote_pp_size=remote_pp, registered_block_sizes=set(),
                           registered_tp_splits=set(registered_splits), ledger=ledger)
    return s.registrations, s.descriptors


def test_fewer_d_ranks_than_p_count_the_tp_split_lists_once_per_worker():
    ledger = LocalListLedger()
    # D TP 1 <- P TP 2: first remote rank adds 2 split lists of 48 local descriptors.
    assert saving(meta(), ledger, remote_tp=2) == (1 + 2, 48 + 2 * 48)
    assert saving(meta(), ledger, remote_tp=2) == (1, 48)  # second remote rank: remote list only
    # Another P engine with the same TP ratio: vLLM reuses the split lists.
    assert saving(meta(), ledger, remote_tp=2) == (1, 48)


def test_split_lists_already_registered_by_a_real_full_handshake_are_not_counted():
    assert saving(meta(), LocalListLedger(), local_tp=2, remote_tp=4,
                  registered_splits={(-2, 32)}) == (1, 48)


def test_equal_or_more_d_ranks_add_no_local_lists():
    assert saving(meta(), LocalListLedger(), local_tp=2, remote_tp=1) == (1, 48)
    assert saving(meta(), LocalListLedger(), local_tp=2, remote_tp=2) == (1, 48)


def test_nothing_is_saved_where_a_full_handshake_cannot_happen():
    # A PP producer: vLLM never handshakes it fully (each PP rank holds a layer slice).
    assert saving(meta(), LocalListLedger(), remote_pp=2) == (0, 0)
    # A larger remote block: vLLM's block_size_ratio asserts before preparing anything.
    assert saving(meta(block_size=64), LocalListLedger()) == (0, 0)
    assert why_no_full_handshake(64, 32, 1) is NoSaving.BLOCK_SIZE_MISMATCH
    assert why_no_full_handshake(32, 32, 2) is NoSaving.PP_PRODUCER
    assert why_no_full_handshake(16, 32, 1) is None and why_no_full_handshake(32, 32, 1) is None


def test_smaller_remote_block_adds_one_local_list_once():
    ledger = LocalListLedger()
    assert saving(meta(block_size=16), ledger) == (2, 48 + 48 * 2)
    assert saving(meta(block_size=16), ledger) == (1, 48)

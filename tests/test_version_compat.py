"""Right numbers on every vLLM the CI runs (0.32, 0.33 and 0.34): descriptor forms, region
layouts, error texts.

The savings model is checked against vLLM's *own* region-mapping methods (called
unbound on a minimal stand-in for the worker state they read), so a layout vLLM
changes shows up here rather than as a silently wrong "saved" counter.
"""

from __future__ import annotations

import inspect
from types import SimpleNamespace

import numpy as np
import pytest
from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker import NixlBaseConnectorWorker

from connector.glue.guard import installed_version, minor_of
from connector.telemetry.handshake_calls import count_descriptors
from connector.telemetry.record import classify_error
from connector.telemetry.savings import (
    LocalLayout,
    LocalListLedger,
    remote_region_blocks,
    shape_aware_saving,
)
from connector.vocabulary import ErrorType
from harness.engine import _descriptor_count

VLLM_SOURCE = inspect.getsource(base_worker)
ON_033 = installed_version().startswith("0.33")
ON_034 = installed_version().startswith("0.34")


class DescList:
    """Stands in for NIXL's nixlXferDList (only descCount() is read)."""

    def __init__(self, n: int):
        self.n = n

    def descCount(self) -> int:  # NIXL's name
        return self.n


@pytest.mark.parametrize(("descs", "expected"), [
    (DescList(256), 256),  # vLLM 0.32: a prepared descriptor list
    # vLLM 0.33: Nx5 strided rows (address, length, device id, stride, count); one row
    # per region here, 128 blocks each: 2 rows, 256 descriptors.
    (np.array([[0x1000, 4096, 0, 4096, 128], [0x90000, 4096, 0, 4096, 128]], dtype=np.uint64), 256),
    # 0.33's padded-block form: one row per block, `ratio` sub-blocks each.
    (np.array([[a, 1024, 0, 1024, 2] for a in range(0, 40960, 4096)], dtype=np.uint64), 20),
    (np.array([[0x1000, 4096, 0]] * 7, dtype=np.uint64), 7),  # Nx3: one per row
    ([(0x1000, 4096, 0), (0x2000, 4096, 0)], 2),  # list of region tuples
])
def test_descriptor_count_understands_both_nixl_forms(descs, expected):
    assert count_descriptors(descs) == expected
    assert _descriptor_count(descs) == expected  # the harness's independent count agrees


def test_strided_layout_matches_vllm_033_packing():
    """Column 4 is the count in the rows vLLM builds (checked in the installed source)."""
    pack = getattr(NixlBaseConnectorWorker, "_block_strided_descs", None)
    if pack is None:
        pytest.skip(f"vLLM {installed_version()} prepares descriptor lists, not strided rows")
    dense = pack(0x1000, 512, 1024, 10, 2, 0)  # 10 blocks of 1024 B -> 20 sub-blocks of 512 B
    padded = pack(0x1000, 512, 2048, 10, 2, 0)  # padded blocks: one row per block
    assert count_descriptors(dense) == count_descriptors(padded) == 20
    assert len(dense) == 1 and len(padded) == 10
    assert "(addr, len, dev_id, stride, count)" in VLLM_SOURCE


def meta(**kw):
    base = dict(kv_caches_base_addr=[1000, 2000, 3000], block_lens=[64, 64, 64],
                block_strides=[64, 64, 64], num_blocks=100, region_num_blocks=[10, 20, 30],
                region_group_ids=None, region_names=None, region_mem_types=None,
                region_members=[], packed_member_layouts={}, block_size=32, engine_id="P",
                layer_group_ids={})
    return SimpleNamespace(**{**base, **kw})


def test_layer_name_routing_matches_vllm():
    """vLLM 0.32/0.33: HMA/packed PP stages pick the peer's regions by layer name, in local order."""
    if not hasattr(NixlBaseConnectorWorker, "_align_remote_regions_by_layer"):
        pytest.skip(f"vLLM {installed_version()} pairs regions by layer (_pair_regions)")
    m = meta(region_members=[["l0"], ["l1"], ["l2", "l3"]], region_names=["a", "b", "c"])
    layer_names = ("l3", "l1")
    layout = LocalLayout(block_size=32, num_descs=0, routed_layer_names=layer_names)
    ours = remote_region_blocks(m, layout)
    stage = SimpleNamespace(_transfer_layer_names=layer_names, _transfer_layer_region_indices=(0, 1),
                            block_len_per_layer=[64, 64])
    NixlBaseConnectorWorker._align_remote_regions_by_layer(stage, m)
    assert ours == m.region_num_blocks == [30, 20]


def test_packed_remote_row_split_per_local_layer_matches_vllm():
    """vLLM 0.33: a peer's packed row (every layer in one region) becomes one region per
    local layer; a full handshake prepares one descriptor per block of each of them."""
    split = getattr(NixlBaseConnectorWorker, "_split_remote_packed_rows", None)
    if split is None:
        pytest.skip(f"vLLM {installed_version()} does not split packed rows")
    m = meta(kv_caches_base_addr=[1000, 9000], block_lens=[256, 64], block_strides=[256, 64],
             region_num_blocks=[40, 7], region_group_ids=[0, 1], region_names=["l0", "indexer"],
             packed_member_layouts={"l0": (0, 64), "l1": (64, 64), "l2": (128, 64)})
    local_regions = ("l0", "l1", "l2", "indexer")
    layout = LocalLayout(block_size=32, num_descs=0, region_names=local_regions, splits_packed_rows=True)
    ours = remote_region_blocks(m, layout)
    split(SimpleNamespace(region_names=list(local_regions)), m)
    assert ours == m.region_num_blocks == [40, 40, 40, 7]
    saving = _saving(meta(**{**vars(m), "region_num_blocks": [40, 7],
                             "region_names": ["l0", "indexer"],
                             "packed_member_layouts": {"l0": (0, 64), "l1": (64, 64), "l2": (128, 64)}}),
                     layout)
    assert (saving.registrations, saving.descriptors) == (1, 127)


def _saving(m, layout):
    return shape_aware_saving(m, layout, local_tp_size=1, remote_tp_size=1, remote_pp_size=1,
                              registered_block_sizes=set(), registered_tp_splits=set(),
                              ledger=LocalListLedger())


def test_pp_slice_and_smaller_remote_blocks():
    layout = LocalLayout(block_size=32, num_descs=40, pp_window=(1, 2))
    assert remote_region_blocks(meta(), layout) == [20, 30]
    s = _saving(meta(block_size=16), layout)
    assert (s.registrations, s.descriptors) == (2, 50 + 40 * 2)


def test_local_layout_reads_the_installed_worker_class():
    w = object.__new__(base_worker.NixlBaseConnectorWorker)
    w.block_size, w.num_descs, w.pp_size, w.region_names = 32, 256, 2, ["l0", "l1"]
    w._transfer_layer_region_indices, w._packed_member_layouts = (), {}
    w._remote_region_offset, w.block_len_per_layer = 2, [64, 64]  # (0.32/0.33: this stage's window)
    w._regions_by_layer = {"l2": [0], "l3": [1]}  # (0.34: the layers this stage holds)
    layout = LocalLayout.of_worker(w)
    assert layout.routed_layer_names == ()
    pairs_by_layer = hasattr(NixlBaseConnectorWorker, "_pair_regions")
    assert pairs_by_layer is (minor_of(installed_version()) >= (0, 34))
    assert layout.paired_layers == (("l2", "l3") if pairs_by_layer else ())
    assert layout.pp_window == (None if pairs_by_layer else (2, 2))
    assert layout.splits_packed_rows is (pairs_by_layer or
                                         hasattr(NixlBaseConnectorWorker, "_split_remote_packed_rows"))


# ---- vLLM 0.34: regions pair through the layers both sides hold ---------------------

def _pairing_worker(regions_by_layer: dict[str, list[int]], *, pp_size: int = 1,
                    packed: dict | None = None) -> SimpleNamespace:
    """The worker state vLLM 0.34's `_pair_regions` reads (one cache group)."""
    n_local = 1 + max(r for regions in regions_by_layer.values() for r in regions)
    return SimpleNamespace(
        _packed_member_layouts=packed or {}, _regions_by_layer=regions_by_layer, pp_size=pp_size,
        kv_cache_config=SimpleNamespace(transfer_group_index_by_layer=dict.fromkeys(regions_by_layer, 0)),
        block_len_per_layer=[64] * n_local, _is_region_replicated=lambda _region: False,
        _has_mamba=False, _expand_remote_packed_rows=NixlBaseConnectorWorker._expand_remote_packed_rows)


def _vllm_paired_blocks(worker: SimpleNamespace, m: SimpleNamespace) -> list[int]:
    """Blocks per remote region in the list vLLM's full handshake prepares, from its own
    pairing (`_pair_regions`, then `_select_remote_regions`) on a copy of the metadata."""
    m = SimpleNamespace(**{k: (list(v) if isinstance(v, list) else v) for k, v in vars(m).items()})
    pairs = NixlBaseConnectorWorker._pair_regions(worker, m)
    NixlBaseConnectorWorker._select_remote_regions(m, pairs.remote_regions)
    return list(m.region_num_blocks)


PAIRING_CASES = {
    # name: (local regions by layer, local PP size, peer's regions: members and blocks)
    "pp1_one_region_per_layer": ({"l0": [0], "l1": [1]}, 1, [["l0"], ["l1"]], [24, 24]),
    "pp1_k_and_v_apart": ({"l0": [0, 1], "l1": [2, 3]}, 1, [["l0"], ["l0"], ["l1"], ["l1"]],
                          [10, 10, 20, 20]),
    "pp_stage_holds_the_second_layer": ({"l1": [0]}, 2, [["l0"], ["l1"]], [24, 30]),
    "pp_stage_holds_two_of_four": ({"l2": [0], "l3": [1]}, 2, [["l0"], ["l1"], ["l2"], ["l3"]],
                                   [5, 6, 7, 8]),
    "region_shared_by_layers": ({"l0": [0], "l1": [0]}, 1, [["l0", "l1"]], [40]),
}


@pytest.mark.parametrize("case", PAIRING_CASES, ids=str)
def test_paired_regions_match_vllm_034(case):
    if not hasattr(NixlBaseConnectorWorker, "_pair_regions"):
        pytest.skip(f"vLLM {installed_version()} maps regions by index")
    local, pp_size, members, blocks = PAIRING_CASES[case]
    m = meta(kv_caches_base_addr=[1000 * (i + 1) for i in range(len(blocks))], block_lens=[64] * len(blocks),
             block_strides=[64] * len(blocks), region_num_blocks=blocks, region_members=members,
             region_group_ids=[0] * len(blocks), region_names=[n[0] for n in members])
    layout = LocalLayout(block_size=32, num_descs=0, paired_layers=tuple(local))
    assert remote_region_blocks(m, layout) == _vllm_paired_blocks(_pairing_worker(local, pp_size=pp_size), m)


def test_packed_remote_row_expanded_per_layer_matches_vllm_034():
    """vLLM 0.34: a peer's packed row (every layer's page in one region) read by a worker
    that registers one region per layer becomes one region per layer, then pairs; a
    region outside the row (an indexer) pairs as it is. On a PP stage only its layers."""
    if not hasattr(NixlBaseConnectorWorker, "_expand_remote_packed_rows"):
        pytest.skip(f"vLLM {installed_version()} does not expand packed rows")
    packed = {"l0": (0, 64), "l1": (64, 64), "l2": (128, 64)}
    m = meta(kv_caches_base_addr=[1000, 9000], block_lens=[256, 64], block_strides=[256, 64],
             region_num_blocks=[40, 7], region_group_ids=[0, 0], region_names=["l0", "indexer"],
             region_members=[["l0", "l1", "l2"], ["indexer"]], packed_member_layouts=packed)
    for local, pp_size, want in (({"l0": [0], "l1": [1], "l2": [2], "indexer": [3]}, 1, [40, 40, 40, 7]),
                                 ({"l1": [0], "l2": [1]}, 2, [40, 40])):
        layout = LocalLayout(block_size=32, num_descs=0, paired_layers=tuple(local), splits_packed_rows=True)
        ours = remote_region_blocks(m, layout)
        assert ours == _vllm_paired_blocks(_pairing_worker(local, pp_size=pp_size), m) == want
    # A worker that packs its rows alike reads the peer's row whole (vLLM does not expand it).
    same = LocalLayout(block_size=32, num_descs=0, paired_layers=("l0", "l1", "l2", "indexer"))
    local = {"l0": [0], "l1": [0], "l2": [0], "indexer": [1]}
    assert remote_region_blocks(m, same) == _vllm_paired_blocks(
        _pairing_worker(local, packed=packed), m) == [40, 7]


# Error texts copied from vLLM 0.33.0's and 0.34.0's base_worker.py and push_worker.py (formatted as raised).
VLLM_033_ERRORS = [
    (RuntimeError, "Packed KV block rows differ between P and D. Use the same "
                   "VLLM_KV_CACHE_LAYOUT and block size on both sides.", ErrorType.CONFIG_MISMATCH),
    (NotImplementedError, "Reading multi-group packed KV rows into per-layer regions is not "
                          "supported; use the same KV cache layout on P and D.", ErrorType.CONFIG_MISMATCH),
    (RuntimeError, "Head-sharded draft KV under an MLA target needs the same block-contiguous "
                   "kv_cache_layout (e.g. LBHNC) on prefill and decode, got local=LBHNC, remote=HND.",
     ErrorType.CONFIG_MISMATCH),
    (RuntimeError, "NIXL KV-head re-sharding is not supported for NVFP4 KV cache (local TP 2, "
                   "remote TP 1). Use matching TP sizes on prefill and decode.", ErrorType.CONFIG_MISMATCH),
    (AssertionError, "Number of KV layers must match between prefill and decode",
     ErrorType.CONFIG_MISMATCH),
    (RuntimeError, "Heterogeneous TP head-dimension splitting requires contiguous heads. Use a "
                   "block-contiguous layout (e.g. LBHNC) on the prefill side.", ErrorType.CONFIG_MISMATCH),
    (RuntimeError, "NIXL compatibility hash mismatch. Local: abc, Remote: def. Prefill and decode "
                   "instances have incompatible configurations.", ErrorType.COMPAT_HASH_MISMATCH),
    (RuntimeError, "Failed to decode NixlHandshakePayload. This likely indicates an incompatibility "
                   "between connector version.", ErrorType.DECODE_ERROR),
    (RuntimeError, "Failed to decode NixlAgentMetadata. Error: boom", ErrorType.DECODE_ERROR),
    (RuntimeError, "NIXL is not available", ErrorType.NIXL_ERROR),
    (RuntimeError, "Heterogeneous TP expects same kv_cache_layout (local HND, remote NHD). Or enable "
                   "experimental feature to receive LBHNC into HND.", ErrorType.CONFIG_MISMATCH),
    (RuntimeError, "Hybrid MLA+Mamba NIXL transfers require matching DCP sizes, got local=1, remote=2.",
     ErrorType.CONFIG_MISMATCH),
]
# New in 0.34: the region pairing (`_pair_regions`) and push's equal block sizes.
VLLM_034_ERRORS = [
    (RuntimeError, "Engine prefill-a advertised KV region metadata of different lengths.",
     ErrorType.CONFIG_MISMATCH),
    (RuntimeError, "Engine prefill-a did not advertise the layers of its KV regions.",
     ErrorType.CONFIG_MISMATCH),
    (RuntimeError, "Engine prefill-a holds KV layer 'model.layers.3.self_attn', which has no "
                   "counterpart here.", ErrorType.CONFIG_MISMATCH),
    (RuntimeError, "Engine prefill-a does not hold the KV layers ['model.layers.1.self_attn'].",
     ErrorType.CONFIG_MISMATCH),
    (RuntimeError, "The TP ranks of engine prefill-a lay out their KV regions differently.",
     ErrorType.CONFIG_MISMATCH),
    (NotImplementedError, "NixlPushConnector requires identical P/D block sizes. Kernel block size and "
                          "kernel blocks per logical block: local (32, 1), remote engine prefill-a (64, 1).",
     ErrorType.CONFIG_MISMATCH),
]


@pytest.mark.parametrize(("cls", "text", "expected"), VLLM_033_ERRORS + VLLM_034_ERRORS,
                         ids=lambda v: str(v)[:40])
def test_vllm_error_texts_get_their_class(cls, text, expected):
    assert classify_error(cls(text)) is expected


def test_error_texts_are_vllm_033s_own():
    """The texts above are vLLM's, not made up (checked against the installed 0.33 source)."""
    if not ON_033:
        pytest.skip("the texts are vLLM 0.33.0's; the 0.33 lane checks them")
    flat = " ".join(VLLM_SOURCE.split()).replace('" "', "").replace('" f"', "")
    for fragment in ("Packed KV block rows differ between P and D",
                     "packed KV rows into per-layer regions is not",
                     "on prefill and", "Use matching TP sizes on prefill and decode.",
                     "Number of KV layers must match between prefill and decode",
                     "Failed to decode NixlHandshakePayload", "NIXL is not available"):
        assert fragment in flat, fragment


def test_error_texts_are_vllm_034s_own():
    """The 0.34 texts above are vLLM's (checked against the installed 0.34 source)."""
    if not ON_034:
        pytest.skip("the texts are vLLM 0.34.0's; the 0.34 lane checks them")
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import push_worker

    flat = " ".join((VLLM_SOURCE + inspect.getsource(push_worker)).split()).replace('" "', "").replace(
        '" f"', "").replace('"f"', "")
    for fragment in ("advertised KV region metadata of different", "did not advertise the layers of its KV",
                     "which has no counterpart here.", "does not hold the KV layers",
                     "lay out their KV regions differently.", "NixlPushConnector requires identical P/D",
                     "Heterogeneous TP expects same kv_cache_layout",
                     "transfers require matching DCP sizes"):
        assert fragment in flat, fragment

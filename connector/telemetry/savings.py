"""What a full handshake would have prepared for a peer, from the peer's metadata.

Used to report what a notification-only handshake saved. It mirrors the counting
(not the building) of vLLM's full `add_remote_agent`: one remote descriptor list per
remote rank holding one descriptor per block of every remote region *as the full path
would lay the regions out*, plus, the first time a smaller remote block size is seen,
one local list at that block size.

The full path first maps the peer's regions onto this worker's. vLLM 0.34 pairs them
through the layers both sides hold (`_pair_regions`): a peer's packed row (one region
holding several layers' pages) read by a worker that does not pack becomes one region
per layer first (`_expand_remote_packed_rows`); then every remote region holding a
layer of this worker is kept (all of them at PP = 1, a PP stage's layers otherwise),
in the peer's order. vLLM 0.32 and 0.33 map by region index instead:
- layer-name routing (HMA/packed layouts under PP): one remote region per local
  transfer layer, picked by layer name;
- a packed remote row read by a worker with one region per layer (0.33): the row
  becomes one region per local region;
- a PP layer slice of a PP=1 peer: only this stage's window of regions.
`shape_aware_saving` adds what the per-rank count misses in the shapes people deploy
(heterogeneous TP, PP producers, different block sizes); Mamba/SSM descriptors are
not counted (see README).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from connector.vocabulary import NoSaving


@dataclass(frozen=True)
class Saving:
    registrations: int
    descriptors: int
    # Why nothing was saved where a full handshake would prepare nothing (NoSaving value).
    none_because: str = ""


@dataclass(frozen=True)
class LocalLayout:
    """What the full path needs to know about this worker to lay out a peer's regions."""

    block_size: int
    num_descs: int
    # Local transfer layer names when vLLM routes remote regions by layer name.
    routed_layer_names: tuple[str, ...] = ()
    # Local region names, and whether the installed vLLM splits a peer's packed row
    # onto them (0.33+) while this worker itself does not pack rows.
    region_names: tuple[str, ...] = ()
    splits_packed_rows: bool = False
    # (first region, number of regions) of this PP stage, when PP > 1 (0.32, 0.33).
    pp_window: tuple[int, int] | None = None
    # The layers this worker holds, when the installed vLLM pairs a peer's regions by
    # the layers both sides hold (0.34+); empty: it maps them by region index.
    paired_layers: tuple[str, ...] = ()

    @classmethod
    def of_worker(cls, worker: Any) -> LocalLayout:
        """Read the layout from a live vLLM NIXL worker (attributes differ by release)."""
        if hasattr(type(worker), "_pair_regions"):  # vLLM 0.34+
            return cls(
                block_size=int(worker.block_size),
                num_descs=int(worker.num_descs),
                region_names=tuple(getattr(worker, "region_names", ()) or ()),
                splits_packed_rows=not getattr(worker, "_packed_member_layouts", None),
                paired_layers=tuple(worker._regions_by_layer),
            )
        routed = getattr(worker, "_transfer_layer_region_indices", None) or ()
        pp_size = int(getattr(worker, "pp_size", 1) or 1)
        return cls(
            block_size=int(worker.block_size),
            num_descs=int(worker.num_descs),
            routed_layer_names=tuple(getattr(worker, "_transfer_layer_names", ()) or ()) if routed else (),
            region_names=tuple(getattr(worker, "region_names", ()) or ()),
            splits_packed_rows=(hasattr(type(worker), "_split_remote_packed_rows")
                                and not getattr(worker, "_packed_member_layouts", None)),
            pp_window=((int(worker._remote_region_offset), len(worker.block_len_per_layer))
                       if pp_size > 1 else None),
        )


def remote_region_blocks(meta: Any, layout: LocalLayout | None = None) -> list[int]:
    """Blocks per remote region after the full path's region mapping (see module doc)."""
    n_regions = len(meta.kv_caches_base_addr)
    per_region = list(getattr(meta, "region_num_blocks", None) or [meta.num_blocks] * n_regions)
    if layout is None:
        return per_region
    if layout.paired_layers:
        return _paired_region_blocks(meta, per_region, layout)
    if layout.routed_layer_names:
        by_layer = {name: i for i, names in enumerate(meta.region_members or ())
                    for name in names}
        return [per_region[by_layer[name]] for name in layout.routed_layer_names]
    packed = getattr(meta, "packed_member_layouts", None) or {}
    if packed and layout.splits_packed_rows:
        index = {name: i for i, name in enumerate(meta.region_names or ())}
        (row,) = [i for name, i in index.items() if name in packed]
        return [per_region[row] if name in packed else per_region[index[name]]
                for name in layout.region_names]
    if layout.pp_window is not None:
        offset, count = layout.pp_window
        if n_regions > count:
            return per_region[offset:offset + count]
    return per_region


def _paired_region_blocks(meta: Any, per_region: list[int], layout: LocalLayout) -> list[int]:
    """vLLM 0.34+: blocks of the remote regions that pair with this worker's layers."""
    members = [list(names) for names in (getattr(meta, "region_members", None) or ())]
    packed = getattr(meta, "packed_member_layouts", None) or {}
    if packed and layout.splits_packed_rows:
        rows: list[tuple[int, list[str]]] = []
        for blocks, names in zip(per_region, members):
            in_row = [name for name in names if name in packed]
            rows.extend([(blocks, [name]) for name in in_row] if in_row else [(blocks, names)])
        per_region, members = [b for b, _ in rows], [names for _, names in rows]
    held = set(layout.paired_layers)
    return [blocks for blocks, names in zip(per_region, members) if held.intersection(names)]


def remote_descriptor_count(meta: Any, layout: LocalLayout | None = None) -> int:
    """Descriptors in the remote list a full handshake prepares for one remote rank
    (`meta`, a decoded `NixlAgentMetadata`, as laid out for this worker's `layout`)."""
    return int(sum(remote_region_blocks(meta, layout)))


# --- Shape-aware counting (heterogeneous TP, PP producers, block sizes) -------------
# Each rule below was checked against the NIXL calls a stock full D->P handshake made
# in the same shape (tests/test_shapes.py).


@dataclass
class LocalListLedger:
    """Local lists a worker's full handshakes would have prepared so far.

    vLLM prepares them once per worker (not per handshake or remote rank): the
    block-size list once per smaller remote block size, the TP-split lists once
    per (tp_ratio, remote block size). A notification-only worker never prepares
    them, so we remember what a full one would already have.
    """

    block_sizes: set[int] = field(default_factory=set)
    tp_splits: set[tuple[int, int]] = field(default_factory=set)


def why_no_full_handshake(remote_block_size: int, local_block_size: int,
                          remote_pp_size: int) -> NoSaving | None:
    """Why vLLM's full `add_remote_agent` would prepare nothing against this peer.

    A PP producer: each PP rank advertises only its layer slice, and vLLM never
    handshakes a PP producer fully. A local block size that is not a multiple of
    the remote one: `TransferTopology.block_size_ratio` asserts before any list is
    prepared (vLLM 0.32/0.33; 0.34 refuses a handshake between different block
    sizes before this is asked). Nothing is saved where nothing would have been prepared.
    """
    if remote_pp_size > 1:
        return NoSaving.PP_PRODUCER
    if remote_block_size <= 0 or local_block_size % remote_block_size:
        return NoSaving.BLOCK_SIZE_MISMATCH
    return None


def shape_aware_saving(meta: Any, layout: LocalLayout, *, local_tp_size: int, remote_tp_size: int,
                       remote_pp_size: int, registered_block_sizes: set[int],
                       registered_tp_splits: set[tuple[int, int]], ledger: LocalListLedger,
                       splits_local: bool = True) -> Saving:
    """What a full handshake to this remote rank would add, given the deployment shape.

    The remote list as the full path lays out the peer's regions (`layout`), plus the
    block-size local list and, when the peer has more TP ranks
    (`remote_tp_size / local_tp_size` source ranks per local rank), one local list per
    source rank, each over every local descriptor (at the remote block granularity).
    Updates `ledger` so each local list counts once per worker.
    """
    remote_block_size = int(meta.block_size)
    reason = why_no_full_handshake(remote_block_size, layout.block_size, remote_pp_size)
    if reason is not None:
        return Saving(0, 0, reason.value)
    regs, descs = 1, remote_descriptor_count(meta, layout=layout)
    ratio = layout.block_size // remote_block_size
    if ratio > 1 and remote_block_size not in registered_block_sizes | ledger.block_sizes:
        ledger.block_sizes.add(remote_block_size)
        regs += 1
        descs += layout.num_descs * ratio
    if splits_local and remote_tp_size > local_tp_size:
        sources = remote_tp_size // local_tp_size
        key = (-sources, remote_block_size)
        if key not in registered_tp_splits | ledger.tp_splits:
            ledger.tp_splits.add(key)
            regs += sources
            descs += sources * layout.num_descs * ratio
    return Saving(regs, descs)

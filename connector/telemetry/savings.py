"""What a full handshake would have prepared for a peer, from the peer's metadata.

Used to report what a notification-only handshake saved. It mirrors the counting
(not the building) of vLLM's full `add_remote_agent`: one remote descriptor list per
remote rank holding one descriptor per block of every remote region, plus, the first
time a smaller remote block size is seen, one local list at that block size.
`shape_aware_saving` adds what the simple count misses in the shapes people deploy
(heterogeneous TP, PP producers, different block sizes); Mamba/SSM descriptors are
not counted (see README).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Saving:
    registrations: int
    descriptors: int


def remote_descriptor_count(meta: Any, local_regions: int | None = None,
                            local_region_offset: int = 0) -> int:
    """Descriptors in the remote list a full handshake prepares for one remote rank.

    `meta` is a decoded `NixlAgentMetadata`. With `local_regions` set (a PP layer
    slice), only that window of the peer's regions is registered.
    """
    n_regions = len(meta.kv_caches_base_addr)
    per_region = list(meta.region_num_blocks or [meta.num_blocks] * n_regions)
    if local_regions is not None and n_regions > local_regions:
        per_region = per_region[local_region_offset:local_region_offset + local_regions]
    return int(sum(per_region))


def full_handshake_saving(meta: Any, *, local_block_size: int, local_num_descs: int,
                          registered_block_sizes: set[int], local_regions: int | None = None,
                          local_region_offset: int = 0) -> Saving:
    """Registrations/descriptors a full handshake to this remote rank would add."""
    regs = 1
    descs = remote_descriptor_count(meta, local_regions, local_region_offset)
    remote_block_size = int(meta.block_size)
    if remote_block_size < local_block_size and remote_block_size not in registered_block_sizes:
        ratio = local_block_size // remote_block_size
        regs += 1
        descs += local_num_descs * ratio
    return Saving(regs, descs)


# --- Shape-aware counting (heterogeneous TP, PP producers, block sizes) -------------
# Kept apart from the functions above: each rule below was checked against the NIXL
# calls a stock full D->P handshake made in the same shape (tests/test_shapes.py).


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


def full_handshake_possible(remote_block_size: int, local_block_size: int, remote_pp_size: int) -> bool:
    """Whether vLLM's full `add_remote_agent` can succeed against this peer.

    It cannot when the local block size is not a multiple of the remote one
    (`TransferTopology.block_size_ratio` asserts before any list is prepared),
    nor for a PP producer (each PP rank advertises only its layer slice, and vLLM
    never handshakes a PP producer fully). Nothing is saved where nothing would
    have been prepared.
    """
    return remote_pp_size <= 1 and remote_block_size > 0 and local_block_size % remote_block_size == 0


def shape_aware_saving(meta: Any, *, local_block_size: int, local_num_descs: int, local_tp_size: int,
                       remote_tp_size: int, remote_pp_size: int, registered_block_sizes: set[int],
                       registered_tp_splits: set[tuple[int, int]], ledger: LocalListLedger,
                       splits_local: bool = True, local_regions: int | None = None,
                       local_region_offset: int = 0) -> Saving:
    """What a full handshake to this remote rank would add, given the deployment shape.

    On top of the remote list: the block-size local list and, when the peer has
    more TP ranks (`remote_tp_size / local_tp_size` source ranks per local rank),
    one local list per source rank, each over every local descriptor (at the
    remote block granularity). Updates `ledger` so each local list counts once.
    """
    remote_block_size = int(meta.block_size)
    if not full_handshake_possible(remote_block_size, local_block_size, remote_pp_size):
        return Saving(0, 0)
    regs, descs = 1, remote_descriptor_count(meta, local_regions, local_region_offset)
    ratio = local_block_size // remote_block_size
    if ratio > 1 and remote_block_size not in registered_block_sizes | ledger.block_sizes:
        ledger.block_sizes.add(remote_block_size)
        regs += 1
        descs += local_num_descs * ratio
    if splits_local and remote_tp_size > local_tp_size:
        sources = remote_tp_size // local_tp_size
        key = (-sources, remote_block_size)
        if key not in registered_tp_splits | ledger.tp_splits:
            ledger.tp_splits.add(key)
            regs += sources
            descs += sources * local_num_descs * ratio
    return Saving(regs, descs)

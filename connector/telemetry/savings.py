"""What a full handshake would have prepared for a peer, from the peer's metadata.

Used to report what a notification-only handshake saved. It mirrors the counting
(not the building) of vLLM's full `add_remote_agent`: one remote descriptor list per
remote rank holding one descriptor per block of every remote region, plus, the first
time a smaller remote block size is seen, one local list at that block size.
Not counted: the TP-split local lists a D with fewer TP ranks than P would prepare
once, and Mamba/SSM descriptors (see README).
"""

from __future__ import annotations

from dataclasses import dataclass
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

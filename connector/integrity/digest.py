"""A digest of a push's KV content, computed where the KV lives (issue: KV integrity).

What it covers: for each layer, the K/V values of a run of blocks (the WRITE's blocks,
in the order the request uses them) and the heads this rank holds, named by their
global head index. Addresses, descriptor ids and block ids do not enter it, so P and D
compute the same digest over the same KV even when their block ids, block sizes, TP
split or descriptor layout differ.

How: each value's bits (the dtype's own width, widened to int64) are multiplied by an
odd weight drawn from (layer, global head, channel), and summed per token; the
per-token sums are multiplied by an odd weight of the token's position in the run
(block position x block size + slot) and summed. Everything wraps modulo 2^64. Being
a sum over heads, the digest of a head range is the sum of the digests of its parts:
D adds up what each P rank sent for its heads. It is a handful of torch kernels on
the cache's own device (CPU here, CUDA in production), with one small read back to the
host per layer set: the KV itself never leaves the device.

What it catches (docs/reliability.md gives the odds): any single-bit flip (an odd
weight times a power of two is never 0 modulo 2^64); a block holding another request's
KV or stale KV (the digest then differs unless a 64-bit sum collides); two blocks
swapped or shifted within the run (their position weights differ); two values swapped
within a block (their slot/channel weights differ).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import torch

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
# Integer views of each float width: the bits are digested, not the values.
_BITS_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _signed(x: int) -> int:
    """A 64-bit pattern as torch's int64 holds it."""
    x &= _MASK64
    return x - (1 << 64) if x >> 63 else x


def _shr(x: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 patterns (torch's >> is arithmetic)."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def _mix(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser on int64 tensors (wrapping arithmetic)."""
    x = (x ^ _shr(x, 30)) * _signed(0xBF58476D1CE4E5B9)
    x = (x ^ _shr(x, 27)) * _signed(0x94D049BB133111EB)
    return x ^ _shr(x, 31)


@lru_cache(maxsize=256)
def _value_weights(layer: int, head0: int, heads: int, channels: int, device: str) -> torch.Tensor:
    """Odd weights [heads, 1, channels] for global heads head0..head0+heads."""
    h = torch.arange(head0, head0 + heads, dtype=torch.int64, device=device).view(-1, 1, 1)
    c = torch.arange(channels, dtype=torch.int64, device=device).view(1, 1, -1)
    key = (h * channels + c) + _signed((layer + 1) * _GOLDEN)
    return _mix(key) | 1


@lru_cache(maxsize=64)
def _position_weights(count: int, device: str) -> torch.Tensor:
    """Odd weights for a token's position in the run (a swap or a shift shows)."""
    pos = torch.arange(count, dtype=torch.int64, device=device) + _signed(0x632BE59BD9B4E019)
    return _mix(pos) | 1


def _as_bits(values: torch.Tensor) -> torch.Tensor:
    view = _BITS_VIEW.get(values.element_size())
    if view is None:
        raise ValueError(f"no integer view for {values.dtype}")
    return values.contiguous().view(view).to(torch.int64)


# Bound on the int64 working copy of one chunk of blocks (the rest of the layer waits):
# the digest adds at most this much device memory, whatever the prompt's length.
CHUNK_BYTES = 32 << 20


def layer_digest(cache: torch.Tensor, block_ids: list[int], *, layer: int, head0: int,
                 chunk_bytes: int = CHUNK_BYTES) -> torch.Tensor:
    """The digest (a 0-d int64 tensor, on the cache's device) of one layer's cache
    `[blocks, local heads, block size, channels]` over `block_ids`, in that order;
    `head0` is the global index of the cache's first head. Where K and V are separate
    tensors, each is its own entry (a layer index of its own). The blocks are taken a
    chunk at a time, so its working memory stays under `chunk_bytes`."""
    if cache.dim() != 4:
        raise ValueError(f"expected a [blocks, heads, block size, channels] view, got {tuple(cache.shape)}")
    _, heads, slots, channels = cache.shape
    device = str(cache.device)
    weights = _value_weights(layer, head0, heads, channels, device)
    positions = _position_weights(len(block_ids) * slots, device)
    per_chunk = max(1, chunk_bytes // (heads * slots * channels * 8))
    ids = torch.as_tensor(block_ids, dtype=torch.int64, device=cache.device)
    total = torch.zeros((), dtype=torch.int64, device=cache.device)
    for start in range(0, len(block_ids), per_chunk):
        bits = _as_bits(cache.index_select(0, ids[start:start + per_chunk]))  # [n, heads, slots, channels]
        per_token = bits.mul_(weights).sum(dim=(1, 3)).reshape(-1)  # [n * slots], wraps modulo 2^64
        total += (per_token * positions[start * slots:start * slots + per_token.numel()]).sum()
    return total


@dataclass(frozen=True)
class Digest:
    """What a WRITE carried, per layer: the digests in layer order, as unsigned ints."""

    layers: tuple[int, ...]
    values: tuple[int, ...]

    def differing_layers(self, other: Digest) -> list[int]:
        """The layers whose digests differ (all of them when the layer sets differ)."""
        if self.layers != other.layers:
            return list(self.layers)
        return [layer for layer, a, b in zip(self.layers, self.values, other.values, strict=True) if a != b]


def digest(caches: list[tuple[int, Any]], block_ids: list[int], *, head0: int) -> Digest:
    """The digest of `block_ids` in every `(global layer index, cache view)` given, read
    back to the host once for all layers."""
    if not block_ids or not caches:
        return Digest((), ())
    stacked = torch.stack([layer_digest(cache, block_ids, layer=layer, head0=head0)
                           for layer, cache in caches])
    values = tuple(int(v) & _MASK64 for v in stacked.cpu().tolist())
    return Digest(tuple(layer for layer, _ in caches), values)

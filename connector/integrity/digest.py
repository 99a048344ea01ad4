"""A digest of a push's KV content, computed where the KV lives (issue: KV integrity).

What it covers: for each layer, the K/V values of a run of blocks (the WRITE's blocks,
in the order the request uses them) and the heads this rank holds, named by their
global head index. Addresses, descriptor ids and block ids do not enter it, so P and D
compute the same digest over the same KV even when their block ids, block sizes, TP
split or descriptor layout differ.

How (digest version 2): a token's row of one head (its K and V content, whatever the
dtype) is read as 32-bit lanes (two bf16/fp16 values, one fp32, four fp8 per lane).
Each lane is multiplied by an odd 32-bit weight drawn from (layer, global head, lane)
and the products are summed per row, modulo 2^32. Each row sum (0..2^32-1) is summed
over the heads into a token sum, multiplied by an odd 64-bit weight of the token's
position in the run (block position x block size + slot) and summed, modulo 2^64.
Being a sum over heads, the digest of a head range is the sum of the digests of its
parts: D adds up what each P rank sent for its heads.

Speed: the blocks are gathered a chunk at a time into a buffer that stays in the
core's cache (allocated once per thread and device), and the weighting and the row sums
run over that chunk in place, in the KV's own width: each KV byte is read from memory
once, and no wider working copy of the KV exists (`python -m benchmarks kv-verify`).
On CUDA it runs on a stream of its own and the host waits for that stream alone
(`digest`); on the CPU the same code runs on the calling thread.

What it catches (docs/reliability.md gives the odds): any single-bit flip (an odd
weight times a power of two is never 0 modulo 2^32, and a row sum's change times an odd
64-bit weight is never 0 modulo 2^64); a block holding another request's KV or stale
KV, and two values swapped within a row (the digest then differs unless a row sum
collides, 2^-32 for one row, and the position-weighted sum too); two blocks swapped or
shifted within the run (their position weights differ).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import torch

# The definition above; a PUSH_REG asks for this version and a digest names it
# (connector/glue/integrity.py: what each side does with another version).
DIGEST_VERSION = 2

_MASK32 = (1 << 32) - 1
_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_POSITION_SEED = 0x632BE59BD9B4E019
_LANE_BYTES = 4


def _signed(x: int, bits: int = 64) -> int:
    """An unsigned pattern as torch's signed integers of that width hold it."""
    x &= (1 << bits) - 1
    return x - (1 << bits) if x >> (bits - 1) else x


def _shr(x: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 patterns (torch's >> is arithmetic)."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def _mix(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser on int64 tensors (wrapping arithmetic)."""
    x = (x ^ _shr(x, 30)) * _signed(0xBF58476D1CE4E5B9)
    x = (x ^ _shr(x, 27)) * _signed(0x94D049BB133111EB)
    return x ^ _shr(x, 31)


@lru_cache(maxsize=512)
def _lane_weights(layer: int, head0: int, heads: int, lanes: int, device: torch.device) -> torch.Tensor:
    """Odd 32-bit weights [heads, 1, lanes] (int32) for global heads head0..head0+heads."""
    h = torch.arange(head0, head0 + heads, dtype=torch.int64).view(-1, 1, 1)
    c = torch.arange(lanes, dtype=torch.int64).view(1, 1, -1)
    key = (h * lanes + c) + _signed((layer + 1) * _GOLDEN)
    low = (_mix(key) | 1) & _MASK32  # 0..2^32-1 in int64
    return torch.where(low >= 1 << 31, low - (1 << 32), low).to(torch.int32).to(device)


def _position_weights(count: int, device: torch.device) -> torch.Tensor:
    """Odd 64-bit weights for a token's position in the run (a swap or a shift shows)."""
    return _position_table(max(1024, 1 << (count - 1).bit_length()), device)[:count]


@lru_cache(maxsize=16)
def _position_table(capacity: int, device: torch.device) -> torch.Tensor:
    """The weights of positions 0..capacity-1 (a power of two: a few tables serve every
    request length)."""
    pos = torch.arange(capacity, dtype=torch.int64) + _signed(_POSITION_SEED)
    return (_mix(pos) | 1).to(device)


# The gather buffer's size: the chunk of blocks weighted and summed in place. Small
# enough to stay in a core's L2 cache between the gather and the sums; large enough that
# the per-chunk calls are a small share of the time.
CHUNK_BYTES = 2 << 20
# Per thread (P's push writer and D's main thread digest at once), per device: the gather
# buffer and, on CUDA, the digest's stream.
_per_thread = threading.local()


def _mine(kind: str) -> dict[torch.device, Any]:
    """This thread's `kind` objects by device."""
    table = getattr(_per_thread, kind, None)
    if table is None:
        table = {}
        setattr(_per_thread, kind, table)
    return table


def _buffer(device: torch.device, nbytes: int) -> torch.Tensor:
    """This thread's gather buffer on `device` (allocated once, grown when a block is
    larger than the chunk)."""
    buffers = _mine("buffers")
    buf = buffers.get(device)
    if buf is None or buf.numel() < nbytes:
        buf = buffers[device] = torch.empty(max(nbytes, CHUNK_BYTES), dtype=torch.uint8, device=device)
    return buf


def _check_view(cache: torch.Tensor) -> None:
    if cache.dim() != 4:
        raise ValueError(f"expected a [blocks, heads, block size, channels] view, got {tuple(cache.shape)}")
    if cache.shape[3] * cache.element_size() % _LANE_BYTES:
        raise ValueError(f"a head's row of {cache.shape[3] * cache.element_size()} bytes is not a whole "
                         "number of 32-bit lanes")


def _row_sums(cache: torch.Tensor, ids: torch.Tensor, layer: int, head0: int, chunk_bytes: int,
              out: torch.Tensor) -> None:
    """Fill `out` [blocks, heads, slots] (int32) with each row's weighted lane sum, mod 2^32."""
    _, heads, slots, content = cache.shape
    row_bytes = content * cache.element_size()
    weights = _lane_weights(layer, head0, heads, row_bytes // _LANE_BYTES, cache.device)
    block_bytes = heads * slots * row_bytes
    per_chunk = max(1, chunk_bytes // block_bytes)
    buf = _buffer(cache.device, min(per_chunk, ids.numel()) * block_bytes)
    for start in range(0, ids.numel(), per_chunk):
        chunk = ids[start:start + per_chunk]
        n = chunk.numel()
        gathered = buf[:n * block_bytes].view(cache.dtype).view(n, heads, slots, content)
        torch.index_select(cache, 0, chunk, out=gathered)
        lanes = gathered.view(torch.int32)  # [n, heads, slots, lanes]: the KV's own bytes
        torch.sum(lanes.mul_(weights), -1, dtype=torch.int32, out=out[start:start + n])


def _fold(rows: torch.Tensor) -> torch.Tensor:
    """Row sums [..., blocks, heads, slots] -> digests [...]: the unsigned row sums added
    per token (exact), times the position weights, summed modulo 2^64. The row sums are
    1/lanes of the KV: this part is small."""
    per_token = rows.to(torch.int64).bitwise_and_(_MASK32).sum(-2).flatten(-2)  # [..., tokens]
    return per_token.mul_(_position_weights(per_token.shape[-1], rows.device)).sum(-1)


def layer_digest(cache: torch.Tensor, block_ids: list[int] | torch.Tensor, *, layer: int, head0: int,
                 chunk_bytes: int = CHUNK_BYTES) -> torch.Tensor:
    """The digest (a 0-d int64 tensor, on the cache's device) of one layer's cache
    `[blocks, local heads, block size, content]` over `block_ids`, in that order;
    `head0` is the global index of the cache's first head. Where K and V are separate
    tensors, each is its own entry (a layer index of its own)."""
    _check_view(cache)
    ids = torch.as_tensor(block_ids, dtype=torch.int64, device=cache.device)
    rows = torch.empty((ids.numel(), cache.shape[1], cache.shape[2]), dtype=torch.int32, device=cache.device)
    _row_sums(cache, ids, layer, head0, chunk_bytes, rows)
    return _fold(rows)


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


def _side_stream(device: torch.device) -> Any:
    streams = _mine("streams")
    stream = streams.get(device)
    if stream is None:
        stream = streams[device] = torch.cuda.Stream(device=device)
    return stream


def _layer_totals(caches: list[tuple[int, Any]], block_ids: list[int], head0: int) -> torch.Tensor:
    """Every layer's digest, [layers] int64. Layers of one shape (the usual case) share one
    row-sum tensor and one fold: a request's fixed cost is a few calls per layer."""
    first = caches[0][1]
    ids = torch.as_tensor(block_ids, dtype=torch.int64, device=first.device)
    if any(c.shape[1:] != first.shape[1:] or c.dtype != first.dtype for _, c in caches):
        return torch.stack([layer_digest(cache, ids, layer=layer, head0=head0) for layer, cache in caches])
    _check_view(first)
    rows = torch.empty((len(caches), ids.numel(), first.shape[1], first.shape[2]), dtype=torch.int32,
                       device=first.device)
    for i, (layer, cache) in enumerate(caches):
        _row_sums(cache, ids, layer, head0, CHUNK_BYTES, rows[i])
    return _fold(rows)


def digest(caches: list[tuple[int, Any]], block_ids: list[int], *, head0: int) -> Digest:
    """The digest of `block_ids` in every `(global layer index, cache view)` given, read
    back to the host once for all layers.

    On CUDA the kernels run on this thread's digest stream, not the engine's compute
    stream: the caller calls only once the KV is in place as the host sees it (P: the
    step that computed it has returned its output, which is what vLLM's WRITE relies on
    too; D: every P rank's completion notification came), so nothing on the compute
    stream needs to finish first. The host then waits for an event on the digest
    stream alone: never `torch.cuda.synchronize()`, never a read-back on the compute
    stream, so the engine's queued kernels run on while it waits."""
    if not block_ids or not caches:
        return Digest((), ())
    device = caches[0][1].device
    if device.type == "cuda":
        stream = _side_stream(device)
        with torch.cuda.stream(stream):
            totals = _layer_totals(caches, block_ids, head0)
            host = torch.empty(totals.shape, dtype=torch.int64, pin_memory=True)
            host.copy_(totals, non_blocking=True)
            done = torch.cuda.Event()
            done.record(stream)
        done.synchronize()
    else:
        host = _layer_totals(caches, block_ids, head0)
    values = tuple(int(v) & _MASK64 for v in host.tolist())
    return Digest(tuple(layer for layer, _ in caches), values)

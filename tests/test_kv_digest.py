"""The KV digest (connector/integrity/digest.py): equal where the KV is equal, whatever
the block ids or TP split, and different for each corruption it is meant to catch."""

from __future__ import annotations

import struct

import pytest
import torch

from connector.integrity.digest import Digest, digest, layer_digest

BLOCKS, HEADS, SLOTS, CHANNELS = 24, 4, 16, 8
MASK = (1 << 64) - 1


def _cache(seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn((BLOCKS, HEADS, SLOTS, CHANNELS), generator=gen).to(dtype)


def _one(cache: torch.Tensor, blocks: list[int], layer: int = 0, head0: int = 0) -> int:
    return int(layer_digest(cache, blocks, layer=layer, head0=head0)) & MASK


# ------------------------------------------------------------ a reference in plain ints
def _mix(x: int) -> int:
    x &= MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK
    return x ^ (x >> 31)


def _reference(cache: torch.Tensor, blocks: list[int], layer: int, head0: int) -> int:
    """The digest's definition (its module docstring), written out with Python integers
    (no torch arithmetic: the wrap-around of 32-bit products and row sums and of the
    64-bit total is what it checks). A row's bytes are read as little-endian 32-bit
    lanes, whatever the dtype."""
    _, heads, slots, _ = cache.shape
    total = 0
    for pos, block in enumerate(blocks):
        for s in range(slots):
            per_token = 0
            for h in range(heads):
                raw = cache[block, h, s].contiguous().view(torch.uint8).numpy().tobytes()
                lanes = struct.unpack(f"<{len(raw) // 4}I", raw)
                row = 0
                for lane, bits in enumerate(lanes):
                    key = (head0 + h) * len(lanes) + lane + (layer + 1) * 0x9E3779B97F4A7C15
                    row += bits * ((_mix(key) | 1) & 0xFFFFFFFF)
                per_token += row & 0xFFFFFFFF
            total += per_token * (_mix(pos * slots + s + 0x632BE59BD9B4E019) | 1)
    return total & MASK


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_digest_is_its_definition_modulo_2_64(dtype: torch.dtype) -> None:
    cache = _cache(1, dtype)[:, :2, :4, :6].contiguous()
    assert _one(cache, [5, 2, 7], layer=3, head0=6) == _reference(cache, [5, 2, 7], 3, 6)


def test_chunks_of_any_size_give_the_same_digest() -> None:
    """The gather buffer's size is no part of the definition."""
    cache = _cache(16, torch.bfloat16)
    blocks = [9, 3, 14, 0, 21, 5, 6]
    whole = _one(cache, blocks)
    block_bytes = HEADS * SLOTS * CHANNELS * 2
    for per_chunk in (1, 2, 3, 7):
        assert int(layer_digest(cache, blocks, layer=0, head0=0,
                                chunk_bytes=per_chunk * block_bytes)) & MASK == whole


# ------------------------------------------------------------------------ equal
def test_the_same_kv_in_other_blocks_gives_the_same_digest() -> None:
    p = _cache(2)
    d = torch.zeros_like(p)
    p_blocks, d_blocks = [3, 9, 4, 20], [11, 0, 17, 5]
    d[d_blocks] = p[p_blocks]
    assert _one(p, p_blocks) == _one(d, d_blocks)


def test_each_decode_rank_matches_the_prefill_slice_of_its_heads() -> None:
    """P TP1 holds all 4 heads; D TP2's rank r holds heads 2r and 2r+1. P's digest of
    the heads it writes to rank r equals rank r's digest of its whole cache."""
    p = _cache(3)
    blocks = [1, 2, 3]
    for rank in range(2):
        d_rank = p[:, 2 * rank:2 * rank + 2].clone()
        p_slice = p[:, 2 * rank:2 * rank + 2]
        assert _one(p_slice, blocks, head0=2 * rank) == _one(d_rank, blocks, head0=2 * rank)
    # (the head index is global: the same values as another head range differ)
    assert _one(p[:, 0:2], blocks, head0=0) != _one(p[:, 0:2], blocks, head0=2)


def test_the_digest_does_not_depend_on_the_block_size() -> None:
    """P with blocks of 16 tokens, D with blocks of 8 (or kernel blocks smaller than
    the logical ones): the same tokens give the same digest."""
    p = _cache(8)
    p_blocks = [4, 1, 6]
    tokens = p[p_blocks].permute(1, 0, 2, 3).reshape(HEADS, -1, CHANNELS)  # [H, 48, C]
    d = tokens.reshape(HEADS, 6, SLOTS // 2, CHANNELS).permute(1, 0, 2, 3).contiguous()
    assert _one(p, p_blocks) == _one(d, list(range(6)))


def test_the_digest_of_a_head_range_is_the_sum_of_its_parts() -> None:
    """P TP2 -> D TP1: D adds up the two P ranks' digests of their heads."""
    p = _cache(9)
    blocks = [2, 7, 3]
    whole = _one(p, blocks)
    parts = _one(p[:, :1], blocks, head0=0) + _one(p[:, 1:], blocks, head0=1)
    assert whole == parts & MASK


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_every_cache_dtype_digests_its_bits(dtype: torch.dtype) -> None:
    cache = _cache(4, dtype)
    copy = cache.clone()
    assert _one(cache, [0, 1]) == _one(copy, [0, 1])
    copy.view(torch.int16 if dtype != torch.float32 else torch.int32)[1, 0, 0, 0] ^= 1
    assert _one(cache, [0, 1]) != _one(copy, [0, 1])


# ------------------------------------------------------------------- corruptions
def test_every_single_bit_flip_is_caught() -> None:
    cache = _cache(5)
    blocks = [2, 6, 8]
    base = _one(cache, blocks)
    bits = cache.view(torch.int32)
    for block in blocks:
        for h, s, c in [(0, 0, 0), (3, 15, 7), (1, 7, 2)]:
            for bit in range(32):
                bits[block, h, s, c] ^= (1 << bit) if bit < 31 else -(1 << 31)
                assert _one(cache, blocks) != base, (block, h, s, c, bit)
                bits[block, h, s, c] ^= (1 << bit) if bit < 31 else -(1 << 31)
    assert _one(cache, blocks) == base


def test_a_block_of_another_request_is_caught() -> None:
    cache, other = _cache(6), _cache(7)
    blocks = [1, 2, 3]
    base = _one(cache, blocks)
    cache[2] = other[2]
    assert _one(cache, blocks) != base


def test_a_stale_block_is_caught() -> None:
    cache = _cache(8)
    blocks = [4, 5]
    stale = cache[5].clone()
    cache[5] = torch.randn_like(cache[5])  # the request's real KV
    fresh = _one(cache, blocks)
    cache[5] = stale  # what an earlier request left there
    assert _one(cache, blocks) != fresh


def test_swapped_and_shifted_blocks_are_caught() -> None:
    cache = _cache(9)
    blocks = [10, 11, 12, 13]
    base = _one(cache, blocks)
    assert _one(cache, [11, 10, 12, 13]) != base  # two swapped
    assert _one(cache, [13, 10, 11, 12]) != base  # shifted by one
    # the same blocks' content moved, not the list: the same as a swap
    swapped = cache.clone()
    swapped[[10, 11]] = cache[[11, 10]]
    assert _one(swapped, blocks) != base


def test_two_values_swapped_within_a_block_are_caught() -> None:
    cache = _cache(10)
    base = _one(cache, [3])
    a, b = cache[3, 0, 0, 0].clone(), cache[3, 2, 5, 1].clone()
    cache[3, 0, 0, 0], cache[3, 2, 5, 1] = b, a
    assert _one(cache, [3]) != base


# ------------------------------------------------------------------- several layers
def test_the_differing_layer_is_named() -> None:
    layers = [(0, _cache(11)), (1, _cache(12)), (2, _cache(13))]
    sent = digest(layers, [0, 1, 2], head0=0)
    layers[1][1][1, 0, 0, 0] += 1.0
    landed = digest(layers, [0, 1, 2], head0=0)
    assert sent.layers == (0, 1, 2)
    assert sent.differing_layers(landed) == [1]
    assert sent.differing_layers(sent) == []


def test_the_same_values_in_another_layer_differ() -> None:
    cache = _cache(14)
    assert _one(cache, [0, 1], layer=0) != _one(cache, [0, 1], layer=1)


def test_nothing_to_digest_is_an_empty_digest_and_a_bad_view_an_error() -> None:
    assert digest([], [1], head0=0) == Digest((), ())
    assert digest([(0, _cache(15))], [], head0=0) == Digest((), ())
    with pytest.raises(ValueError, match="blocks, heads, block size, channels"):
        layer_digest(torch.zeros(4, 4), [0], layer=0, head0=0)
    with pytest.raises(ValueError, match="32-bit lanes"):
        layer_digest(torch.zeros(4, 2, 16, 3, dtype=torch.bfloat16), [0], layer=0, head0=0)

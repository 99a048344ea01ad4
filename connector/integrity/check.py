"""What P digests for one WRITE, and D's verdict: pure functions over KV views.

A layer's KV cache, as vLLM registers it with the connector, is a logical
`[blocks, heads, block size, content]` view (vLLM's KV cache layout, whatever the
physical order); K and V share the content dimension. `layer_views` keeps those it can
digest by global layer index (PP stages hold different layers); anything else (MLA,
state-space layers, another rank order) makes the shape unsupported, and the receive
is counted `skipped` rather than checked wrongly.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from connector.integrity.digest import DIGEST_VERSION, Digest, digest
from connector.integrity.wire import KvDigestNotif
from connector.vocabulary import KvVerifyOutcome, KvVerifySkip

_MASK64 = (1 << 64) - 1
_LAYER_INDEX = re.compile(r"\.(\d+)\.")


def layer_index(layer_name: str) -> int | None:
    """The global layer index in a vLLM layer name (`model.layers.7.self_attn.attn`)."""
    found = _LAYER_INDEX.findall(f".{layer_name}.")
    return int(found[-1]) if len(found) == 1 else None


def layer_views(kv_caches: dict[str, Any]) -> dict[int, Any] | None:
    """Global layer index -> its `[blocks, heads, block size, content]` view, or None
    when some layer cannot be digested (see the module docstring)."""
    views: dict[int, Any] = {}
    shape = None
    for name, cache in kv_caches.items():
        index = layer_index(name)
        if index is None or getattr(cache, "dim", lambda: 0)() != 4 or index in views:
            return None
        if shape is not None and tuple(cache.shape[1:]) != shape:
            return None
        shape = tuple(cache.shape[1:])
        views[index] = cache
    return dict(sorted(views.items())) or None


@dataclass(frozen=True)
class HeadRange:
    """Global KV heads [start, stop)."""

    start: int
    stop: int

    def __bool__(self) -> bool:
        return self.stop > self.start

    def __and__(self, other: HeadRange) -> HeadRange:
        return HeadRange(max(self.start, other.start), min(self.stop, other.stop))


def heads_of(rank: int, local_heads: int) -> HeadRange:
    return HeadRange(rank * local_heads, (rank + 1) * local_heads)


def write_digest(views: dict[int, Any], block_ids: list[int], own: HeadRange,
                 carried: HeadRange) -> Digest:
    """P: the digest of the heads `carried` (within this rank's `own`) over `block_ids`."""
    lo, hi = carried.start - own.start, carried.stop - own.start
    return digest([(layer, view[:, lo:hi]) for layer, view in views.items()], block_ids,
                  head0=carried.start)


# Skips that mean a digest was lost, not that the prefill sends none: not checkable.
_LOST = (KvVerifySkip.MISSING, KvVerifySkip.INCOMPLETE)


@dataclass(frozen=True)
class Verdict:
    outcome: KvVerifyOutcome
    skipped_because: KvVerifySkip | None = None
    layers: tuple[int, ...] = ()  # the layers whose digests differed

    @property
    def fails(self) -> bool:
        """Whether `kv_verify_action=fail` fails the receive: a mismatch, or a digest lost
        (the KV could not be checked and might be wrong)."""
        return self.outcome is KvVerifyOutcome.MISMATCH or self.skipped_because in _LOST


def verdict(own: Digest, received: Iterable[KvDigestNotif], *, prefill_sends: bool = False) -> Verdict:
    """D: its own digest against the sum of what each P rank sent for its heads.
    `prefill_sends`: the prefill has sent digests before (none now: one was lost)."""
    received = list(received)
    if not received:
        return Verdict(KvVerifyOutcome.SKIPPED,
                       KvVerifySkip.MISSING if prefill_sends else KvVerifySkip.STOCK_PREFILL)
    for notif in received:
        if notif.skip:
            try:
                why = KvVerifySkip(notif.skip)
            except ValueError:
                why = KvVerifySkip.SHAPE
            return Verdict(KvVerifyOutcome.SKIPPED, why)
    if any(notif.version != DIGEST_VERSION for notif in received):
        return Verdict(KvVerifyOutcome.SKIPPED, KvVerifySkip.VERSION)  # (another definition)
    sums: dict[int, int] = {}
    parts: dict[int, int] = {}
    wanted: dict[int, int] = {}
    for notif in received:
        for layer, value in zip(notif.layers, notif.values, strict=True):
            sums[layer] = (sums.get(layer, 0) + value) & _MASK64
            parts[layer] = parts.get(layer, 0) + 1
            wanted[layer] = notif.writers
    if set(sums) != set(own.layers) or parts != wanted:
        return Verdict(KvVerifyOutcome.SKIPPED, KvVerifySkip.INCOMPLETE)
    differing = tuple(layer for layer, value in zip(own.layers, own.values, strict=True)
                      if sums[layer] != value)
    return Verdict(KvVerifyOutcome.MISMATCH if differing else KvVerifyOutcome.MATCH, layers=differing)

"""A model runner without a model, for engines a real vLLM scheduler drives.

Each step it does what vLLM's GPU model runner does around the KV connector, in
vLLM's order: bind the step's connector metadata, run "the model", start the step's
KV loads, collect the transfer results and stats. Its model computes nothing: it
writes into each scheduled token's KV slot a value that only that request's prompt
and that token's position give (and the layer, head and channel), and samples a token
the same way. So a decode engine can check, byte for byte, that the KV a prefill
pushed into its blocks is its request's: any block that holds another request's KV,
stale KV, or nothing, shows.

D checks a request's KV twice: when it is first scheduled with KV it did not compute
(pushed), and when it finishes (a late WRITE into its blocks shows there), for every
position it did not compute itself and, at the end, every position.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from connector.glue.wire import prompt_digest

OFFSET_SEED = 20261203


@dataclass
class _Req:
    prompt: list[int]
    digest: str
    max_tokens: int
    blocks: list[int]
    computed: int  # tokens whose KV is in the blocks
    values: np.ndarray  # one value per position (prompt + outputs)
    pushed_upto: int = 0  # positions whose KV came from the prefill (not computed here)
    outputs: int = 0


@dataclass
class Check:
    """One byte check of a request's KV: how many positions, and which were wrong."""

    req_id: str
    when: str  # "landed" | "finished"
    positions: int
    wrong_positions: list[int] = field(default_factory=list)  # the first few
    wrong: int = 0  # how many positions were wrong
    unwritten: int = 0  # of those, how many still hold what no one wrote (the initial fill)

    @property
    def ok(self) -> bool:
        return not self.wrong_positions


def token_of(digest: str, position: int) -> int:
    """The token 'the model' samples at `position` of a request with this prompt."""
    return zlib.crc32(f"{digest}:{position}".encode()) % 256


class ModelRunner:
    """One rank's fake model over its real KV caches (`caches`: layer name -> tensor
    [blocks, local heads, block size, 2 * head dim])."""

    def __init__(self, caches: dict[str, Any], *, block_size: int, total_heads: int, tp_rank: int,
                 layer_offset: int, role: str, initial_fill: float = 7.0):
        self.caches = caches
        self.initial_fill = initial_fill
        self.layers = sorted(caches)
        self.block_size = block_size
        first = next(iter(caches.values()))
        self.local_heads = int(first.shape[1])
        self.channels = int(first.shape[3])
        self.head0 = tp_rank * self.local_heads
        self.role = role
        rng = np.random.default_rng(OFFSET_SEED)
        offsets = rng.standard_normal((layer_offset + len(self.layers), total_heads, self.channels))
        # This rank's slice: [layer, local head, channel].
        self.offsets = offsets[layer_offset:, self.head0:self.head0 + self.local_heads].astype(np.float32)
        self.reqs: dict[str, _Req] = {}
        self.checks: list[Check] = []

    # ------------------------------------------------------------------ steps
    def before(self, so: Any) -> None:
        """Requests that finished in the last step: check them before their blocks
        are written again, then forget them."""
        for req_id in getattr(so, "finished_req_ids", ()) or ():
            req = self.reqs.pop(req_id, None)
            if req is not None and self.role == "kv_consumer":
                self._check(req_id, req, "finished", req.computed)

    def run(self, so: Any) -> dict[str, list[int]]:
        """The step's 'forward': write each scheduled token's KV, sample tokens."""
        for new in so.scheduled_new_reqs:
            prompt = list(new.prompt_token_ids or ())
            digest = prompt_digest(prompt) or ""
            params = new.sampling_params
            max_tokens = int(getattr(params, "max_tokens", 1) or 1)
            req = _Req(prompt, digest, max_tokens, list(new.block_ids[0]), new.num_computed_tokens,
                       _values(digest, len(prompt) + max_tokens + 1))
            self.reqs[new.req_id] = req
            if self.role == "kv_consumer" and req.computed > 0:
                req.pushed_upto = req.computed
                self._check(new.req_id, req, "landed", req.computed)
        cached = so.scheduled_cached_reqs
        resumed = getattr(cached, "resumed_req_ids", set()) or set()
        for i, req_id in enumerate(cached.req_ids):
            req = self.reqs.get(req_id)
            if req is None:
                continue
            new_blocks = cached.new_block_ids[i]
            if req_id in resumed:  # preempted and rescheduled: recomputed from here
                req.blocks = list(new_blocks[0]) if new_blocks else []
                req.pushed_upto = 0
            elif new_blocks:
                req.blocks.extend(new_blocks[0])
            req.computed = cached.num_computed_tokens[i]
        sampled: dict[str, list[int]] = {}
        for req_id, n in so.num_scheduled_tokens.items():
            req = self.reqs.get(req_id)
            if req is None or n <= 0:
                continue
            self._write(req, req.computed, req.computed + n)
            req.computed += n
            if req.computed >= len(req.prompt):
                sampled[req_id] = [token_of(req.digest, req.computed)]
                req.outputs += 1
        return sampled

    # ------------------------------------------------------------- KV bytes
    def _slot_values(self, req: _Req, start: int, end: int) -> np.ndarray:
        """[layer, local head, position, channel] for positions [start, end)."""
        tok = req.values[start:end]
        return tok[None, None, :, None] + self.offsets[:, :, None, :]

    def _write(self, req: _Req, start: int, end: int) -> None:
        values = self._slot_values(req, start, end)
        for pos0 in range(start - start % self.block_size, end, self.block_size):
            b = pos0 // self.block_size
            if b >= len(req.blocks):
                break
            lo, hi = max(start, pos0), min(end, pos0 + self.block_size)
            block = req.blocks[b]
            chunk = values[:, :, lo - start:hi - start]
            for li, name in enumerate(self.layers):
                self.caches[name][block, :, lo - pos0:hi - pos0].copy_(
                    _torch_of(self.caches[name], chunk[li]))

    def _check(self, req_id: str, req: _Req, when: str, upto: int) -> None:
        if upto <= 0 or not req.blocks:
            return
        wrong: set[int] = set()
        unwritten: set[int] = set()
        expected = self._slot_values(req, 0, upto)
        for b in range((upto + self.block_size - 1) // self.block_size):
            if b >= len(req.blocks):
                wrong.update(range(b * self.block_size, upto))
                break
            lo, hi = b * self.block_size, min(upto, (b + 1) * self.block_size)
            for li, name in enumerate(self.layers):
                have = self.caches[name][req.blocks[b], :, :hi - lo].numpy()
                bad = np.nonzero(~(have == expected[li, :, lo:hi]).all(axis=(0, 2)))[0]
                wrong.update(int(lo + x) for x in bad)
                blank = np.nonzero((have == self.initial_fill).all(axis=(0, 2)))[0]
                unwritten.update(int(lo + x) for x in blank)
        self.checks.append(Check(req_id, when, upto, sorted(wrong)[:16], len(wrong),
                                 len(wrong & unwritten)))

    def take_checks(self) -> list[Check]:
        out, self.checks = self.checks, []
        return out


def _values(digest: str, n: int) -> np.ndarray:
    seed = int(digest[:15], 16) if digest else 0
    return np.random.default_rng(seed).standard_normal(n).astype(np.float32)


def _torch_of(like: Any, array: np.ndarray) -> Any:
    import torch

    return torch.from_numpy(np.ascontiguousarray(array)).to(like.dtype)

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
from collections.abc import Collection
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
    req_id: str = ""


@dataclass
class Check:
    """One byte check of a request's KV: how many positions, and which were wrong."""

    req_id: str
    when: str  # "landed" | "finished"
    positions: int
    wrong_positions: list[int] = field(default_factory=list)  # the first few
    wrong: int = 0  # how many positions were wrong
    unwritten: int = 0  # of those, how many still hold what no one wrote (the initial fill)
    reused: int = 0  # positions in blocks a receive of the same step took over (not checked)
    reused_changed: int = 0  # of those, how many already held something else
    # For a wrong check: who last wrote each wrong block (request ids), and what this rank's
    # model saw of the request and of them (a failing seed's first lead).
    writers: list[str] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)  # the wrong blocks
    detail: str = ""

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
        # What explains a wrong block: each block's last write (request, step, positions) and
        # each request's block tables as this rank's model saw them, step by step.
        self.steps = 0
        self.last_write: dict[int, tuple[str, str, int, int, int]] = {}  # (request, how, step, lo, hi)
        self.seen: dict[str, list[str]] = {}
        self.values_of: dict[str, np.ndarray] = {}  # every request's pattern, by id (whose KV is this?)

    # ------------------------------------------------------------------ steps
    def before(self, so: Any) -> None:
        """Requests that finished in the last step: check them before their blocks
        are written again, then forget them.

        Except the blocks this very step hands to KV receives: the scheduler freed them
        when those requests finished, and the prefill may write them as soon as any D
        rank has sent its PUSH_REG. With D TP > 1 that can be another rank's process,
        before this one runs: such a block is the new receive's already, and what it
        holds is not counted against the finished request (`Check.reused`)."""
        meta = getattr(so, "kv_connector_metadata", None)
        receiving = {b for m in (getattr(meta, "reqs_to_recv", None) or {}).values()
                     for b in (m.local_block_ids[0] if m.local_block_ids else ())}
        for req_id in getattr(so, "finished_req_ids", ()) or ():
            req = self.reqs.pop(req_id, None)
            self._saw(req_id, "finished")
            if req is not None and self.role == "kv_consumer":
                self._check(req_id, req, "finished", req.computed, receiving)

    def run(self, so: Any) -> dict[str, list[int]]:
        """The step's 'forward': write each scheduled token's KV, sample tokens."""
        self.steps += 1
        for new in so.scheduled_new_reqs:
            prompt = list(new.prompt_token_ids or ())
            digest = prompt_digest(prompt) or ""
            params = new.sampling_params
            max_tokens = int(getattr(params, "max_tokens", 1) or 1)
            req = _Req(prompt, digest, max_tokens, list(new.block_ids[0]), new.num_computed_tokens,
                       _values(digest, len(prompt) + max_tokens + 1))
            req.req_id = new.req_id
            self.values_of[new.req_id] = req.values
            self.reqs[new.req_id] = req
            self._saw(new.req_id, f"new {req.blocks} computed {req.computed}")
            if self.role == "kv_consumer" and req.computed > 0:
                for b, block in enumerate(req.blocks[:-(-req.computed // self.block_size)]):
                    self.last_write[block] = (new.req_id, "pushed", self.steps, b * self.block_size,
                                              min(req.computed, (b + 1) * self.block_size))
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
                self._saw(req_id, f"resumed {req.blocks}")
            elif new_blocks:
                req.blocks.extend(new_blocks[0])
                if new_blocks[0]:
                    self._saw(req_id, f"+{list(new_blocks[0])}")
            if cached.num_computed_tokens[i] != req.computed:
                self._saw(req_id, f"computed {req.computed} -> {cached.num_computed_tokens[i]}")
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
            self.last_write[block] = (req.req_id, "computed", self.steps, lo, hi)
            chunk = values[:, :, lo - start:hi - start]
            for li, name in enumerate(self.layers):
                self.caches[name][block, :, lo - pos0:hi - pos0].copy_(
                    _torch_of(self.caches[name], chunk[li]))

    def _check(self, req_id: str, req: _Req, when: str, upto: int,
               reused: Collection[int] = ()) -> None:
        if upto <= 0 or not req.blocks:
            return
        wrong: set[int] = set()
        unwritten: set[int] = set()
        changed_reused: set[int] = set()  # positions in `reused` blocks that changed
        reused_positions = 0
        expected = self._slot_values(req, 0, upto)
        for b in range((upto + self.block_size - 1) // self.block_size):
            if b >= len(req.blocks):
                wrong.update(range(b * self.block_size, upto))
                break
            lo, hi = b * self.block_size, min(upto, (b + 1) * self.block_size)
            taken = req.blocks[b] in reused
            if taken:
                reused_positions += hi - lo
            for li, name in enumerate(self.layers):
                have = self.caches[name][req.blocks[b], :, :hi - lo].numpy()
                bad = np.nonzero(~(have == expected[li, :, lo:hi]).all(axis=(0, 2)))[0]
                if taken:
                    changed_reused.update(int(lo + x) for x in bad)
                    continue
                wrong.update(int(lo + x) for x in bad)
                blank = np.nonzero((have == self.initial_fill).all(axis=(0, 2)))[0]
                unwritten.update(int(lo + x) for x in blank)
        check = Check(req_id, when, upto - reused_positions, sorted(wrong)[:16], len(wrong),
                      len(wrong & unwritten), reused=reused_positions, reused_changed=len(changed_reused))
        if wrong:
            self._explain(check, req_id, req, sorted(wrong))
        self.checks.append(check)

    def _saw(self, req_id: str, what: str) -> None:
        self.seen.setdefault(req_id, []).append(f"{self.steps}: {what}")

    def _explain(self, check: Check, req_id: str, req: _Req, wrong: list[int]) -> None:
        lines = [f"rank head {self.head0}, step {self.steps}; {req_id} as this model saw it: "
                 + "; ".join(self.seen.get(req_id, [])[-8:])]
        for b in sorted({p // self.block_size for p in wrong})[:3]:
            block = req.blocks[b] if b < len(req.blocks) else None
            if block is not None:
                check.blocks.append(block)
            last = self.last_write.get(block) if block is not None else None
            if last is None:
                lines.append(f"  block #{b} ({block}): no write recorded")
                continue
            writer, how, step, lo, hi = last
            check.writers.append(writer)
            lines.append(f"  block #{b} ({block}): last written ({how}) at step {step} by {writer}, "
                         f"positions {lo}-{hi}; " + "; ".join(self.seen.get(writer, [])[-8:]))
        lines.append("  whose KV the wrong positions hold: " + self._owners(req, wrong[:4]))
        check.detail = "\n".join(lines)

    def _owners(self, req: _Req, positions: list[int]) -> str:
        """Which request's pattern, at which position, each of `positions` of `req` holds
        (looked up by the value of its first layer, head and channel)."""
        name = self.layers[0]
        out = []
        for p in positions:
            block = req.blocks[p // self.block_size] if p // self.block_size < len(req.blocks) else None
            if block is None:
                out.append(f"{p}: no block")
                continue
            have = float(self.caches[name][block, 0, p % self.block_size, 0])
            if have == self.initial_fill:
                out.append(f"{p} (block {block}): never written")
                continue
            token = np.float32(have - self.offsets[0, 0, 0])
            hits = [f"{rid}@{int(i)}" for rid, values in self.values_of.items()
                    for i in np.nonzero(np.isclose(values, token, rtol=0, atol=1e-5))[0]]
            out.append(f"{p} (block {block}): {', '.join(hits[:3]) or 'no known request'}")
        return "; ".join(out)

    def take_checks(self) -> list[Check]:
        out, self.checks = self.checks, []
        return out


def _values(digest: str, n: int) -> np.ndarray:
    seed = int(digest[:15], 16) if digest else 0
    return np.random.default_rng(seed).standard_normal(n).astype(np.float32)


def _torch_of(like: Any, array: np.ndarray) -> Any:
    import torch

    return torch.from_numpy(np.ascontiguousarray(array)).to(like.dtype)

"""The campaign's byte checker (harness/model.py) on its own: what it counts as wrong.

A finished request is checked at the start of the next step. Blocks that step hands to
a KV receive may already hold the new receive's KV (with D TP > 1 another rank's
PUSH_REG can bring the prefill's WRITE before this rank runs): they are not counted
against the finished request; every other block still is.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from harness.model import ModelRunner

BLOCK = 4


def _runner() -> ModelRunner:
    caches = {f"layer.{i}": torch.full((8, 1, BLOCK, 2), 7.0) for i in range(2)}
    return ModelRunner(caches, block_size=BLOCK, total_heads=1, tp_rank=0, layer_offset=0,
                       role="kv_consumer")


def _new(req_id: str, prompt: list[int], blocks: list[int]) -> SimpleNamespace:
    return SimpleNamespace(req_id=req_id, prompt_token_ids=prompt, block_ids=(blocks,),
                           num_computed_tokens=0, sampling_params=SimpleNamespace(max_tokens=1))


def _step(new: list[SimpleNamespace], scheduled: dict[str, int], finished: set[str] = frozenset(),
          receiving: dict[str, list[int]] | None = None) -> SimpleNamespace:
    recv = {r: SimpleNamespace(local_block_ids=(b,)) for r, b in (receiving or {}).items()}
    return SimpleNamespace(
        scheduled_new_reqs=new, finished_req_ids=set(finished),
        scheduled_cached_reqs=SimpleNamespace(req_ids=[], resumed_req_ids=set(), new_block_ids=[],
                                              num_computed_tokens=[]),
        num_scheduled_tokens=scheduled, kv_connector_metadata=SimpleNamespace(reqs_to_recv=recv))


def _finished_with_block_overwritten(receiving: dict[str, list[int]]) -> ModelRunner:
    """Request A computes 8 positions into blocks 2 and 5; then block 5 is overwritten
    (as the prefill's WRITE for another request would), and A's finish is checked."""
    model = _runner()
    model.run(_step([_new("A", list(range(8)), [2, 5])], {"A": 8}))
    for cache in model.caches.values():
        cache[5].copy_(torch.from_numpy(np.full((1, BLOCK, 2), 0.5, dtype=np.float32)))
    model.before(_step([], {}, finished={"A"}, receiving=receiving))
    return model


def test_a_block_overwritten_while_its_request_held_it_is_wrong():
    [check] = _finished_with_block_overwritten(receiving={}).take_checks()
    assert (check.when, check.wrong, check.positions, check.reused) == ("finished", 4, 8, 0)
    assert check.wrong_positions == [4, 5, 6, 7] and not check.ok


def test_a_block_a_receive_of_the_same_step_took_over_is_not_counted():
    [check] = _finished_with_block_overwritten(receiving={"B": [5, 6]}).take_checks()
    assert check.ok and check.positions == 4  # block 2 still checked
    assert (check.reused, check.reused_changed) == (4, 4)


@pytest.mark.parametrize("taken", [[2], [6, 7]])
def test_only_the_blocks_taken_are_skipped(taken):
    [check] = _finished_with_block_overwritten(receiving={"B": taken}).take_checks()
    assert not check.ok and check.wrong_positions == [4, 5, 6, 7]

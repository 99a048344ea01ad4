"""The fault campaign in CI: a short fixed set of seeds, every KV byte checked.

`make chaos` runs the long one (python -m harness.campaign); docs/reliability.md has its
figures. Here: seed 9 (TP 2 on the decode side, a quarter of the landed KV corrupted,
and partitions, slow WRITEs, stalls on and around the lease deadline, lost and repeated
notifications, reused ids, client aborts and KV pressure as the seed draws them); a
deliberate defect on seed 5 (TP 2 on the prefill side), with the KV check off (the
campaign must fail: it can) and on (no wrong byte); the cases a seed cannot be relied
on to draw: a request aborted while it waits for its KV on an engine with nothing else
to do, KV corrupted on one decode rank only (the whole request recomputed, no rank left
waiting), and, below ratio 1, every corrupted receive caught after the first mismatch
(the escalation rules on vLLM's real scheduler).
"""

from __future__ import annotations

import random
import secrets
from collections import Counter
from pathlib import Path

import pytest

from connector.vocabulary import StatKey
from harness.campaign.plan import EXTRA_CONFIG, HOLD_S, UNMATCHED_S, Plan, RequestPlan, make_plan
from harness.campaign.run import run_seed
from harness.cluster import rank_context
from harness.config import EngineSpec
from harness.core import EngineCore, make_request
from harness.poll import wait_until
from harness.runner import free_port

pytestmark = [pytest.mark.real, pytest.mark.timeout(900)]

# P TP 1 / D TP 2 (harness.campaign.plan draws it); P TP 2 / D TP 1 runs as seed 5 in the two
# deliberate-defect runs below, which hold every other rule of the campaign too.
SEEDS = (9,)
REQUESTS = 80
# Seed 9 corrupts a quarter of the KV that lands on D (flipped bits, another block's
# content, swapped blocks): with the KV check on (the default), each must be caught.
CORRUPTING_SEED, CORRUPT_SHARE = 9, 0.25
DEFECT_REQUESTS = 100  # the deliberate defect's seed (5): enough for it to strike many times


def _defect_plan() -> Plan:
    """Seed 5 without corrupted KV: whatever goes wrong is the defect's doing."""
    plan = make_plan(5, DEFECT_REQUESTS)
    plan.corrupt = 0.0
    return plan


@pytest.mark.parametrize("seed", SEEDS)
def test_every_request_lands_intact_or_fails_counted_and_nothing_leaks(seed: int, tmp_path: Path) -> None:
    plan = make_plan(seed, REQUESTS)
    if seed == CORRUPTING_SEED:
        plan.corrupt = CORRUPT_SHARE
    result = run_seed(plan, tmp_path)
    assert result.violations == [], result.as_dict()
    o = result.outcomes
    assert o["kv_landed"] > 0 and o["recomputed"] > 0  # both endings happened
    assert sum(o.values()) == REQUESTS  # every request accounted for
    assert result.checked_positions > 1000
    assert result.counters["kv_verify"].get("match", 0) > 0
    if seed == CORRUPTING_SEED:  # (each corrupted receive failed: run_seed's violations say so)
        assert result.faults_injected["D"]["corrupted"] > 0, result.faults_injected


def test_the_campaign_fails_on_a_lease_released_under_its_write_without_the_kv_check(tmp_path: Path) -> None:
    """The defect upstream has (the reaper frees blocks a WRITE still reads), with the KV
    check off: the same seed ends with wrong bytes on the decoder (the control for the
    test below)."""
    result = run_seed(_defect_plan(), tmp_path, mutant="release_claimed", verify_ratio=0.0)
    assert any(v.startswith("wrong KV bytes") for v in result.violations), result.as_dict()


def test_the_kv_check_turns_that_defect_into_recomputes_with_no_wrong_byte(tmp_path: Path) -> None:
    """The same defect with every receive checked (the default): each WRITE that carried
    what P's blocks held after their release is a mismatch, failed and recomputed; no
    request decodes from wrong KV."""
    result = run_seed(_defect_plan(), tmp_path, mutant="release_claimed")
    assert result.violations == [], result.as_dict()
    assert result.counters["kv_verify"].get("mismatch", 0) > 0, result.counters


def test_kv_corrupted_on_one_decode_rank_recomputes_the_request_and_no_rank_waits(tmp_path: Path) -> None:
    """D TP2, and only rank 1's heads corrupted after every landing: rank 1's check fails
    the receive, rank 0's matches, and vLLM's scheduler (which hears both ranks) recomputes
    the whole request; no rank is left waiting for the other (SGLang #39729 hung its TP
    ranks on exactly this), and no byte of corrupted KV is decoded from."""
    rng = random.Random(4242)
    plan = Plan(seed=4242, p_tp=1, d_tp=2, d_blocks=128, notif_faults={}, corrupt=1.0,
                corrupt_ranks=(1,))
    plan.requests = [RequestPlan(i, 2.0 + 0.25 * i, f"r1x{i}", [rng.randrange(256) for _ in range(64)],
                                 4, "P") for i in range(12)]
    result = run_seed(plan, tmp_path)
    assert result.violations == [], result.as_dict()
    assert result.faults_injected["D"]["corrupted"] == len(plan.requests)  # (rank 1 alone corrupts)
    assert result.outcomes["recomputed"] == len(plan.requests) and result.outcomes["kv_landed"] == 0, \
        result.as_dict()
    # (the counters are rank 0's view, as its /metrics shows: its heads matched every time)
    assert result.counters["kv_verify"] == {"match": len(plan.requests)}, result.counters


def test_a_request_aborted_while_it_waits_alone_gives_its_blocks_back(tmp_path: Path) -> None:
    """The client goes away while its request waits for KV that will never come (its
    prefill leg was cancelled), on a decoder with nothing else to do: vLLM keeps the
    blocks until the worker reports the receive; the decoder keeps stepping until it
    does (P answers the PUSH_REG no one claims), and the blocks come back."""
    ctx = rank_context()
    common = dict(workdir=str(tmp_path), prefix_caching=False, extra_config=dict(EXTRA_CONFIG),
                  kv_load_failure_policy="recompute")
    p = EngineCore(EngineSpec(name="P", engine_id=f"prefill-{secrets.token_hex(3)}", kv_role="kv_producer",
                              side_channel_port=free_port(), num_blocks=32, **common), ctx)
    d = EngineCore(EngineSpec(name="D", engine_id=f"decode-{secrets.token_hex(3)}", kv_role="kv_consumer",
                              side_channel_port=free_port(), num_blocks=32, **common), ctx)
    try:
        p.start()
        d.start()
        tid = secrets.token_hex(4)
        d_id = f"cmpl-{tid}-0-{secrets.token_hex(4)}"
        addr = p.address
        d.add_request(make_request(d_id, list(range(100)), 8, {
            "do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": addr["engine_id"],
            "remote_host": addr["host"], "remote_port": addr["port"], "tp_size": 1, "pp_size": 1,
            "remote_request_id": tid, "remote_block_ids": []}))  # (no prefill leg is ever sent)
        wait_until(lambda: d.query(lambda s: s.kv_cache_manager.usage) > 0, "D to allocate the blocks")
        wait_until(lambda: p.rank_call("pending_registrations")[0] == [d_id], "its PUSH_REG to reach P")
        d.abort(d_id)
        wait_until(lambda: d.query(lambda s: (len(s.requests), s.kv_cache_manager.usage)) == (0, 0.0),
                   "D to give the aborted request's blocks back", timeout_s=UNMATCHED_S + HOLD_S + 10)
        assert d_id in d.state.failed_recving and d.state.errors == [] and p.state.errors == []
    finally:
        d.stop()
        p.stop()


def _ids_drawn_from(draws: list[bool]) -> list[str]:
    """Transfer ids whose requests the ratio 0.1 draws (True) or not, in that order."""
    from connector.integrity.policy import sample_point

    out, i = [], 0
    for drawn in draws:
        while (sample_point(f"cmpl-e{i}-0-00000000") < 0.1) != drawn:
            i += 1
        out.append(f"e{i}")
        i += 1
    return out


def test_below_ratio_one_every_corrupted_receive_after_the_first_mismatch_is_caught(tmp_path: Path) -> None:
    """`kv_verify_ratio` 0.1, every landed receive corrupted: the requests the ratio does
    not draw decode unchecked until the first drawn one mismatches; from then on D's
    scheduler checks every request from that prefill (`escalated`), and each is caught."""
    ctx = rank_context()
    extra = {**EXTRA_CONFIG, "kv_verify_ratio": 0.1, "kv_verify_new_peer_requests": 0}
    common = dict(workdir=str(tmp_path), prefix_caching=False, extra_config=extra,
                  kv_load_failure_policy="recompute")
    p = EngineCore(EngineSpec(name="P", engine_id=f"prefill-{secrets.token_hex(3)}", kv_role="kv_producer",
                              side_channel_port=free_port(), num_blocks=64, **common), ctx)
    d = EngineCore(EngineSpec(name="D", engine_id=f"decode-{secrets.token_hex(3)}", kv_role="kv_consumer",
                              side_channel_port=free_port(), num_blocks=64, faults_seed=7, **common), ctx)
    # Two requests not drawn, one drawn (the first mismatch), then five not drawn.
    tids = _ids_drawn_from([False, False, True] + [False] * 5)
    rng = random.Random(7)
    try:
        p.start()
        d.start()
        d.rank_call("corrupt_landed", 1.0)
        addr = p.address
        for tid in tids:  # one at a time: each decision sees every earlier verdict
            prompt = [rng.randrange(256) for _ in range(64)]
            d_id = f"cmpl-{tid}-0-{secrets.token_hex(4)}"
            p.add_request(make_request(f"cmpl-{tid}-0-{secrets.token_hex(4)}", prompt, 1,
                                       {"do_remote_decode": True, "do_remote_prefill": False}))
            d.add_request(make_request(d_id, prompt, 2, {
                "do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": addr["engine_id"],
                "remote_host": addr["host"], "remote_port": addr["port"], "tp_size": 1, "pp_size": 1,
                "remote_request_id": tid, "remote_block_ids": []}))
            wait_until(lambda d_id=d_id: d_id in d.state.finished, f"request {tid} to finish", timeout_s=60)
        caught = [any(f"cmpl-{t}-0-" in r for r in d.state.failed_recving) for t in tids]
        assert caught == [False, False, True] + [True] * 5, caught
        assert len(d.rank_call("corrupted_ids")[0]) == len(tids)  # (every landing was corrupted)
        verdicts = Counter(v for s in d.state.stats for v in s.get(StatKey.KV_VERIFY, ()))
        assert verdicts == {"mismatch|sampled": 1, "mismatch|escalated": 5}, verdicts
        assert d.state.errors == [] and p.state.errors == []
    finally:
        d.stop()
        p.stop()

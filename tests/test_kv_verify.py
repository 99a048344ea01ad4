"""KV integrity's parts that need no engine: the policy, the digest notification at the
edge, D's verdict from the digests P's ranks sent, and the inbox's bound. The whole path
(P's digest ahead of each WRITE, D's check, a mismatch recomputed) runs in the fault
campaign, whose seeds corrupt landed KV (harness/campaign)."""

from __future__ import annotations

import msgspec
import pytest
import torch

from connector.integrity.check import heads_of, layer_index, layer_views, verdict, write_digest
from connector.integrity.digest import DIGEST_VERSION, digest
from connector.integrity.escalation import Escalation
from connector.integrity.policy import VerifyPolicy, sample_point
from connector.integrity.wire import KvDigestNotif, decode_kv_digest, encode_kv_digest
from connector.state.digests import DigestInbox
from connector.vocabulary import (
    KV_DIGEST_NOTIF_PREFIX,
    KvVerifyAction,
    KvVerifyOutcome,
    KvVerifyReason,
    KvVerifySkip,
)

MASK = (1 << 64) - 1


def _policy(**extra: object) -> VerifyPolicy:
    return VerifyPolicy.from_config(lambda key, default=None: extra.get(key, default))


# ------------------------------------------------------------------------ policy
def test_the_defaults_check_every_request_and_fail_a_mismatch() -> None:
    policy = _policy()
    assert policy.ratio == 1.0 and policy.action is KvVerifyAction.FAIL
    assert policy.sampled("cmpl-anything-0")


def test_a_ratio_samples_that_share_by_the_base_request_id() -> None:
    policy = _policy(kv_verify_ratio=0.25)
    ids = [f"cmpl-{i:06d}-abcd" for i in range(8000)]
    share = sum(map(policy.sampled, ids)) / len(ids)
    assert 0.22 < share < 0.28
    # P's and D's ids of one request differ only in vLLM's random suffix: the same decision.
    assert all(sample_point(f"cmpl-{i:06d}-0123abcd") == sample_point(f"cmpl-{i:06d}-89abef01")
               for i in range(50))
    assert not _policy(kv_verify_ratio=0).sampled("cmpl-x-0") and not _policy(kv_verify_ratio=0).enabled


@pytest.mark.parametrize("extra", [{"kv_verify_ratio": 1.5}, {"kv_verify_ratio": "often"},
                                   {"kv_verify_ratio": -0.1}, {"kv_verify_ratio": float("nan")},
                                   {"kv_verify_action": "abort"},
                                   {"kv_verify_escalate_s": -1}, {"kv_verify_escalate_s": "long"},
                                   {"kv_verify_new_peer_requests": -2},
                                   {"kv_verify_new_peer_requests": 1.5},
                                   {"kv_verify_new_peer_requests": True}])
def test_a_bad_setting_is_a_clear_error(extra: dict[str, object]) -> None:
    with pytest.raises(ValueError, match=next(iter(extra))):
        _policy(**extra)


def test_the_escalation_settings_default_to_ten_minutes_and_sixteen_requests() -> None:
    policy = _policy()
    assert policy.escalate_s == 600 and policy.new_peer_requests == 16
    assert _policy(kv_verify_escalate_s=0, kv_verify_new_peer_requests=0).new_peer_requests == 0


# -------------------------------------------------------------------- escalation
class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _escalation(clock: _Clock, **extra: object) -> Escalation:
    extra = {"kv_verify_ratio": 0.0001, "kv_verify_new_peer_requests": 0, **extra}
    return Escalation(_policy(**extra), lease_s=30, forget_after_s=600, clock=clock)


def _unsampled(n: int, ratio: float = 0.0001) -> list[str]:
    """`n` request ids the ratio does not draw (so what checks them is a rule)."""
    ids = (f"cmpl-{i:06d}-abcd" for i in range(10**6))
    return [r for r in ids if sample_point(r) >= ratio][:n]


def test_after_a_mismatch_every_request_from_that_prefill_is_checked_for_the_window() -> None:
    clock = _Clock()
    rules = _escalation(clock, kv_verify_escalate_s=600)
    ids = _unsampled(6)
    assert rules.decide(ids[0], "P1", 0.0) is None
    rules.mismatched(["P1"])
    clock.now += 599
    assert rules.decide(ids[1], "P1", 0.0) is KvVerifyReason.ESCALATED
    assert rules.decide(ids[2], "P2", 0.0) is None  # (another prefill: not escalated)
    rules.mismatched(["P1"])  # a new mismatch restarts the window
    clock.now += 599
    assert rules.decide(ids[3], "P1", 0.0) is KvVerifyReason.ESCALATED
    clock.now += 2
    assert rules.decide(ids[4], "P1", 0.0) is None


def test_the_first_requests_to_a_new_or_restarted_prefill_are_checked() -> None:
    clock = _Clock()
    rules = _escalation(clock, kv_verify_new_peer_requests=3)
    ids = iter(_unsampled(20))
    assert [rules.decide(next(ids), "P1", 0.0) for _ in range(4)] == [KvVerifyReason.NEW_PEER] * 3 + [None]
    assert rules.decide(next(ids), "P2", 0.0) is KvVerifyReason.NEW_PEER  # (its own count)
    rules.restarted(["P1"])
    assert [rules.decide(next(ids), "P1", 0.0) for _ in range(4)] == [KvVerifyReason.NEW_PEER] * 3 + [None]
    clock.now += 601  # silent past peer_forget_after_s: a new peer again
    assert rules.decide(next(ids), "P1", 0.0) is KvVerifyReason.NEW_PEER


def test_a_request_that_waited_longer_than_a_lease_is_at_risk() -> None:
    rules = _escalation(_Clock())
    first, second = _unsampled(2)
    assert rules.decide(first, "P1", 29.0) is None
    assert rules.decide(second, "P1", 31.0) is KvVerifyReason.AT_RISK


def test_at_ratio_one_every_request_is_sampled_and_at_zero_none_is_checked() -> None:
    clock = _Clock()
    every = Escalation(_policy(), lease_s=30, forget_after_s=600, clock=clock)
    every.mismatched(["P1"])
    assert {every.decide(r, "P1", 100.0) for r in _unsampled(5)} == {KvVerifyReason.SAMPLED}
    off = Escalation(_policy(kv_verify_ratio=0), lease_s=30, forget_after_s=600, clock=clock)
    off.mismatched(["P1"])
    assert {off.decide(r, "P1", 100.0) for r in _unsampled(5)} == {None}


def test_below_one_the_ratio_still_draws_its_share() -> None:
    rules = _escalation(_Clock(), kv_verify_ratio=0.25)
    ids = [f"cmpl-{i:06d}-abcd" for i in range(4000)]
    reasons = [rules.decide(r, "P1", 0.0) for r in ids]
    assert {r for r in reasons if r is not None} == {KvVerifyReason.SAMPLED}
    assert [r is not None for r in reasons] == [sample_point(r) < 0.25 for r in ids]


# ---------------------------------------------------------------- the notification
def test_a_digest_of_another_version_is_skipped_not_compared() -> None:
    cache = torch.randn(4, 2, 16, 8)
    own = digest([(0, cache)], [1, 2], head0=0)
    ours = KvDigestNotif("r", 0, list(own.layers), list(own.values), tokens=32, version=DIGEST_VERSION)
    assert verdict(own, [ours]).outcome is KvVerifyOutcome.MATCH
    # an older fork's notification carries no version (1): decoded, then not compared
    old = decode_kv_digest(KV_DIGEST_NOTIF_PREFIX + msgspec.msgpack.encode(
        {"request_id": "r", "sender": 0, "layers": [0], "values": [own.values[0]], "tokens": 32}))
    assert old.version == 1
    assert verdict(own, [old]).skipped_because is KvVerifySkip.VERSION
    # a prefill of this version answering an older decoder's ask sends a skip it names
    skip = verdict(own, [KvDigestNotif("r", 0, skip=KvVerifySkip.VERSION.value)])
    assert skip.skipped_because is KvVerifySkip.VERSION


def test_a_digest_notification_round_trips_with_64_bit_values() -> None:
    notif = KvDigestNotif("cmpl-1-0", 3, [0, 5], [MASK, 1], tokens=64, writers=2)
    assert decode_kv_digest(encode_kv_digest(notif)) == notif


@pytest.mark.parametrize("body", [b"\xc1", b"\x93\x01\x02\x03", b"x" * (64 * 1024 + 1)])
def test_a_malformed_digest_notification_is_refused_with_why(body: bytes) -> None:
    with pytest.raises(ValueError):
        decode_kv_digest(KV_DIGEST_NOTIF_PREFIX + body)


def test_a_digest_notification_with_a_value_past_64_bits_or_unpaired_layers_is_refused() -> None:
    import msgspec

    for bad in ({"request_id": "r", "sender": 0, "layers": [0], "values": [-1]},
                {"request_id": "r", "sender": 0, "layers": [0, 1], "values": [1]}):
        with pytest.raises(ValueError):
            decode_kv_digest(KV_DIGEST_NOTIF_PREFIX + msgspec.msgpack.encode(bad))


# ------------------------------------------------------------------------ verdict
def _caches(layers: int, heads: int, seed: int) -> dict[int, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {layer: torch.randn((12, heads, 8, 4), generator=gen) for layer in range(layers)}


def _notif(views: dict[int, torch.Tensor], blocks: list[int], own_rank: int, d_rank: int,
           p_tp: int, d_tp: int) -> KvDigestNotif:
    heads = next(iter(views.values())).shape[1]
    own = heads_of(own_rank, heads)
    carried = own & heads_of(d_rank, heads * p_tp // d_tp)
    d = write_digest(views, blocks, own, carried)
    return KvDigestNotif("r", own_rank, list(d.layers), list(d.values), tokens=len(blocks) * 8,
                         writers=max(1, p_tp // d_tp), version=DIGEST_VERSION)


def test_p_tp2_to_d_tp1_matches_once_both_ranks_digests_came() -> None:
    full = _caches(2, 4, 1)
    p_ranks = [{k: v[:, 2 * r:2 * r + 2].clone() for k, v in full.items()} for r in range(2)]
    blocks_p, blocks_d = [3, 1, 7], [0, 5, 9]
    d_cache = {k: torch.zeros_like(v) for k, v in full.items()}
    for k in full:
        d_cache[k][blocks_d] = full[k][blocks_p]
    own = digest(list(d_cache.items()), blocks_d, head0=0)
    sent = [_notif(p_ranks[r], blocks_p, r, 0, 2, 1) for r in range(2)]
    assert verdict(own, sent).outcome is KvVerifyOutcome.MATCH
    assert verdict(own, sent[:1]).skipped_because is KvVerifySkip.INCOMPLETE
    d_cache[1][blocks_d[2], 3, 0, 0] += 1.0  # rank 1's heads, layer 1, last block
    changed = digest(list(d_cache.items()), blocks_d, head0=0)
    result = verdict(changed, sent)
    assert result.outcome is KvVerifyOutcome.MISMATCH and result.layers == (1,)


def test_p_tp1_to_d_tp2_each_rank_checks_its_heads() -> None:
    p = _caches(3, 4, 2)
    blocks = [2, 4]
    for d_rank in range(2):
        d_views = {k: v[:, 2 * d_rank:2 * d_rank + 2].clone() for k, v in p.items()}
        own = digest(list(d_views.items()), blocks, head0=2 * d_rank)
        assert verdict(own, [_notif(p, blocks, 0, d_rank, 1, 2)]).outcome is KvVerifyOutcome.MATCH
        other = _notif(p, blocks, 0, 1 - d_rank, 1, 2)  # the other rank's digest: not this KV
        assert verdict(own, [other]).outcome is KvVerifyOutcome.MISMATCH


def test_pp_stages_each_send_their_layers() -> None:
    p = _caches(4, 2, 3)
    blocks = [1, 2, 3]
    stages = [{k: p[k] for k in (0, 1)}, {k: p[k] for k in (2, 3)}]
    own = digest(list(p.items()), blocks, head0=0)
    sent = [_notif(stage, blocks, 0, 0, 1, 1) for stage in stages]
    assert verdict(own, sent).outcome is KvVerifyOutcome.MATCH
    assert verdict(own, sent[1:]).skipped_because is KvVerifySkip.INCOMPLETE


def test_no_digest_or_a_skip_is_skipped_and_a_lost_digest_fails() -> None:
    """A stock prefill sends no digest: skipped, decoded. A prefill that sends digests
    sent none, or not from every rank: lost on the way; the KV cannot be checked, so
    `kv_verify_action=fail` fails it like a mismatch."""
    own = digest(list(_caches(1, 2, 4).items()), [0], head0=0)
    stock = verdict(own, [])
    assert stock.skipped_because is KvVerifySkip.STOCK_PREFILL and not stock.fails
    skip = verdict(own, [KvDigestNotif("r", 0, skip=KvVerifySkip.SHAPE.value)])
    assert skip.skipped_because is KvVerifySkip.SHAPE and not skip.fails
    lost = verdict(own, [], prefill_sends=True)
    assert lost.skipped_because is KvVerifySkip.MISSING and lost.fails
    half = KvDigestNotif("r", 0, list(own.layers), list(own.values), tokens=8, writers=2,
                         version=DIGEST_VERSION)
    partial = verdict(own, [half])
    assert partial.skipped_because is KvVerifySkip.INCOMPLETE and partial.fails
    whole = KvDigestNotif("r", 0, list(own.layers), list(own.values), tokens=8, version=DIGEST_VERSION)
    assert verdict(own, [whole]).outcome is KvVerifyOutcome.MATCH


def test_layer_views_take_vllm_layer_names_and_refuse_what_they_cannot_digest() -> None:
    assert layer_index("model.layers.12.self_attn.attn") == 12
    assert layer_index("lm_head") is None
    cache = torch.zeros((4, 2, 8, 4))
    views = layer_views({"model.layers.1.self_attn.attn": cache, "model.layers.0.self_attn.attn": cache})
    assert list(views) == [0, 1]
    assert layer_views({"model.layers.0.attn": torch.zeros((2, 4, 2, 8, 4))}) is None  # not [B, H, N, C]
    assert layer_views({"decoder.attn": cache}) is None


# ------------------------------------------------------------------------- inbox
def test_the_inbox_keeps_one_digest_per_sender_and_drops_the_oldest_request_past_its_bound() -> None:
    inbox = DigestInbox(capacity=2)
    inbox.put("a", 0, "first")
    inbox.put("a", 0, "again")
    inbox.put("a", 1, "rank 1")
    inbox.put("b", 0, "b")
    inbox.put("c", 0, "c")
    assert inbox.dropped == 1 and inbox.take("a") == []
    assert inbox.take("b") == ["b"] and inbox.take("b") == []
    inbox.forget(["c"])
    assert len(inbox) == 0
    inbox.put("d", 0, "x", "prefill-1")
    inbox.put("d", 1, "y", "prefill-1")
    assert sorted(inbox.take("d")) == ["x", "y"]
    assert inbox.sends_digests("prefill-1") and not inbox.sends_digests("prefill-2")
    inbox.forget_engine("prefill-1")  # (restarted: it may come back as a stock prefill)
    assert not inbox.sends_digests("prefill-1")

"""The P/D shapes people deploy, on real NIXL, fork and stock D side by side.

One run (`harness.shapes.run_matrix`): D engines of TP 1 and 2 (fork with memory
tracing, stock) stay up; P engines of each shape (TP 1/2/4, PP 2, and a block size
of 64 tokens against D's 32) start one after the other, and every D reaches each P
by heartbeat first, then receives pushes. The stock D's NIXL calls are the ground
truth for what a full D->P handshake prepares in that shape; the fork's own stats
must report exactly that as saved, per rank and in total, and so must /metrics
after aggregation across workers. Where the fork saves nothing, its handshake span
says why, by the shape.

vLLM's push mode moves no KV between different block sizes (docs/shapes.md), and a
D whose engine loop a WRITE ended would serve no later case: in the block-size case
nothing is pushed; its checks are the handshakes'. On vLLM 0.32/0.33 the fork's
notification-only handshake succeeds there and saves nothing; on 0.34 every handshake
between the two block sizes is refused by vLLM's push check (config_mismatch).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from connector.vocabulary import SPAN_HANDSHAKE, Attr, ErrorType, NoSaving, Phase
from harness.config import FORK, STOCK
from harness.frontend import frontend_for
from harness.shapes import (
    D_BLOCK_SIZE,
    MATRIX,
    CaseResult,
    push_refuses_other_block_sizes,
    run_matrix,
)

# The module's engines start once (fixture); on a loaded shared machine that alone can
# exceed the suite's default per-test timeout.
pytestmark = [pytest.mark.real, pytest.mark.shapes, pytest.mark.timeout(1800)]


def case_id(p_tp: int, p_pp: int, p_bs: int, d_tp: int) -> str:
    pp = f"pp{p_pp}" if p_pp > 1 else ""
    bs = f"bs{p_bs}" if p_bs != D_BLOCK_SIZE else ""
    return f"P{p_tp}{pp}{bs}-D{d_tp}"


CASES = [case_id(s.tp, s.pp, s.block_size, t) for s in MATRIX for t in s.d_tps]
# P's blocks larger than D's: vLLM moves no KV, nothing is pushed (module docstring).
BLOCK_SIZE_CASES = [case_id(s.tp, s.pp, s.block_size, t) for s in MATRIX for t in s.d_tps
                    if s.block_size != D_BLOCK_SIZE]
PUSHED = [c for c in CASES if c not in BLOCK_SIZE_CASES]
# vLLM 0.34+: no handshake between different block sizes succeeds.
REFUSED = BLOCK_SIZE_CASES if push_refuses_other_block_sizes() else []
CONNECTED = [c for c in CASES if c not in REFUSED]
# vLLM's reason, as 0.34's push worker words it (the test checks it reaches log and span).
PUSH_BLOCK_SIZE_REASON = "NixlPushConnector requires identical P/D block sizes"


PUSHES_PER_CASE = 2


@dataclass
class Case:
    fork: CaseResult
    stock: CaseResult
    metrics: dict[str, float]
    observed: dict[str, Any] | None


def _metrics(case: CaseResult, spec: Any) -> tuple[dict[str, float], dict[str, Any] | None]:
    """Observe the fork D's per-rank stats like vLLM (aggregate, then /metrics)."""
    fe = frontend_for(spec)
    observed = fe.observe_workers(case.stats)
    d2p = {"direction": "d_to_p"}
    hist = {**d2p, "notif_agents_only": "true", "outcome": "success"}
    return {
        "descriptors_saved": fe.sample("vllm:nixl_descriptors_saved_total", d2p),
        "registrations_saved": fe.sample("vllm:nixl_descriptor_registrations_saved_total", d2p),
        "duration_count": fe.sample("vllm:nixl_handshake_duration_seconds_count", hist),
        "duration_count_full": fe.sample("vllm:nixl_handshake_duration_seconds_count",
                                         {**hist, "notif_agents_only": "false"}),
        "heartbeat_handshakes": fe.sample("vllm:nixl_handshakes_total",
                                          {**d2p, "trigger": "heartbeat", "notif_agents_only": "true",
                                           "outcome": "success"}),
    }, observed


@pytest.fixture(scope="module")
def matrix(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Case]:
    work = str(tmp_path_factory.mktemp("shapes"))
    found: dict[str, dict[str, Any]] = {}
    for p, d, res in run_matrix(work, tracing="memory", requests=PUSHES_PER_CASE):
        key = case_id(p.spec.tp_size, p.spec.pp_size, p.spec.block_size, d.spec.tp_size)
        entry = found.setdefault(key, {})
        entry[d.spec.connector] = res
        if d.spec.connector == FORK:
            entry["metrics"], entry["observed"] = _metrics(res, d.spec)
    return {k: Case(v[FORK], v[STOCK], v["metrics"], v["observed"]) for k, v in found.items()}


def _case(matrix: dict[str, Case], cid: str) -> Case:
    assert cid in matrix, f"case {cid} did not run"
    return matrix[cid]


def _targets(res: CaseResult, d_rank: int) -> set[tuple[int, int]]:
    """(pp_rank, tp_rank) of the P ranks one D rank must handshake (vLLM's TP mapping)."""
    p_tp, d_tp, p_pp = res.shape["p_tp"], res.shape["d_tp"], res.shape["p_pp"]
    if d_tp >= p_tp:
        tps = [d_rank // (d_tp // p_tp)]
    else:
        ratio = p_tp // d_tp
        tps = [d_rank * ratio + i for i in range(ratio)]
    return set(itertools.product(range(p_pp), tps))


@pytest.mark.parametrize("cid", PUSHED)
def test_bytes_land_on_every_d_rank_from_the_right_p_ranks(matrix: dict[str, Case], cid: str) -> None:
    case = _case(matrix, cid)
    for res in (case.fork, case.stock):
        assert res.error is None, res.error
        assert res.pushed
        assert res.bytes_ok, (res.connector, res.per_d_rank, res.failed)
        for entry in res.per_d_rank:
            a, b = entry["heads"]
            per_p = res.shape["p_tp"]
            expected = sorted({h * per_p // 4 for h in range(a, b)})
            assert entry["from_p_tp_ranks"] == expected, entry


@pytest.mark.parametrize("cid", PUSHED)
def test_every_fork_d_rank_checks_the_kv_digest_of_every_push_and_it_matches(matrix: dict[str, Case],
                                                                             cid: str) -> None:
    """KV integrity in every shape: each D rank sums the digests of the P ranks that wrote
    its heads (P TP2 -> D TP1: two; P PP2: one per stage's layers) and matches its own.
    A stock D never asks: its pushes land as before (the test above)."""
    from connector.vocabulary import StatKey

    case = _case(matrix, cid)
    for rank, stats in enumerate(case.fork.stats):
        verdicts = [v for s in stats for v in s.get(StatKey.KV_VERIFY, ())]
        assert verdicts == ["match|sampled"] * PUSHES_PER_CASE, (cid, rank, verdicts)
    stock_verdicts = [v for rank in case.stock.stats for s in rank for v in s.get(StatKey.KV_VERIFY, ())]
    assert stock_verdicts == []


@pytest.mark.parametrize("cid", CONNECTED)
def test_every_d_to_p_handshake_is_notif_only_even_heartbeat_first(matrix: dict[str, Case],
                                                                    cid: str) -> None:
    fork = _case(matrix, cid).fork
    assert [len(r) for r in fork.handshakes] == [1] * fork.shape["d_tp"], fork.handshakes
    for rec in fork.d_to_p:
        assert rec["notif_only"] is True and rec["trigger"] == "heartbeat", rec
        assert rec["outcome"] == "success", rec
        assert rec["registrations"]["remote"] == 0 and rec["descriptors"]["remote"] == 0, rec
    assert not [c for rank in fork.calls for c in rank if c[0] == "prep_xfer_dlist"], fork.calls


@pytest.mark.parametrize("cid", PUSHED)
def test_p_to_d_handshakes_stay_full(matrix: dict[str, Case], cid: str) -> None:
    case = _case(matrix, cid)
    for res in (case.fork, case.stock):
        recs = [h for rank in res.p_handshakes for h in rank]
        assert recs and all(not h["notif_only"] and h["outcome"] == "success" for h in recs), recs
        assert all(h["registrations"]["remote"] >= 1 for h in recs), recs


@pytest.mark.parametrize("cid", CASES)
def test_saved_equals_what_stock_full_handshake_prepared(matrix: dict[str, Case], cid: str) -> None:
    """Per D rank and in total, counted from the stock D's NIXL calls in the same shape."""
    case = _case(matrix, cid)
    fork, stock = case.fork.summary(), case.stock.summary()
    assert fork["registrations_saved_per_rank"] == stock["d_lists_prepared_per_rank"], (fork, stock)
    assert fork["descriptors_saved_per_rank"] == stock["d_descriptors_prepared_per_rank"], (fork, stock)
    assert fork["registrations_saved"] == (stock["d_remote_lists_prepared"]
                                           + stock["d_local_lists_prepared"])
    assert fork["descriptors_saved"] == (stock["d_remote_descriptors_prepared"]
                                         + stock["d_local_descriptors_prepared"])


@pytest.mark.parametrize("cid", [c for c in PUSHED if "pp" not in c])
def test_stock_heartbeat_first_is_full_to_a_pp1_producer(matrix: dict[str, Case], cid: str) -> None:
    """The ground truth is real: stock prepared one remote list per target P rank."""
    stock = _case(matrix, cid).stock
    for d_rank, calls in enumerate(stock.calls):
        remote = [c for c in calls if c[0] == "prep_xfer_dlist" and c[1] != "NIXL_INIT_AGENT"]
        assert len(remote) == len(_targets(stock, d_rank)), calls


@pytest.mark.parametrize("cid", BLOCK_SIZE_CASES)
def test_block_size_mismatch_saves_nothing_says_why_and_stock_prepares_nothing(matrix: dict[str, Case],
                                                                              cid: str) -> None:
    """vLLM 0.32/0.33, P 64 / D 32: a full D->P handshake cannot succeed (vLLM asserts on
    the block-size ratio before preparing a list), so a notification-only one saves
    nothing, and says so."""
    if push_refuses_other_block_sizes():
        pytest.skip("vLLM 0.34+ refuses every handshake between different block sizes (next test)")
    case = _case(matrix, cid)
    fork, stock = case.fork, case.stock
    for res in (fork, stock):
        assert res.error is None, res.error
        assert not res.pushed and res.failed == []
    # Fork: connected notification-only from the heartbeat, 0 saved, and why on the span.
    assert fork.connected == [True] * fork.shape["d_tp"]
    assert [(h["notif_only"], h["outcome"]) for h in fork.d_to_p] == [(True, "success")] * fork.shape["d_tp"]
    assert fork.saved("saved_descriptors") == fork.saved("saved_registrations") == [0] * fork.shape["d_tp"]
    assert fork.failed_handshakes == 0
    top = [s for rank in fork.spans for s in rank if s["name"] == SPAN_HANDSHAKE]
    assert [s["attributes"].get(Attr.NOTHING_SAVED_BECAUSE) for s in top] == \
        [NoSaving.BLOCK_SIZE_MISMATCH.value] * fork.shape["d_tp"], top
    assert all(s["attributes"][Attr.DESCRIPTORS_SAVED] == 0 for s in top)
    # Stock: its heartbeat-first (full) handshake reached NIXL, prepared no list, failed.
    for calls in stock.calls:
        assert [c for c in calls if c[0] == "prep_xfer_dlist"] == [], calls
        assert any(c[0] == "add_remote_agent" for c in calls), calls
    assert stock.connected == [False] * stock.shape["d_tp"]
    assert stock.failed_handshakes >= stock.shape["d_tp"]


@pytest.mark.parametrize("cid", BLOCK_SIZE_CASES)
def test_block_size_mismatch_is_refused_at_the_handshake_with_vllms_reason(matrix: dict[str, Case],
                                                                          cid: str) -> None:
    """vLLM 0.34+, P 64 / D 32: push mode requires equal block sizes, checked in every
    handshake's parallel-config validation. The fork's heartbeat handshake (notification-
    only) fails as `config_mismatch` in the metadata decode, with vLLM's reason in D's log
    and on the span; it is not retried (it cannot succeed). Stock's (full) one fails the
    same check before any NIXL call; neither prepares a list, so the saving is 0 = 0."""
    if not push_refuses_other_block_sizes():
        pytest.skip("vLLM 0.32/0.33 connect notification-only between these block sizes")
    case = _case(matrix, cid)
    fork, stock = case.fork, case.stock
    d_tp = fork.shape["d_tp"]
    for res in (fork, stock):
        assert res.error is None, res.error
        assert not res.pushed and res.failed == []
        assert res.connected == [False] * d_tp
        assert res.failed_handshakes == d_tp, res.stats  # vLLM's own count: once per D rank
        for calls in res.calls:  # refused before NIXL: no agent loaded, no list prepared
            assert [c for c in calls if c[0] in ("prep_xfer_dlist", "add_remote_agent")] == [], calls
    assert [(h["notif_only"], h["trigger"], h["outcome"], h["error_type"], h["failed_phase"], h["attempt"])
            for h in fork.d_to_p] == [(True, "heartbeat", "failure", ErrorType.CONFIG_MISMATCH.value,
                                       Phase.METADATA_DECODE.value, 1)] * d_tp
    assert fork.saved("saved_descriptors") == fork.saved("saved_registrations") == [0] * d_tp
    top = [s for rank in fork.spans for s in rank if s["name"] == SPAN_HANDSHAKE]
    assert len(top) == d_tp
    for span in top:
        assert span["attributes"][Attr.ERROR_TYPE] == ErrorType.CONFIG_MISMATCH.value
        assert span["status"] == "ERROR" and PUSH_BLOCK_SIZE_REASON in span["status_description"], span
        assert Attr.NOTHING_SAVED_BECAUSE not in span["attributes"]
    p_engine = top[0]["attributes"][Attr.REMOTE_ENGINE_ID]
    for log in fork.log_files:  # vLLM's failure line for this P, with vLLM's reason
        text = Path(log).read_text(errors="replace")
        line = next(ln for ln in text.splitlines()
                    if "handshake_setup_failed" in ln and p_engine in ln)
        assert PUSH_BLOCK_SIZE_REASON in text[text.index(line):], log


@pytest.mark.parametrize("cid", CASES)
def test_handshake_span_says_why_nothing_was_saved_by_shape(matrix: dict[str, Case], cid: str) -> None:
    """The reason follows from the shape alone: a PP producer is never handshaked fully by
    vLLM; a local block size that is not a multiple of P's cannot be; otherwise none."""
    fork = _case(matrix, cid).fork
    if fork.shape["p_pp"] > 1:
        want = [NoSaving.PP_PRODUCER.value]
    elif cid in REFUSED:  # (the handshake failed before anything was counted)
        want = []
    elif fork.shape["d_block_size"] % fork.shape["p_block_size"]:
        want = [NoSaving.BLOCK_SIZE_MISMATCH.value]
    else:
        want = []
    assert fork.nothing_saved_because == want, fork.spans


@pytest.mark.parametrize("cid", CONNECTED)
def test_phase_spans_per_remote_rank_and_one_handshake_span_per_worker(matrix: dict[str, Case],
                                                                       cid: str) -> None:
    fork = _case(matrix, cid).fork
    for d_rank, spans in enumerate(fork.spans):
        top = [s for s in spans if s["name"] == SPAN_HANDSHAKE]
        assert len(top) == 1, [s["name"] for s in spans]
        assert top[0]["attributes"][Attr.LOCAL_TP_RANK] == d_rank
        assert top[0]["attributes"][Attr.REMOTE_TP_SIZE] == fork.shape["p_tp"]
        assert top[0]["attributes"][Attr.REMOTE_PP_SIZE] == fork.shape["p_pp"]
        fetched = {(s["attributes"][Attr.REMOTE_PP_RANK], s["attributes"][Attr.REMOTE_TP_RANK])
                   for s in spans if s["attributes"].get(Attr.PHASE) == Phase.METADATA_FETCH.value}
        assert fetched == _targets(fork, d_rank), fetched
        loads = [s for s in spans if s["attributes"].get(Attr.PHASE) == Phase.AGENT_LOAD.value]
        assert len(loads) == len(_targets(fork, d_rank))


@pytest.mark.parametrize("cid", CONNECTED)
def test_metrics_after_aggregation_equal_the_per_rank_ground_truth(matrix: dict[str, Case],
                                                                   cid: str) -> None:
    case = _case(matrix, cid)
    stock = case.stock.summary()
    assert case.observed is not None
    assert case.metrics["descriptors_saved"] == (stock["d_remote_descriptors_prepared"]
                                                 + stock["d_local_descriptors_prepared"])
    assert case.metrics["registrations_saved"] == (stock["d_remote_lists_prepared"]
                                                   + stock["d_local_lists_prepared"])
    # One observation per worker handshake (not per engine, not per remote rank).
    d_tp = case.fork.shape["d_tp"]
    assert case.metrics["duration_count"] == d_tp
    assert case.metrics["heartbeat_handshakes"] == d_tp
    assert case.metrics["duration_count_full"] == 0

"""The benchmarks' same-process A/B (`harness/stock_swap.py`): a fork engine swapped to
stock runs vLLM's own code paths (none of the fork's records), and the fork's again once
swapped back; bytes arrive intact either way, one request at a time or in bulk."""

from __future__ import annotations

from typing import Any

import pytest

from connector.vocabulary import StatKey
from harness import PushHarness
from harness.config import FORK

pytestmark = [pytest.mark.real, pytest.mark.timeout(300)]


def _count(stats: list[dict[str, Any]], key: str) -> int:
    return sum(len(s.get(key) or []) for s in stats)


def test_a_fork_engine_swapped_to_stock_runs_vllms_code_and_back(tmp_path):
    with PushHarness.pd(connector=FORK, workdir=str(tmp_path), num_blocks=64) as h:
        assert h.push(4).ok  # the fork connects (handshakes) first
        h.stats("P"), h.stats("D")

        h.stock_mode(stock=True)
        h.stock_mode(stock=True)  # (idempotent)
        assert h.push(3).ok and h.push(5, bulk=True).ok  # bytes verified
        p_stats, d_stats = h.stats("P"), h.stats("D")
        assert _count(p_stats, StatKey.PUSHES_STARTED) == 0  # none of the fork's records ...
        assert _count(d_stats, StatKey.RECEIVES) == _count(d_stats, StatKey.PUSH_REG_SENT) == 0
        assert _count(p_stats, "transfer_duration") >= 8  # ... and vLLM's own transfer stats

        h.stock_mode(stock=False)
        assert h.push(3).ok and h.push(5, bulk=True).ok
        p_stats, d_stats = h.stats("P"), h.stats("D")
        assert _count(p_stats, StatKey.PUSHES_STARTED) == _count(p_stats, StatKey.PUSHES_COMPLETED) == 8
        assert _count(d_stats, StatKey.RECEIVES) == _count(d_stats, StatKey.PUSH_REG_SENT) == 8

        # The known-work calibration (`harness/known_work.py`, `cpu_ab`'s `known` pair): in
        # stock mode, every per-request site burns what it was told, on its own thread.
        h.stock_mode(stock=True)
        us, n = 10_000.0, 4
        before = {e: h[e].call("thread_cpu") for e in ("P", "D")}
        h.known_work(us)
        assert h.push(n).ok
        spent = {e: {t: s - before[e].get(t, 0.0) for t, s in h[e].call("thread_cpu").items()}
                 for e in ("P", "D")}
        for e in ("P", "D"):  # (without it each thread spends well under 1 ms a request)
            for thread in ("MainThread", "nixl-push-writer"):
                assert spent[e][thread] >= n * us / 1e6, (e, thread, spent[e])
        h.known_work(0)  # (the runner checks that no wrapper is left)
        assert h.push(3).ok
        h.stock_mode(stock=False)

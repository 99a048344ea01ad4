"""KV integrity in a mixed fleet, on real NIXL: a fork decoder in front of a stock prefill.

The decoder asks for a digest in its PUSH_REG; a stock prefill ignores the key and
sends none. Its requests land and are decoded, counted `skipped`, with no error on
either side (the other mix, a fork prefill and a stock decoder, runs in every shape of
tests/test_shapes.py: the stock decoder never asks and is never sent a digest).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from connector.vocabulary import StatKey
from harness.cluster import Cluster
from harness.config import FORK, STOCK
from harness.shapes import ShapeRunner, engine_spec

pytestmark = [pytest.mark.real, pytest.mark.timeout(300)]


def test_a_fork_decoder_behind_a_stock_prefill_decodes_its_requests_counted_skipped(tmp_path: Path) -> None:
    work = str(tmp_path)
    d = Cluster(engine_spec("Dfork", "kv_consumer", FORK, workdir=work))
    p = Cluster(engine_spec("Pstock", "kv_producer", STOCK, workdir=work))
    with d, p:
        ok, per_rank, failed = ShapeRunner(requests=2).push(p, d)
        stats = d.call_all("stats")
    assert ok and not failed, per_rank
    verdicts = [v for rank in stats for s in rank for v in s.get(StatKey.KV_VERIFY, ())]
    assert verdicts == ["skipped|sampled", "skipped|sampled"]  # (outcome|reason)

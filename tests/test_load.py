"""Load through the harness: many requests with unique ids, many distinct decoders.

One fork prefill `P` pushes to N fork decoders `D0..D{N-1}` (each its own engine
process, engine id, NIXL agent and side channel), REQUESTS requests with unique ids
in batches of BATCH. Decoders come in waves of WAVE (started, pushed to round-robin,
checked, stopped), so P meets N distinct remote engines while the machine runs at
most WAVE + 1 engine processes. Then, against the harness's own ground truth:
- every request's KV landed (some batches also compare the bytes);
- every handshake attempt is counted once with one outcome, and the records match
  the NIXL agent loads and descriptor lists the harness saw the workers ask for;
- pushes, PUSH_REGs and receives match the requests sent, on P, on each D and on
  the Prometheus side;
- exported series stay within the vocabulary's bound (`series_bound()`), whatever
  the number of requests and peers, and no label value carries an id;
- the workers' per-request telemetry state is empty again.

CI runs LOAD_REQUESTS=1200 x LOAD_DECODERS=6; `make load` runs 10,000 x 50.
"""

from __future__ import annotations

import os
import re
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

import pytest

from connector.vocabulary import ALL_METRICS, StatKey, series_bound
from harness import PushHarness
from harness.cluster import rank_context
from harness.config import FORK, EngineSpec
from harness.ports import free_port
from tests.conftest import drain_stats, handshakes, remote_preps, stat_count

REQUESTS = int(os.environ.get("LOAD_REQUESTS", "1200"))
DECODERS = int(os.environ.get("LOAD_DECODERS", "6"))
WAVE = int(os.environ.get("LOAD_WAVE", "10"))  # decoders alive at once
BATCH = 50
BLOCKS_PER_REQUEST = 2
D_BLOCKS = BATCH * BLOCKS_PER_REQUEST + 8  # a decoder's cache: one batch at a time
LAYERS = 2

# Real engines (marker `real`). The suite's 600 s per-test limit covers the CI size; `make load` needs more.
pytestmark = [pytest.mark.real, pytest.mark.timeout(600 + REQUESTS // 10 + 10 * DECODERS)]

OUR_SAMPLE_NAMES = {name for m in ALL_METRICS
                    for name in (*m.series_names, m.name + "_created")}


@dataclass
class DecoderFacts:
    """What one decoder reported before it was stopped."""

    sent: int
    stats: list[dict]
    nixl_calls: list[tuple[str, str, int]]
    state_sizes: dict[str, int]


@dataclass
class LoadRun:
    h: PushHarness
    decoders: dict[str, DecoderFacts] = field(default_factory=dict)
    decoder_ids: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    mismatched: list[str] = field(default_factory=list)


def _engine(name: str, engine_id: str, role: str, num_blocks: int, work: str) -> EngineSpec:
    return EngineSpec(name=name, engine_id=engine_id, kv_role=role, side_channel_port=free_port(),
                      num_blocks=num_blocks, num_layers=LAYERS, block_size=32, workdir=work,
                      connector=FORK, log_file=f"{work}/{name}.log")


def _receives(stats: list[dict]) -> list[dict]:
    return [r for s in stats for r in s.get(StatKey.RECEIVES, [])]


@pytest.fixture(scope="module")
def load(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """P up for the whole run; decoders come in waves of WAVE (a 2-core machine cannot
    step fifty engine processes at once), each pushed to, checked and stopped."""
    work = str(tmp_path_factory.mktemp("load"))
    run = secrets.token_hex(3)
    h = PushHarness([_engine("P", f"load-prefill-{run}", "kv_producer",
                             BATCH * BLOCKS_PER_REQUEST + 8, work)], ctx=rank_context())
    h.start()
    out = LoadRun(h)
    per_decoder = max(1, REQUESTS // BATCH // DECODERS)  # batches per decoder
    t_start = time.monotonic()
    print(f"\n{per_decoder * BATCH * DECODERS} requests to {DECODERS} decoders in waves of {WAVE}; "
          f"engine logs under {work}")
    try:
        for first in range(0, DECODERS, WAVE):
            t0 = time.monotonic()
            specs = [_engine(f"D{i}", f"load-decode{i}-{run}", "kv_consumer", D_BLOCKS, work)
                     for i in range(first, min(first + WAVE, DECODERS))]
            h.add(specs)
            sent = {s.name: 0 for s in specs}
            for _ in range(per_decoder):
                for d in sent:
                    h.reuse_blocks("P", d)  # blocks are reused batch after batch: caches stay small
                    report = h.push(BATCH, decode=d, blocks_per_request=BLOCKS_PER_REQUEST,
                                    verify=len(out.decoders) % 5 == 0, timeout_s=120.0)
                    sent[d] += len(report.requests)
                    out.failed += report.failed
                    out.mismatched += report.mismatched
            for spec in specs:  # everything this decoder reports, then it goes
                n = sent[spec.name]
                stats = drain_stats(h, spec.name, lambda s, n=n: len(_receives(s)) >= n
                                    and len(handshakes(s)) >= 1, timeout_s=120.0)
                out.decoders[spec.name] = DecoderFacts(n, stats, h[spec.name].call("nixl_calls"),
                                                       h[spec.name].call("state_sizes"))
                out.decoder_ids.append(spec.engine_id)
            h.remove([s.name for s in specs])
            print(f"decoders {specs[0].name}-{specs[-1].name}: {sum(sent.values())} requests, "
                  f"{time.monotonic() - t0:.0f} s with start and stop")
        print(f"all {sum(f.sent for f in out.decoders.values())} requests in "
              f"{time.monotonic() - t_start:.0f} s")
        yield out
    finally:
        h.stop()


def test_every_request_lands_and_every_count_reconciles(load: LoadRun) -> None:
    h = load.h
    assert load.failed == [] and load.mismatched == []
    total = sum(f.sent for f in load.decoders.values())
    assert len(load.decoders) == DECODERS and total >= REQUESTS - BATCH * DECODERS
    p_stats = drain_stats(h, "P", lambda s: stat_count(s, StatKey.PUSHES_COMPLETED) >= total,
                          timeout_s=120.0)

    # P: one full P->D handshake per decoder, each one agent load in NIXL's own log...
    p_calls = h["P"].call("nixl_calls")
    p_hs = handshakes(p_stats)
    assert sorted((x["direction"], x["notif_only"], x["outcome"], x["attempt"]) for x in p_hs) == \
        [("p_to_d", False, "success", 1)] * DECODERS
    assert len([c for c in p_calls if c[0] == "add_remote_agent"]) == DECODERS
    # ... and the descriptors it counted are the ones it handed NIXL for the decoders.
    assert sum(x["descriptors"].get("remote", 0) for x in p_hs) == \
        sum(c[2] for c in remote_preps(p_calls)) > 0
    assert stat_count(p_stats, StatKey.PUSHES_STARTED) == total
    assert stat_count(p_stats, StatKey.PUSHES_COMPLETED) == total
    for key in (StatKey.PUSHES_FAILED, StatKey.PUSH_REG_REJECTED, StatKey.HANDSHAKE_RETRIES,
                StatKey.TELEMETRY_ERRORS):
        assert stat_count(p_stats, key) == 0, key

    # Each D: one notification-only D->P handshake (one agent load, no descriptor
    # list for P), one PUSH_REG and one successful receive per request it got.
    for d, facts in load.decoders.items():
        d_hs = handshakes(facts.stats)
        assert [(x["direction"], x["notif_only"], x["outcome"]) for x in d_hs] == \
            [("d_to_p", True, "success")], d
        assert len([c for c in facts.nixl_calls if c[0] == "add_remote_agent"]) == 1, d
        assert remote_preps(facts.nixl_calls) == [], d
        assert stat_count(facts.stats, StatKey.PUSH_REG_SENT) == facts.sent, d
        assert [r["outcome"] for r in _receives(facts.stats)] == ["success"] * facts.sent, d
        assert not any(facts.state_sizes.values()), (d, facts.state_sizes)

    # The Prometheus side agrees.
    fe = h.frontend("P")
    fe.observe(p_stats)
    assert fe.sample("vllm:nixl_pushes_total", {"outcome": "completed"}) == total
    assert sum(fe.sample("vllm:nixl_handshakes_total",
                         {"direction": "p_to_d", "trigger": t, "notif_agents_only": "false",
                          "outcome": "success"})
               for t in ("push_write", "push_reg_early")) == DECODERS
    d_fe = h.frontend("P")  # the decoders are stopped; the front end is the same class
    d_fe.observe(load.decoders["D0"].stats)
    assert d_fe.sample("vllm:nixl_push_receive_duration_seconds_count",
                       {"outcome": "success"}) == load.decoders["D0"].sent

    # Bounded: series per engine within the vocabulary's bound, no id in any label.
    ids = [h.specs["P"].engine_id, *load.decoder_ids]
    for name, front in (("P", fe), ("D0", d_fe)):
        ours = [line for line in front.exposition().splitlines()
                if line and not line.startswith("#") and re.split(r"[{ ]", line)[0] in OUR_SAMPLE_NAMES]
        print(f"{name}: {len(ours)} samples of our metrics exported (bound {series_bound()})")
        assert 0 < len(ours) <= series_bound()
        labels = " ".join(line.split("}")[0] for line in ours)
        assert not any(i in labels for i in ids) and "cmpl-" not in labels

    # Nothing per-request is left behind in P's worker.
    sizes = h["P"].call("state_sizes")
    assert sizes and not any(sizes.values()), sizes
    # Nor in vLLM's own per-request tables (the engine table keeps departed decoders
    # until vLLM's engine TTL evicts them).
    upstream = h["P"].call("state_sizes", True)
    upstream.pop("_engine_last_active")
    assert upstream and not any(upstream.values()), upstream

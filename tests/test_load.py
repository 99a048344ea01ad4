"""Load: 10,000 requests with unique ids and 50 distinct remote engines, state bounded.

What is real: one real P and one real D engine process (real NIXL/UCX WRITEs of real
KV blocks, verified byte-for-byte per batch, real ZMQ side channels). 10,000 requests
with unique ids go P -> D in batches of 500 (blocks are reused between batches, each
batch with fresh data). The 50 distinct remote engines D handshakes with are the real
P plus 49 engine ids D is sent to by registrations, like a router pointing at
engines that are gone or misconfigured: 45 at P's real side channel (it answers with
real metadata for another engine id: `engine_id_mismatch`) and 4 at ports nothing
listens on (`unreachable`, retried twice; each attempt waits the 2 s side-channel
timeout). What is not real: those 49 never serve KV.

Asserted: every handshake attempt is counted exactly once with one outcome (attempt
records reconcile with the ground truth: 1 + 45 + 4 x 3 on D, 1 on P, one first
attempt per distinct remote engine); pushes reconcile with the harness (10,000
started/completed on P, 10,000 PUSH_REG sent on D); the exported series of a real
exposition do not grow with requests or remote engines (and stay within the closed
vocabulary's bound); the per-interval stats object stays small (msgpack size per
stats interval does not grow with the number of requests).

`LOAD_REQUESTS=N` changes the request count (opt-in longer runs).
"""

from __future__ import annotations

import os
import secrets
import time
from collections import Counter
from typing import Any

import msgspec
import pytest

from connector import vocabulary as V
from connector.vocabulary import StatKey
from harness import PushHarness
from harness.runner import free_port

REQUESTS = int(os.environ.get("LOAD_REQUESTS", "10000"))
BATCH = 500
MISMATCH_GHOSTS = 45
UNREACHABLE_GHOSTS = 4  # each attempt waits the side-channel timeout: keep these few
RETRIES = 2
EXTRA = {"handshake_retries": RETRIES, "handshake_retry_backoff_s": 0.05,
         "handshake_timeout_ms": 2000}

pytestmark = [pytest.mark.real, pytest.mark.load]


def _wait(h: PushHarness, engine: str, ids: list[str], timeout_s: float = 300.0) -> dict[str, int]:
    deadline = time.monotonic() + timeout_s
    while True:
        got = h[engine].call("finished_among", ids)
        if got["finished"] + got["failed"] >= len(ids) or time.monotonic() > deadline:
            return got
        time.sleep(0.02)  # poll interval


def _series(text: str) -> set[str]:
    return {line.split(" ")[0] for line in text.splitlines()
            if line.startswith("vllm:nixl") and not line.startswith("#")}


def _vocabulary_bound() -> int:
    """Most series our metrics can have for one engine (closed label sets)."""
    total = 0
    for spec in V.ALL_METRICS:
        n = 1
        for label in spec.labels:
            n *= len(V.allowed_values(spec.name, label))
        per = {V.MetricKind.COUNTER: 2, V.MetricKind.GAUGE: 1}.get(  # _total, _created
            spec.kind, len(spec.buckets) + 1 + 3)  # buckets, +Inf, _sum, _count, _created
        total += n * per
    return total


@pytest.fixture(scope="module")
def load(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    work = str(tmp_path_factory.mktemp("load"))
    blocks = BATCH + MISMATCH_GHOSTS + UNREACHABLE_GHOSTS + 8
    h = PushHarness.pd(num_blocks=blocks, extra_config=EXTRA, workdir=work)
    facts: dict[str, Any] = {"sizes": [], "stats": {"P": [], "D": []}}
    try:
        h.start()
        p, d = h["P"], h["D"]
        fe = {name: h.frontend(name) for name in ("P", "D")}

        def collect() -> None:
            for name in ("P", "D"):
                got = h.stats(name)
                facts["stats"][name].extend(got)
                facts["sizes"].extend((name, len(msgspec.msgpack.encode(s))) for s in got)
                fe[name].observe(got)

        # 49 ghost engines, reached through registrations (no KV ever comes).
        ghosts = ([{"engine_id": f"ghost-m{i}", "host": "127.0.0.1", "port": p.address["port"]}
                   for i in range(MISMATCH_GHOSTS)]
                  + [{"engine_id": f"ghost-u{i}", "host": "127.0.0.1", "port": free_port()}
                     for i in range(UNREACHABLE_GHOSTS)])
        t0 = time.monotonic()
        ids: list[str] = []
        p_blocks = d_blocks = list(range(1, BATCH + 1))
        done = 0
        batch_no = 0
        series_after: dict[str, set[str]] = {}
        while done < REQUESTS:
            n = min(BATCH, REQUESTS - done)
            pairs = [(f"cmpl-{secrets.token_hex(8)}", f"cmpl-{secrets.token_hex(8)}")
                     for _ in range(n)]
            p.call("fill", p_blocks[:n], batch_no + 1)
            d.call("batch", [("register", (d_id, [d_blocks[i]], p.address, p_id, i == 0))
                             for i, (p_id, d_id) in enumerate(pairs)], timeout=120)
            if batch_no == 0:
                d.call("batch", [("register", (f"ghost-req-{i}", [BATCH + 1 + i], g, f"ghost-p-{i}", False))
                                 for i, g in enumerate(ghosts)])
            p.call("batch", [("finish", (p_id, [p_blocks[i]], 60.0))
                             for i, (p_id, _) in enumerate(pairs)], timeout=120)
            d_ids = [d_id for _, d_id in pairs]
            got = _wait(h, "D", d_ids)
            assert got == {"finished": n, "failed": 0}, (batch_no, got)
            assert p.call("digest", p_blocks[:n], timeout=120) == d.call("digest", d_blocks[:n],
                                                                         timeout=120)
            ids.extend(d_ids)
            done += n
            batch_no += 1
            collect()
            if batch_no == 1:
                facts["ghosts"] = _wait(h, "D", [f"ghost-req-{i}" for i in range(len(ghosts))])
        facts["seconds"] = time.monotonic() - t0
        facts["ids"] = ids
        # The last handshake records and push counters may still be on their way.
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            collect()
            st = facts["stats"]
            if (sum(len(s.get(StatKey.PUSHES_COMPLETED, [])) for s in st["P"]) >= REQUESTS
                    and sum(len(s.get(StatKey.HANDSHAKES, [])) for s in st["D"])
                    >= 1 + MISMATCH_GHOSTS + UNREACHABLE_GHOSTS * (1 + RETRIES)):
                break
            time.sleep(0.05)  # poll interval
        collect()
        series_after["end"] = _series(fe["D"].exposition()) | {"P:" + s for s in _series(
            fe["P"].exposition())}
        facts["series"] = series_after
        facts["exposition"] = {name: fe[name].exposition() for name in ("P", "D")}
        yield facts
    finally:
        h.stop()


def _records(stats: list[dict]) -> list[dict]:
    return [r for s in stats for r in s.get(StatKey.HANDSHAKES, [])]


def test_every_request_pushed_and_ids_unique(load: dict[str, Any]) -> None:
    assert len(load["ids"]) == len(set(load["ids"])) == REQUESTS
    # Ghost requests fail (their engines serve no KV); none is left hanging.
    assert load["ghosts"] == {"finished": 0, "failed": MISMATCH_GHOSTS + UNREACHABLE_GHOSTS}


def test_handshake_attempts_counted_once_each(load: dict[str, Any]) -> None:
    d = _records(load["stats"]["D"])
    p = _records(load["stats"]["P"])
    assert len(d) == 1 + MISMATCH_GHOSTS + UNREACHABLE_GHOSTS * (1 + RETRIES)
    assert len(p) == 1
    outcomes = Counter((r["outcome"], r["error_type"]) for r in d)
    assert outcomes == {("success", None): 1,
                        ("failure", "engine_id_mismatch"): MISMATCH_GHOSTS,
                        ("failure", "unreachable"): UNREACHABLE_GHOSTS * (1 + RETRIES)}
    # One first attempt per distinct remote engine: 50.
    assert Counter(r["attempt"] for r in d)[1] == 1 + MISMATCH_GHOSTS + UNREACHABLE_GHOSTS
    retries = sum(len(s.get(StatKey.HANDSHAKE_RETRIES, [])) for s in load["stats"]["D"])
    assert retries == UNREACHABLE_GHOSTS * RETRIES
    text = load["exposition"]["D"]
    failed = sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                 if line.startswith("vllm:nixl_handshakes_total{") and 'outcome="failure"' in line)
    assert failed == MISMATCH_GHOSTS + UNREACHABLE_GHOSTS * (1 + RETRIES)


def test_pushes_reconcile_with_the_harness(load: dict[str, Any]) -> None:
    p, d = load["stats"]["P"], load["stats"]["D"]

    def total(stats: list[dict], key: str) -> int:
        return sum(len(s.get(key, [])) for s in stats)

    assert total(p, StatKey.PUSHES_STARTED) == REQUESTS
    assert total(p, StatKey.PUSHES_COMPLETED) == REQUESTS
    assert total(p, StatKey.PUSHES_FAILED) == 0
    assert total(d, StatKey.PUSH_REG_SENT) == REQUESTS


def test_series_bounded(load: dict[str, Any]) -> None:
    """Exported series: the closed vocabulary's, whatever the requests and remote engines."""
    for name in ("P", "D"):
        text = load["exposition"][name]
        assert "ghost" not in text and "cmpl-" not in text  # no engine or request id as a label
        ours = {s for s in _series(text)
                if any(s.startswith(m.name) for m in V.ALL_METRICS)}
        assert len(ours) <= _vocabulary_bound()
    print(f"\nseries: P {len(_series(load['exposition']['P']))}, "
          f"D {len(_series(load['exposition']['D']))}; vocabulary bound {_vocabulary_bound()}; "
          f"{REQUESTS} requests in {load['seconds']:.1f} s")


def test_stats_size_per_interval_bounded(load: dict[str, Any]) -> None:
    sizes = load["sizes"]
    assert sizes
    third = max(1, len(sizes) // 3)
    early = max(s for _, s in sizes[:third])
    late = max(s for _, s in sizes[-third:])
    # Each interval's stats is swapped out and starts empty: its size follows that
    # interval's events, never the total pushed so far.
    assert late <= 2 * early + 4096, (early, late)
    print(f"\nstats per interval (msgpack bytes): max {max(s for _, s in sizes)}, "
          f"median {sorted(s for _, s in sizes)[len(sizes) // 2]}, intervals {len(sizes)}")

"""Shared fixtures: real engine processes (NIXL over UCX on CPU DRAM, ZMQ on 127.0.0.1).

Starting an engine costs ~10-20 s on this 2-core machine, so the expensive
scenarios run once per session and record what happened; the tests assert on it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CACHE_ROOT", str(Path(__file__).resolve().parents[1] / ".cache" / "vllm"))

from harness import PushHarness
from harness.config import FORK, STOCK, EngineSpec
from harness.poll import wait_until
from harness.runner import free_port


def drain_stats(h: PushHarness, engine: str, until: Any, timeout_s: float = 60.0) -> list[dict]:
    """Stats dicts of an engine, collected until `until(collected)` holds (polled):
    records reach the stats on the engine's next step, after the event itself."""
    out: list[dict] = []

    def more() -> bool:
        out.extend(h.stats(engine))
        return until(out)

    wait_until(more, f"{engine}'s stats to satisfy the condition", timeout_s, last=lambda: out)
    return out


def stat_count(stats: list[dict], key: str) -> int:
    return sum(len(s.get(key, [])) for s in stats)


def has_handshakes(n: int) -> Any:
    """Condition: at least `n` handshake records collected."""
    return lambda stats: len(handshakes(stats)) >= n


def handshakes(stats: list[dict]) -> list[dict]:
    return [hs for s in stats for hs in s.get("handshakes", [])]


def remote_preps(calls: list, agent_name: str | None = None) -> list[tuple[str, str, int]]:
    """prep_xfer_dlist calls for a remote agent (not NIXL_INIT_AGENT)."""
    return [c for c in calls if c[0] == "prep_xfer_dlist" and c[1] != "NIXL_INIT_AGENT"
            and (agent_name is None or c[1] == agent_name)]


@dataclass
class Scenario:
    """What one harness run did, recorded for several tests."""

    harness: PushHarness
    facts: dict[str, Any] = field(default_factory=dict)


@pytest.fixture(scope="session")
def trio(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """Fork P and D, plus stock engines S (decode) and Q (prefill), tracing into memory.

    Script: D and S first reach P by heartbeat only (no registration yet), then
    20 requests are pushed P->D through the fork; the facts are recorded; then the
    interop pushes P->S (stock PUSH_REG into the fork) and Q->D (our PUSH_REG, with
    its extra trace-context key, into stock) run.
    """
    work = str(tmp_path_factory.mktemp("trio"))
    common = dict(num_layers=2, num_blocks=128, block_size=32, tracing="memory", workdir=work)
    specs = [
        EngineSpec(name="P", engine_id="prefill-trio", kv_role="kv_producer",
                   side_channel_port=free_port(), connector=FORK, **common),
        EngineSpec(name="D", engine_id="decode-trio", kv_role="kv_consumer",
                   side_channel_port=free_port(), connector=FORK, **common),
        EngineSpec(name="S", engine_id="stock-decode-trio", kv_role="kv_consumer",
                   side_channel_port=free_port(), connector=STOCK, **common),
        EngineSpec(name="Q", engine_id="stock-prefill-trio", kv_role="kv_producer",
                   side_channel_port=free_port(), connector=STOCK, **common),
    ]
    with PushHarness(specs) as h:
        sc = Scenario(h)
        p_addr = h["P"].address
        p_agent = None
        for name in ("D", "S"):
            h[name].call("heartbeat", p_addr, "hb-only-request")
            h.wait_for(name, lambda c: "prefill-trio" in c["remote_agents"])
            sc.facts[f"{name}_calls_after_heartbeat"] = h[name].call("nixl_calls")
            sc.facts[f"{name}_connections_after_heartbeat"] = h[name].call("connections")
            h[name].call("stop_heartbeats")
        calls = sc.facts["D_calls_after_heartbeat"]
        p_agent = next(c[1] for c in calls if c[0] == "add_remote_agent")
        sc.facts["P_agent_name"] = p_agent
        sc.facts["report"] = h.push(20)
        # P: its P->D handshake and 20 completed pushes; D: its D->P handshake.
        # (S runs the stock connector: its stats have no handshake records.)
        sc.facts["stats"] = {
            "P": drain_stats(h, "P", lambda s: has_handshakes(1)(s)
                             and stat_count(s, "pushes_completed") >= 20),
            "D": drain_stats(h, "D", has_handshakes(1)),
        }
        sc.facts["spans"] = {n: h[n].call("spans") for n in ("P", "D", "S")}
        sc.facts["calls"] = {n: h[n].call("nixl_calls") for n in ("P", "D", "S")}
        sc.facts["pids"] = {n: h[n].info["pid"] for n in ("P", "D", "S")}
        sc.facts["affinity"] = {n: h[n].info["affinity"] for n in ("P", "D", "S")}
        sc.facts["interop"] = {
            "stock_decode_to_fork_prefill": h.push(3, prefill="P", decode="S"),
            "fork_decode_to_stock_prefill": h.push(3, prefill="Q", decode="D"),
        }
        yield sc

"""The fork inside real `vllm serve` engines: one P, one D, a disaggregated completion.

This is where stock vLLM 0.32 did a full D->P handshake (the heartbeat reached the
worker first; see docs/vllm-on-cpu.md). With the fork, vLLM's own /metrics must show
it notification-only, and D's log must not show the full path's "Transfer plan".
Needs the CPU build of vLLM (marker `serve`; the vLLM 0.33 lane deselects it).
"""

from __future__ import annotations

import re

import pytest

from harness.serve import VllmServer, disaggregated_completion

pytestmark = [pytest.mark.real, pytest.mark.serve, pytest.mark.timeout(600)]

PROMPT = list(range(1, 41))  # 40 tokens -> 2 blocks of 32


def sample(metrics: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in metrics.splitlines():
        if not line.startswith(name + "{"):
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


@pytest.fixture(scope="module")
def pd_servers(tmp_path_factory):
    work = tmp_path_factory.mktemp("serve")
    servers = [VllmServer(work, kv_role="kv_producer", engine_id="serve-prefill", cpu=0),
               VllmServer(work, kv_role="kv_consumer", engine_id="serve-decode", cpu=1)]
    try:
        for s in servers:
            s.wait_healthy()
        yield servers
    finally:
        for s in servers:
            s.stop()


def test_real_vllm_pd_completion_uses_notification_only_d_to_p(pd_servers):
    p, d = pd_servers
    out = disaggregated_completion(p, d, PROMPT, "req-serve-0001")
    assert not isinstance(out["P"], Exception), out["P"]
    assert not isinstance(out["D"], Exception), out["D"]
    assert len(out["D"]["choices"][0]["token_ids"]) == 4
    dm, pm = d.metrics(), p.metrics()
    # D computed none of the prompt: all 40 tokens came over NIXL.
    assert sample(dm, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer") == 40
    # D's handshake to P: notification-only (stock vLLM 0.32 did a full one here).
    assert sample(dm, "vllm:nixl_handshakes_total", direction="d_to_p", notif_agents_only="true",
                  outcome="success") == 1
    assert sample(dm, "vllm:nixl_handshakes_total", direction="d_to_p", notif_agents_only="false") == 0
    assert sample(dm, "vllm:nixl_descriptors_registered_total", direction="d_to_p") == 0
    saved = sample(dm, "vllm:nixl_descriptors_saved_total", direction="d_to_p")
    registered = sample(pm, "vllm:nixl_descriptors_registered_total", direction="p_to_d", list="remote")
    # P's full handshake to D prepared one list over D's blocks; D saved one over P's (same shape).
    assert saved > 0 and registered > 0 and saved == registered
    assert sample(dm, "vllm:nixl_push_reg_notifs_total", outcome="sent") == 1
    assert sample(pm, "vllm:nixl_pushes_total", outcome="completed") == 1
    assert sample(pm, "vllm:nixl_pushes_total", outcome="failed") == 0
    # Only vLLM's full add_remote_agent logs "Transfer plan": P did one, D none.
    assert not re.search(r"Transfer plan", d.log())
    assert re.search(r"Transfer plan", p.log())

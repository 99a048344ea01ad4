"""Let NIXL's progress thread sleep between polls in harness engines.

NIXL's Python API (1.5) creates every agent with a progress thread and a poll delay
of 0 microseconds (`pthrDelay`): a busy loop that keeps one core fully busy per
agent, idle or not. vLLM builds its agent with that default, so every vLLM worker
with a NIXL connector, stock or fork, spins one core (this is why an idle P+D pair
keeps a 2-core machine busy). On a GPU host that is a latency choice; on this
2-core test machine, with four to fifty engine processes, it is most of the load:
it stretches every test and drowns the CPU-cost benchmark in spin.

Harness engines therefore set a small delay (`EngineSpec.nixl_progress_delay_us`,
default 100 us; `HARNESS_NIXL_PROGRESS_DELAY_US=0` keeps NIXL's busy loop). The
thread still runs and still drives transfers; it polls at most every 100 us
instead of continuously. Real `vllm serve` engines (the demo and e2e tests) are
left as NIXL makes them.
"""

from __future__ import annotations

import sys
from typing import Any


def set_progress_delay(delay_us: int) -> None:
    """Make NIXL agents created from now on in this process poll every `delay_us`."""
    from vllm.distributed.nixl_utils import NixlWrapper

    if NixlWrapper is None:  # NIXL not installed: nothing to tune
        return
    bind = sys.modules[NixlWrapper.__module__].nixlBind
    create = bind.nixlAgent
    if getattr(create, "_harness_delay_us", None) is not None:
        create = create._harness_original

    def make_agent(name: Any, config: Any) -> Any:
        config.pthrDelay = delay_us
        return create(name, config)

    make_agent._harness_delay_us = delay_us  # type: ignore[attr-defined]
    make_agent._harness_original = create  # type: ignore[attr-defined]
    bind.nixlAgent = make_agent

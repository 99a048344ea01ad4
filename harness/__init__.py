"""A real P/D push harness: two engine processes, real NIXL (UCX on CPU DRAM), real ZMQ.

Used by the tests, the demo and the benchmarks. See `harness.runner.PushHarness`. The
package imports its engine parts (vLLM, NIXL) only when one of them is asked for, so
its small helpers (`harness.poll`, `harness.ports`, `harness.logs`) need neither.
"""

from __future__ import annotations

from typing import Any

__all__ = ["EngineHandle", "PushHarness", "PushReport"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from harness import runner

        return getattr(runner, name)
    raise AttributeError(f"module 'harness' has no attribute {name!r}")

"""A real P/D push harness: two engine processes, real NIXL (UCX on CPU DRAM), real ZMQ.

Used by the tests, the demo and the benchmarks. See `harness.runner.PushHarness`.
"""

from harness.runner import EngineHandle, PushHarness, PushReport

__all__ = ["EngineHandle", "PushHarness", "PushReport"]

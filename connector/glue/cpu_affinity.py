"""Keep a CPU engine's worker on its own cores: `kv_connector_extra_config.kv_transfer_cpu_affinity`.

On the CPU platform, vLLM's NIXL worker pins the thread that builds it (the worker's
main thread, which also runs the model) to "the last core of each NUMA node"
(`os.sched_setaffinity(0, ...)` in `NixlBaseConnectorWorker.__init__`), whatever cores
the engine was given with `VLLM_CPU_OMP_THREADS_BIND`; every thread the worker starts
later (NIXL's progress thread, the push writer, the handshake executor) inherits it.
With one engine per host that core is usually spare. With several engines on a host
(a P and a D, the usual disaggregated test bed) every engine's worker lands on the
same core: on a 2-core machine P's model and WRITEs then share core 1 with D's worker,
which busy-waits for its next step while it waits for KV, and a prefill or a WRITE can
take seconds, long enough for a request's KV lease to expire.

`contain` (the default) keeps vLLM's pin only when it stays inside the cores the
thread already had; otherwise the thread goes back to its own cores, and the log says
so. `upstream` keeps vLLM's pin as it is.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from connector.settings import KV_TRANSFER_CPU_AFFINITY

EXTRA_CONFIG_KEY = KV_TRANSFER_CPU_AFFINITY.key
CONTAIN = "contain"
UPSTREAM = "upstream"
POLICIES = (CONTAIN, UPSTREAM)


class AffinityPolicyError(ValueError):
    """`kv_transfer_cpu_affinity` names no known policy."""


def parse_policy(value: Any) -> str:
    if value is None or value == "":
        return CONTAIN
    if not isinstance(value, str) or value.lower() not in POLICIES:
        raise AffinityPolicyError(
            f"{EXTRA_CONFIG_KEY} must be one of {', '.join(POLICIES)}, got {value!r}")
    return value.lower()


class AffinityOutcome:
    """What happened to the thread's cores while the worker was built."""

    def __init__(self) -> None:
        self.before: set[int] | None = None
        self.pinned: set[int] | None = None  # where vLLM put the thread, when it moved it out
        self.kept: bool = False  # True: the thread is back on `before`


@contextmanager
def contained_affinity(policy: str) -> Iterator[AffinityOutcome]:
    """Under `contain`, undo a pin (done inside) that leaves the calling thread's cores."""
    outcome = AffinityOutcome()
    if policy != CONTAIN or not hasattr(os, "sched_getaffinity"):
        yield outcome
        return
    outcome.before = before = set(os.sched_getaffinity(0))
    try:
        yield outcome
    finally:
        after = set(os.sched_getaffinity(0))
        if not after <= before:
            outcome.pinned = after
            os.sched_setaffinity(0, before)
            outcome.kept = True

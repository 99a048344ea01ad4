"""`kv_transfer_cpu_affinity`: a pin that leaves the thread's own cores is undone under `contain`.

Each case runs on a thread of its own (affinity is per thread on Linux), with real
`sched_setaffinity` calls standing in for the one vLLM's CPU NIXL worker makes.
"""

from __future__ import annotations

import os
import threading

import pytest

from connector.glue.cpu_affinity import (
    CONTAIN,
    UPSTREAM,
    AffinityPolicyError,
    contained_affinity,
    parse_policy,
)

CPUS = sorted(os.sched_getaffinity(0))
needs_two = pytest.mark.skipif(len(CPUS) < 2, reason="needs two CPUs to move a thread between")


def on_thread(start: set[int], pin: set[int], policy: str) -> tuple[set[int], object]:
    """Start a thread on `start`, pin it to `pin` inside the context; its cores after."""
    out: dict[str, object] = {}

    def body() -> None:
        try:
            os.sched_setaffinity(0, start)
            with contained_affinity(policy) as outcome:
                os.sched_setaffinity(0, pin)  # what vLLM's worker does on the CPU platform
            out["after"], out["outcome"] = set(os.sched_getaffinity(0)), outcome
        except BaseException as exc:  # surfaced below, not lost on the thread
            out["error"] = exc

    t = threading.Thread(target=body)
    t.start()
    t.join(30)
    assert not t.is_alive()
    if "error" in out:
        raise out["error"]  # type: ignore[misc]
    return out["after"], out["outcome"]  # type: ignore[return-value]


@needs_two
def test_a_pin_onto_another_engines_core_is_undone():
    mine, other = {CPUS[0]}, {CPUS[-1]}
    after, outcome = on_thread(mine, other, CONTAIN)
    assert after == mine
    assert outcome.kept and outcome.before == mine and outcome.pinned == other


@needs_two
def test_a_pin_inside_the_threads_own_cores_is_kept():
    after, outcome = on_thread(set(CPUS), {CPUS[-1]}, CONTAIN)
    assert after == {CPUS[-1]}
    assert not outcome.kept and outcome.pinned is None


@needs_two
def test_upstream_keeps_vllms_pin():
    after, outcome = on_thread({CPUS[0]}, {CPUS[-1]}, UPSTREAM)
    assert after == {CPUS[-1]}
    assert not outcome.kept


@needs_two
def test_the_thread_is_restored_when_the_worker_fails_to_build():
    out: dict[str, set[int]] = {}

    def body() -> None:
        os.sched_setaffinity(0, {CPUS[0]})
        try:
            with contained_affinity(CONTAIN):
                os.sched_setaffinity(0, {CPUS[-1]})
                raise RuntimeError("worker start-up failed")
        except RuntimeError:
            out["after"] = set(os.sched_getaffinity(0))

    t = threading.Thread(target=body)
    t.start()
    t.join(30)
    assert out["after"] == {CPUS[0]}


@pytest.mark.parametrize("value,expected", [(None, CONTAIN), ("", CONTAIN), ("contain", CONTAIN),
                                            ("UPSTREAM", UPSTREAM)])
def test_parse_policy(value, expected):
    assert parse_policy(value) == expected


@pytest.mark.parametrize("value", ["pin", 1, ["contain"]])
def test_parse_refuses_unknown_policies(value):
    with pytest.raises(AffinityPolicyError, match="kv_transfer_cpu_affinity must be one of"):
        parse_policy(value)

"""How `python -m benchmarks overhead` attributes py-spy samples and prices them in CPU.

Pure logic on hand-written collapsed stacks (py-spy itself is not a dependency): waits
are left out by their innermost line, the innermost frame with an owner (the connector,
vLLM's nixl modules, the rest of vLLM, NIXL's bindings) decides whose a sample is, and a
thread's share of the connector's samples is priced with that thread's own CPU.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from benchmarks.common import REPO
from benchmarks.overhead import attributed_cpu, is_waiting, owner, sample_counts

SITE = "/venv/lib/python3.11/site-packages"
NIXL = f"{SITE}/vllm/distributed/kv_transfer/kv_connector/v1/nixl"


def _threading_line(text: str) -> int:
    """Line number of `text` in this interpreter's threading.py (it moves between versions)."""
    lines = Path(threading.__file__).read_text().splitlines()
    return next(i for i, line in enumerate(lines, 1) if text in line)


def _frame(function: str, path: str, line: int = 1) -> str:
    return f"{function} ({path}:{line})"


RUN = _frame("Thread.run", threading.__file__, _threading_line("self._target(*self._args"))
OUR_LOOP = _frame("HandshakeFlow._push_writer_loop", f"{REPO}/connector/glue/handshakes.py", 110)
VLLM_LOOP = _frame("NixlPushConnectorWorker._push_writer_loop", f"{NIXL}/push_worker.py", 262)
OUR_WRITE = _frame("PushFlow._do_start_push_kv", f"{REPO}/connector/glue/push.py", 272)
VLLM_XFER = _frame("NixlPushConnectorWorker._xfer_blocks", f"{NIXL}/push_worker.py", 714)
OTEL = _frame("Span.end", f"{SITE}/opentelemetry/sdk/trace/__init__.py", 900)
NIXL_CALL = _frame("nixl_agent.send_notif", f"{SITE}/nixl_cu13/_api.py", 865)
ENGINE_STEP = _frame("EngineCore.step", f"{SITE}/vllm/v1/engine/core.py", 300)
# `waiter.acquire()` in Condition.wait: blocked, off the CPU.
LOCK_WAIT = _frame("Condition.wait", threading.__file__, _threading_line("waiter.acquire()"))
# `acquire(False)` in Condition._is_owned: runs, never waits.
NON_BLOCKING = _frame("Condition._is_owned", threading.__file__, _threading_line("self._lock.acquire(False)"))


def _paths(*frames: str) -> list[str]:
    return [f.rpartition(" (")[2].rpartition(":")[0] for f in frames]


def _collapsed(rows: list[tuple[int, str, list[str], int]]) -> str:
    return "".join(f"thread ({tid}): {name};{';'.join(frames)} {n}\n" for tid, name, frames, n in rows)


def test_waits_are_told_apart_by_their_innermost_line():
    assert is_waiting(LOCK_WAIT)
    assert not is_waiting(NON_BLOCKING)
    assert not is_waiting(OUR_WRITE)  # (a file that is not there: not a wait)


def test_the_innermost_frame_with_an_owner_decides():
    assert owner(_paths(RUN, OUR_LOOP, VLLM_LOOP)) == "vllm_nixl"  # vLLM's loop below our override
    assert owner(_paths(RUN, OUR_LOOP, VLLM_LOOP, OUR_WRITE)) == "connector"
    assert owner(_paths(RUN, OUR_LOOP, VLLM_LOOP, OUR_WRITE, VLLM_XFER)) == "vllm_nixl"
    assert owner(_paths(OUR_WRITE, OTEL)) == "connector"  # what ours calls (OpenTelemetry) is ours
    assert owner(_paths(OUR_WRITE, NIXL_CALL)) == "nixl"  # NIXL's bindings are not
    assert owner(_paths(ENGINE_STEP)) == "vllm"
    assert owner(_paths(RUN, OTEL)) == "other"  # e.g. the span exporter's own thread


def test_sample_counts_leave_waits_out_and_count_whole_stack_labels():
    text = _collapsed([
        (101, "nixl-push-writer", [RUN, OUR_LOOP, VLLM_LOOP, LOCK_WAIT], 700),  # waiting
        (101, "nixl-push-writer", [RUN, OUR_LOOP, VLLM_LOOP, OUR_WRITE, OTEL], 30),
        (101, "nixl-push-writer", [RUN, OUR_LOOP, VLLM_LOOP, OUR_WRITE, VLLM_XFER], 270),
        (202, "MainThread", [ENGINE_STEP], 50),
    ])
    counts = sample_counts(text)
    writer = counts[101]
    assert (writer["all"], writer["waiting"]) == (300, 700)
    assert (writer["connector"], writer["vllm_nixl"]) == (30, 270)
    assert writer["connector_any"] == 300  # every running sample passes our loop override
    assert writer["opentelemetry"] == 30
    assert writer["connector_telemetry"] == 30  # our own samples in OpenTelemetry's SDK
    assert (counts[202]["all"], counts[202]["vllm"], counts[202]["connector_any"]) == (50, 50, 0)


def test_attributed_cpu_prices_each_threads_share_with_its_own_cpu():
    text = _collapsed([
        (101, "nixl-push-writer", [RUN, OUR_LOOP, VLLM_LOOP, LOCK_WAIT], 700),
        (101, "nixl-push-writer", [RUN, OUR_LOOP, VLLM_LOOP, OUR_WRITE], 30),
        (101, "nixl-push-writer", [RUN, OUR_LOOP, VLLM_LOOP, OUR_WRITE, VLLM_XFER], 270),
        (202, "MainThread", [ENGINE_STEP], 90),
        (202, "MainThread", [ENGINE_STEP, OUR_WRITE], 10),
    ])
    cpu = {101: 0.3, 202: 5.0, 303: 9.0}  # seconds; 303 (a native thread) has no samples
    got = attributed_cpu(sample_counts(text), cpu, ("connector", "vllm_nixl", "vllm"))
    # Writer: 10% of its running samples (the 700 waits left out) x 0.3 s; main: 10% x 5 s.
    assert got["connector"] == pytest.approx(0.03 + 0.5)
    assert got["vllm_nixl"] == pytest.approx(0.27)
    assert got["vllm"] == pytest.approx(4.5)

"""How `benchmarks.profile_push` prices the fork's own CPU from py-spy's collapsed stacks.

Pure logic on a hand-written collapsed file (py-spy itself is not a dependency): waits
are left out of a thread's samples, the deepest frame of ours / vLLM's / the harness's
decides the owner, and a thread's share of ours is priced with its own CPU.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from benchmarks.profile_push import _owner, _waiting, own_cost, own_costs


def _threading_line(text: str) -> int:
    """Line number of `text` in this interpreter's threading.py (it moves between versions)."""
    lines = Path(threading.__file__).read_text().splitlines()
    return next(i for i, line in enumerate(lines, 1) if text in line)


NIXL = "vllm/distributed/kv_transfer/kv_connector/v1/nixl"
WRITER = "thread (101): nixl-push-writer;Thread.run (threading.py:982)"
VLLM_LOOP = f"NixlPushConnectorWorker._push_writer_loop ({NIXL}/push_worker.py:262)"
OUR_WRITE = "PushFlow._do_start_push_kv (connector/glue/push.py:272)"
VLLM_XFER = f"NixlPushConnectorWorker._xfer_blocks ({NIXL}/push_worker.py:714)"
# `waiter.acquire()` in Condition.wait: blocked, off the CPU.
LOCK_WAIT = f"Condition.wait (threading.py:{_threading_line('waiter.acquire()')})"
OUR_ATTRS = "count_blocks (connector/glue/receive.py:140)"
# `acquire(False)` in Condition._is_owned: runs, never waits.
NON_BLOCKING = f"Condition._is_owned (threading.py:{_threading_line('self._lock.acquire(False)')})"


def _collapsed(tmp_path, rows: list[tuple[list[str], int]]):
    path = tmp_path / "P.collapsed.txt"
    path.write_text("".join(f"{';'.join(frames)} {n}\n" for frames, n in rows))
    return path


def test_waits_are_told_apart_by_their_innermost_line():
    cache: dict[str, bool] = {}
    assert _waiting([WRITER, LOCK_WAIT], cache)
    assert not _waiting([WRITER, NON_BLOCKING], cache)
    assert not _waiting([WRITER, VLLM_LOOP, OUR_WRITE], cache)


def test_the_deepest_frame_of_a_known_owner_decides():
    assert _owner([WRITER, VLLM_LOOP, OUR_WRITE]) == "ours"
    assert _owner([WRITER, VLLM_LOOP, OUR_WRITE, VLLM_XFER]) == "theirs"  # vLLM below our wrapper
    assert _owner([WRITER, VLLM_LOOP, OUR_WRITE, "len (builtins:0)"]) == "ours"  # what ours calls


def test_own_cost_prices_the_share_among_running_samples_with_the_threads_cpu(tmp_path):
    path = _collapsed(tmp_path, [
        ([WRITER, VLLM_LOOP, LOCK_WAIT], 700),  # waiting: neither ours nor theirs
        ([WRITER, VLLM_LOOP, OUR_WRITE, OUR_ATTRS], 30),  # ours
        ([WRITER, VLLM_LOOP, OUR_WRITE, VLLM_XFER], 270),  # vLLM's, under our wrapper
    ])
    cpu = {("P:nixl-push-writer", 101): 0.3, ("P:MainThread", 999): 5.0}  # seconds over the window
    [(name, (own_us, thread_us, n_ours, n_running))] = own_cost(path, cpu, requests=1000).items()
    assert name == "P:nixl-push-writer"  # a thread without samples is not priced
    assert (n_ours, n_running) == (30, 300)
    assert thread_us == pytest.approx(300.0)  # 0.3 s over 1,000 requests
    # 10% of the running samples are ours: 30 us of the thread's 300 us per request (counting
    # the 700 waiting samples too would have made it 3 us).
    assert own_us == pytest.approx(30.0)


def test_own_costs_sum_rows_of_one_name_across_processes(tmp_path):
    # Two processes whose threads carry one label (real `vllm serve`: "P:python" is the API
    # server and its helper alike): their rows add up, sample counts included.
    paths = []
    for i, tid in enumerate((201, 202)):
        path = tmp_path / f"{i}.collapsed.txt"
        head = f"thread ({tid}): MainThread;Thread.run (threading.py:982)"
        path.write_text(f"{head};{VLLM_LOOP};{OUR_WRITE};{OUR_ATTRS} 10\n"
                        f"{head};{VLLM_LOOP};{OUR_WRITE};{VLLM_XFER} 90\n")
        paths.append(path)
    cpu = {("P:python", 201): 0.1, ("P:python", 202): 0.2}
    (own_us, thread_us, n_ours, n_running), = own_costs(paths, cpu, requests=1000).values()
    assert (n_ours, n_running) == (20, 200)
    assert thread_us == pytest.approx(300.0)
    assert own_us == pytest.approx(30.0)  # 10% of 100 us, plus 10% of 200 us

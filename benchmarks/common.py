"""What every benchmark shares: where it writes, how it says what it is doing, and
how it reads the CPU time of processes from outside them.

A run prints one progress line per step (`[  12.3 s] ...`), sends engine logs to
files under its output directory (path printed), and ends by writing one JSON file
with the date, the git commit and the machine's core count next to the figures.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import shutil
import subprocess
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from harness.logs import LOG_DIR_ENV

REPO = Path(__file__).resolve().parents[1]
BENCH_ROOT = REPO / ".cache" / "bench"


def git_commit() -> str:
    """Short commit of the checkout, `+dirty` when the tree has changes ("unknown" outside git)."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                              text=True, check=True).stdout.strip()
        # (--no-optional-locks: reading the status never takes the index lock from a commit)
        dirty = subprocess.run(["git", "--no-optional-locks", "status", "--porcelain",
                                "--untracked-files=no"], cwd=REPO, capture_output=True, text=True,
                               check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return f"{head}+dirty" if dirty else head


class BenchRun:
    """One benchmark run: its output directory, progress lines and result file."""

    def __init__(self, name: str, out: str | Path | None = None):
        self.name = name
        self.dir = Path(out) if out else BENCH_ROOT / name
        self.dir.mkdir(parents=True, exist_ok=True)
        self.t0 = time.monotonic()
        self.date = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
        self.commit = git_commit()
        # Harness engines write their output here (a caller's HARNESS_LOG_DIR wins).
        self.logs = Path(os.environ.setdefault(LOG_DIR_ENV, str(self.dir / "engine-logs")))
        self.logs.mkdir(parents=True, exist_ok=True)
        # Scratch space (model files, harness state), replaced by the next run.
        self.work = self.dir / "work"
        shutil.rmtree(self.work, ignore_errors=True)
        self.work.mkdir()
        self.say(f"{name}: {self.date}, commit {self.commit}, {os.cpu_count()} cores; "
                 f"output in {self.dir}, engine logs in {self.logs}")

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def say(self, message: str) -> None:
        print(f"[{self.elapsed():7.1f} s] {message}", flush=True)

    def write(self, result: dict[str, Any],
              chart: Callable[[dict[str, Any], Path], None] | None = None) -> Path:
        """`<name>.json` (and `<name>.png` drawn by `chart`) in the output directory."""
        path = self.dir / f"{self.name}.json"
        full = {"benchmark": self.name, "date": self.date, "commit": self.commit,
                "cores": os.cpu_count(), "seconds": round(self.elapsed(), 1), **result}
        path.write_text(json.dumps(full, indent=1))
        written = [path]
        if chart is not None:
            png = self.dir / f"{self.name}.png"
            chart(full, png)
            written.append(png)
        self.say(f"wrote {', '.join(str(p) for p in written)}")
        return path


def rank_context(log_dir: Path) -> Any:
    """`harness.cluster.rank_context()` (engines fork from one preloaded server: many start
    much faster), with the server's own output (torch's import warnings) in a log file."""
    import multiprocessing.forkserver

    from harness.cluster import rank_context as preloaded

    ctx = preloaded()
    fd = os.open(log_dir / "forkserver.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    saved = [os.dup(1), os.dup(2)]
    try:
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        multiprocessing.forkserver.ensure_running()  # (the server keeps the descriptors it starts with)
    finally:
        for target, old in zip((1, 2), saved):
            os.dup2(old, target)
            os.close(old)
        os.close(fd)
    return ctx


def thread_cpu(pids: Iterable[int]) -> dict[tuple[int, int], float]:
    """CPU seconds so far of every thread of these processes, by (pid, native thread id).

    Read from the scheduler's per-thread run time (`/proc/<pid>/task/<tid>/schedstat`,
    nanoseconds) from outside, so reading costs the processes nothing. A thread that
    ended is missing (its time is lost to a difference of two reads); one that started
    since an earlier read counts from zero.
    """
    out: dict[tuple[int, int], float] = {}
    for pid in pids:
        with contextlib.suppress(OSError):  # (a process that ended meanwhile is skipped)
            for task in Path(f"/proc/{pid}/task").iterdir():
                with contextlib.suppress(OSError, ValueError, IndexError):
                    out[(pid, int(task.name))] = int((task / "schedstat").read_text().split()[0]) / 1e9
    return out


def cpu_delta(before: dict[tuple[int, int], float],
              after: dict[tuple[int, int], float]) -> dict[tuple[int, int], float]:
    """CPU seconds each thread spent between two `thread_cpu` reads."""
    return {key: seconds - before.get(key, 0.0) for key, seconds in after.items()}


def cpu_seconds(pids: Iterable[int]) -> float:
    """CPU seconds so far of these processes, all their threads (`thread_cpu`)."""
    return sum(thread_cpu(pids).values())


def caption(result: dict[str, Any]) -> str:
    """What a chart says about its run: benchmark, date and commit."""
    return f"{result['benchmark']}, {result['date'][:10]}, commit {result['commit']}"


def plt() -> Any:
    """matplotlib's pyplot on the file-only back-end."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as pyplot

    return pyplot

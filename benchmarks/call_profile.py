"""Per-request calls and time of every function, stock vs fork: where the fork's extra work is.

py-spy samples (`profile_push`) show shares; this counts. Two P/D pairs, one after the
other (stock, then fork, or two fork variants with --tracing/--sampler): each pushes
`--requests` requests while cProfile runs on both engines' main threads and on vLLM's
push writer threads (`HARNESS_PROFILE_WRITER`, from their start: the 20 warm-up requests
included), then the functions whose time per
request differs most are printed per thread, with calls per request. Call counts are
exact; cProfile's times are wall time (blocking waits on locks and `poll` are left out,
NIXL calls that wait are not) and inflated by its own per-call cost, so read them as
ranks, not as the CPU figures of `cpu_cost`.

    python -m benchmarks.call_profile [--requests 800] [--top 25] [--tracing] [--sampler S]
"""

from __future__ import annotations

import argparse
import os
import pstats
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.cpu_cost import push_batches
from harness import PushHarness
from harness.config import FORK, STOCK
from harness.otlp_receiver import OtlpGrpcReceiver
from harness.runner import LOG_DIR_ENV

# Blocking waits (their wall time is idle, not work): left out of the listing.
OURS = "connector/"
_WAITS = ("<method 'poll' of 'select.poll' objects>", "<method 'acquire' of '_thread.lock' objects>")


def _per_request(path: Path, n: int) -> dict[str, tuple[float, float]]:
    """function -> (calls per request, tottime us per request)."""
    out = {}
    for (file, line, func), (_, calls, tottime, _, _) in pstats.Stats(str(path)).stats.items():
        where = file.split("site-packages/")[-1].split(f"{os.getcwd()}/")[-1]
        out[f"{func} ({where}:{line})"] = (calls / n, tottime / n * 1e6)
    return out


def _calls(profile: dict[str, tuple[float, float]], where: str = "") -> float:
    """Calls per request of the functions whose file starts with `where` (all: "";
    vLLM's own `.../kv_connector/...` is not ours)."""
    return sum(calls for key, (calls, _) in profile.items() if key.rpartition(" (")[2].startswith(where))


def _run(name: str, n: int, batch: int, out: Path, **kw: Any) -> None:
    with PushHarness.pd(workdir=tempfile.mkdtemp(prefix=f"call-profile-{name}-"),
                        num_blocks=2 * batch + 8, **kw) as h:
        assert h.push(20).ok  # warm-up: handshakes
        for e in ("P", "D"):
            h[e].call("profile")
        push_batches(h, n, batch)
        for e in ("P", "D"):
            h[e].call("profile", str(out / f"{name}-{e}.pstats"))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=800)
    ap.add_argument("--batch", type=int, default=50)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--tracing", action="store_true",
                    help="compare fork tracing off (baseline) with fork tracing on (not stock with fork)")
    ap.add_argument("--sampler", default=None, help="OTEL_TRACES_SAMPLER of the traced fork, with --tracing")
    args = ap.parse_args(argv)
    out = Path(tempfile.mkdtemp(prefix="call-profile-"))
    os.environ.setdefault(LOG_DIR_ENV, str(out))
    os.environ["HARNESS_PROFILE_WRITER"] = "1"  # engines inherit it
    print(f"engine logs and profiles: {out}", flush=True)
    rx = OtlpGrpcReceiver() if args.tracing else None
    n = (args.requests // args.batch) * args.batch
    try:
        if rx is None:
            runs = {"base": dict(connector=STOCK), "new": dict(connector=FORK)}
        else:
            tracing = {"endpoint": rx.endpoint, "protocol": "grpc", "schedule_delay_ms": 5000}
            if args.sampler:
                tracing["sampler"] = args.sampler
            runs = {"base": dict(connector=FORK), "new": dict(connector=FORK, tracing=tracing)}
        for name, kw in runs.items():
            print(f"  {name}: {kw}", flush=True)
            _run(name, n, args.batch, out, **kw)
    finally:
        if rx is not None:
            rx.close()
    for e in ("P", "D"):
        for thread, suffix in (("main thread", ""), ("push writer", ".writer")):
            base = _per_request(out / f"base-{e}.pstats{suffix}", n)
            new = _per_request(out / f"new-{e}.pstats{suffix}", n)
            print(f"\n== {e} {thread}: per request, baseline -> {'traced fork' if rx else 'fork'} "
                  "(calls, cProfile us), largest time differences first")
            zero = (0.0, 0.0)
            keys = [k for k in set(base) | set(new) if not k.startswith(_WAITS)]
            print("  calls per request, all / into connector/: "
                  f"{_calls(base):.1f} / {_calls(base, OURS):.1f} -> "
                  f"{_calls(new):.1f} / {_calls(new, OURS):.1f}")
            for key in sorted(keys, key=lambda k: -(new.get(k, zero)[1] - base.get(k, zero)[1]))[:args.top]:
                (c0, t0), (c1, t1) = base.get(key, zero), new.get(key, zero)
                print(f"  {t1 - t0:+8.2f} us  calls {c0:6.2f} -> {c1:6.2f}  {key[:100]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

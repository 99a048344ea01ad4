"""`python -m benchmarks <name> [options]`: one entry point for every benchmark.

Each benchmark answers one question, prints progress and its figures (medians,
ratios measured side by side in one run), and writes `<name>.json` (and a PNG where
a chart helps) under `.cache/bench/<name>/` with the date and git commit.
`python -m benchmarks <name> --help` lists a benchmark's options.
"""

from __future__ import annotations

import argparse
import importlib
import signal
import sys
from types import ModuleType

from benchmarks.common import BenchRun

# name -> module; each module has a docstring (first line: the question it answers),
# `add_arguments(parser)`, `run(args, bench) -> dict` and optionally `chart(result, path)`.
BENCHMARKS: dict[str, str] = {
    "handshake": "benchmarks.handshake",
    "first-request": "benchmarks.first_request",
    "producers": "benchmarks.producers",
    "backends": "benchmarks.backends",
    "overhead": "benchmarks.overhead",
    "leases": "benchmarks.leases",
    "telemetry-cost": "benchmarks.telemetry_cost",
    "scale": "benchmarks.scale",
    "kv-verify": "benchmarks.kv_verify",
    "engine-cpu": "benchmarks.engine_cpu",
    "depth": "benchmarks.depth",
    "trust": "benchmarks.trust",
}


def _modules(argv: list[str] | None = None) -> dict[str, ModuleType]:
    """The benchmark named first on the command line alone (its imports only: `kv-verify
    --device cuda` runs where vLLM is not installed), else all of them (for --help)."""
    named = [a for a in (argv if argv is not None else sys.argv[1:]) if not a.startswith("-")][:1]
    names = named if named and named[0] in BENCHMARKS else list(BENCHMARKS)
    return {name: importlib.import_module(BENCHMARKS[name]) for name in names}


def parser(modules: dict[str, ModuleType]) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="benchmark", required=True, metavar="BENCHMARK")
    for name, module in modules.items():
        doc = (module.__doc__ or "").strip()
        sp = sub.add_parser(name, help=doc.splitlines()[0] if doc else name, description=doc,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
        sp.add_argument("--out", default=None,
                        help=f"output directory (default .cache/bench/{name})")
        module.add_arguments(sp)
    return ap


def _interrupt(*_: object) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    modules = _modules(argv)
    args = parser(modules).parse_args(argv)
    module = modules[args.benchmark]
    # SIGTERM unwinds like Ctrl-C, so each benchmark's `finally` stops the engines it
    # started (by default the process would die with them still running).
    signal.signal(signal.SIGTERM, _interrupt)
    bench = BenchRun(args.benchmark, args.out)
    try:
        result = module.run(args, bench)
    except KeyboardInterrupt:
        bench.say(f"{args.benchmark} interrupted; the processes it started are stopped")
        return 130
    bench.write(result, getattr(module, "chart", None))
    bench.say(f"{args.benchmark} done")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

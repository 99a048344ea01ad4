"""`python -m harness.campaign`: run the fault campaign, print progress, write a summary.

    python -m harness.campaign --seeds 20 --requests 250        # make chaos
    python -m harness.campaign --seeds 1017 --requests 250      # replay one seed

`--seeds N` runs seeds 1..N (or a comma-separated list). Engine logs of a failing seed
stay under the work directory; the summary (JSON) lists every seed's outcomes,
counters and violations, and the command that replays a failing one.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

from harness.campaign.plan import make_plan
from harness.campaign.run import quiet_parent_logs, replay_command, run_seed

REPO = Path(__file__).resolve().parents[2]


def parse_seeds(text: str) -> list[int]:
    if "," in text or "-" in text:
        out: list[int] = []
        for part in text.split(","):
            lo, _, hi = part.partition("-")
            out.extend(range(int(lo), int(hi or lo) + 1))
        return out
    return list(range(1, int(text) + 1))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m harness.campaign", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", default="20", help="N (seeds 1..N), or a list: 3,7,10-12")
    parser.add_argument("--requests", type=int, default=250, help="requests per seed")
    parser.add_argument("--out", default=str(REPO / ".cache" / "chaos"), help="summary and logs")
    parser.add_argument("--verify-ratio", type=float, default=1.0,
                        help="the engines' kv_verify_ratio (0: the byte checker alone); below 1 no "
                             "landed KV is corrupted")
    parser.add_argument("--mutant", default=None, help="a deliberate defect (harness.mutants)")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    seeds = parse_seeds(args.seeds)
    quiet_parent_logs(out / "schedulers.log")
    print(f"fault campaign: {len(seeds)} seed(s) x {args.requests} requests; engine logs of "
          f"failing seeds in {out / 'work'}, the schedulers' in {out / 'schedulers.log'}", flush=True)
    started, results = time.monotonic(), []
    for i, seed in enumerate(seeds, 1):
        plan = make_plan(seed, args.requests)
        t0 = time.monotonic()
        result = run_seed(plan, out / "work", mutant=args.mutant, verify_ratio=args.verify_ratio)
        results.append(result)
        o = result.outcomes
        print(f"[{time.monotonic() - started:7.1f}s] seed {seed} ({i}/{len(seeds)}, "
              f"P TP{plan.p_tp} D TP{plan.d_tp}, {plan.d_blocks} D blocks): "
              f"{o['kv_landed']} landed, {o['recomputed']} recomputed, {o['aborted']} aborted, "
              f"{o['lost_with_engine']} lost with their engine, {o['not_sent']} not sent (no engine); "
              f"{result.checked_positions} KV "
              f"positions checked; {len(result.violations)} violation(s) in {time.monotonic() - t0:.0f} s",
              flush=True)
        for violation in result.violations[:5]:
            print(f"    {violation}", flush=True)
        for lead in result.leads[:1]:
            print("    the first wrong check's blocks: " + lead.replace("\n", "\n    "), flush=True)
        if not result.ok:
            print(f"    replay: {replay_command(seed, args.requests)}", flush=True)
    failed = [r.seed for r in results if not r.ok]
    totals = {k: sum(r.outcomes[k] for r in results)
              for k in ("kv_landed", "recomputed", "aborted", "lost_with_engine", "not_sent")}
    summary = {
        "date": datetime.now(UTC).strftime("%Y-%m-%d"), "commit": _commit(),
        "command": "python -m harness.campaign " + " ".join(argv if argv is not None else sys.argv[1:]),
        "seeds": len(results), "requests": sum(r.plan["requests"] for r in results),
        "outcomes": totals, "checked_positions": sum(r.checked_positions for r in results),
        "violations": sum(len(r.violations) for r in results), "failed_seeds": failed,
        "replay": {s: replay_command(s, args.requests) for s in failed},
        "seconds": round(time.monotonic() - started, 1), "per_seed": [r.as_dict() for r in results]}
    path = out / "summary.json"
    path.write_text(json.dumps(summary, indent=1, default=str))
    print(f"[{time.monotonic() - started:7.1f}s] {summary['requests']} requests over {len(results)} "
          f"seed(s): {totals}; {summary['violations']} violation(s)"
          f"{' in seeds ' + str(failed) if failed else ''}; summary: {path}", flush=True)
    return 1 if failed else 0


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                              text=True, check=True).stdout.strip()
    except Exception:
        return "unknown"


if __name__ == "__main__":
    sys.exit(main())

"""One seed of the fault campaign, run and judged.

Real engines (harness.core: vLLM's scheduler over fork workers with real NIXL and ZMQ,
and harness.model writing and checking every KV byte), a router-like client that sends
each request's prefill and decode legs at once, and the seed's faults (harness.fault_agent
and the cores' own stalls, kills and restarts). Every request must end one of two ways:
its KV landed and every byte matched, or its receive failed with a counted reason and
vLLM recomputed it (or the client went away, or its engine died under it). Anything
else is a violation: a wrong byte, an engine exception, a request held past its
bound, blocks still held after the run, telemetry lost, or a counter that disagrees
with what happened.
"""

from __future__ import annotations

import contextlib
import secrets
import shutil
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from connector.vocabulary import StatKey
from harness.campaign.plan import (
    BOUND_SLACK_S,
    EXTRA_CONFIG,
    HOLD_S,
    LEASE_S,
    REGISTRATION_TIMEOUT_S,
    Plan,
    RequestPlan,
)
from harness.cluster import rank_context
from harness.config import EngineSpec
from harness.core import EngineCore, make_request
from harness.poll import PollTimeout, wait_until
from harness.runner import EngineError, free_port

NUM_LAYERS = 2
ENGINE_LOG_ERRORS = ("nixl-push-writer error", "Exception in thread", "Fatal Python error")


@dataclass
class Sent:
    plan: RequestPlan
    p_id: str
    d_id: str
    sent_at: float
    d_engine: int  # which D instance it went to
    aborted_at: float | None = None
    p_aborted: bool = False


@dataclass
class SeedResult:
    seed: int
    plan: dict[str, Any]
    outcomes: Counter = field(default_factory=Counter)
    violations: list[str] = field(default_factory=list)
    counters: dict[str, Any] = field(default_factory=dict)
    faults_injected: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0
    checked_positions: int = 0
    # For each wrong KV byte check: who last wrote the wrong blocks and what each rank and the
    # scheduler reported of those requests (in the summary; the first is printed).
    leads: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.violations

    def as_dict(self) -> dict[str, Any]:
        return {"seed": self.seed, "ok": self.ok, "plan": self.plan, "outcomes": dict(self.outcomes),
                "violations": self.violations, "counters": self.counters,
                "faults_injected": self.faults_injected, "seconds": round(self.seconds, 1),
                "checked_positions": self.checked_positions, "leads": self.leads}


class SeedRun:
    """The engines and the client of one seed."""

    def __init__(self, plan: Plan, workdir: Path, mutant: str | None = None, verify_ratio: float = 1.0):
        self.plan = plan
        self.work = workdir
        self.mutant, self.verify_ratio = mutant, verify_ratio
        self.ctx = rank_context()
        run = secrets.token_hex(3)
        common = dict(num_layers=NUM_LAYERS, block_size=32,
                      extra_config={**EXTRA_CONFIG, "kv_verify_ratio": verify_ratio},
                      workdir=str(workdir), prefix_caching=False, faults_seed=plan.seed,
                      kv_load_failure_policy="recompute", mutant=mutant)
        self.specs = {
            "P": EngineSpec(name="P", engine_id=f"prefill-{run}", kv_role="kv_producer",
                            side_channel_port=free_port(), tp_size=plan.p_tp, num_blocks=256, **common),
            "D": EngineSpec(name="D", engine_id=f"decode-{run}", kv_role="kv_consumer",
                            side_channel_port=free_port(), tp_size=plan.d_tp,
                            num_blocks=plan.d_blocks, **common),
        }
        if plan.ghost:
            self.specs["G"] = EngineSpec(name="G", engine_id=f"ghost-{run}", kv_role="kv_producer",
                                         side_channel_port=free_port(), num_blocks=128, **common)
        self.cores: dict[str, EngineCore] = {}
        self.retired: list[tuple[str, EngineCore]] = []  # restarted or killed instances
        self.sent: list[Sent] = []
        self.d_instance = 0
        self.restarting: set[str] = set()
        self.skipped_faults = 0
        self.not_sent = 0
        self.lock = threading.Lock()

    # ------------------------------------------------------------- engines
    def start(self) -> None:
        for name in self.specs:  # (their ranks start together, then each is awaited)
            self.cores[name] = EngineCore(self.specs[name], self.ctx)
        for core in self.cores.values():
            core.start()
        self._arm_faults(self.cores["D"])

    def _arm_faults(self, d: EngineCore) -> None:
        d.rank_call("faults", self.plan.notif_faults)
        # Landed KV is corrupted only where the KV check sees every receive: below that, a
        # corruption the check skipped is decoded from by design, and the byte checker's
        # wrong bytes would be the campaign's own, not the product's.
        if self.plan.corrupt and self.verify_ratio >= 1.0:
            for rank in self.plan.corrupt_ranks or (None,):
                d.rank_call("corrupt_landed", self.plan.corrupt, rank=rank)

    def stop(self) -> None:
        for core in [*self.cores.values(), *(c for _, c in self.retired)]:
            with contextlib.suppress(Exception):
                core.stop()

    def restart(self, name: str) -> None:
        old = self.cores[name]
        with self.lock:
            self.restarting.add(name)
        old.kill()
        self.retired.append((name, old))
        core = EngineCore(self.specs[name], self.ctx)
        core.start()
        with self.lock:
            self.cores[name] = core
            if name == "D":
                self.d_instance += 1
                self._arm_faults(core)
            self.restarting.discard(name)

    # --------------------------------------------------------------- client
    def send(self, req: RequestPlan) -> None:
        p_name = req.prefill
        with self.lock:
            p, d, instance = self.cores.get(p_name), self.cores["D"], self.d_instance
            if p_name in self.restarting or "D" in self.restarting or p is None:
                self.not_sent += 1  # (the router finds no engine: the client gets an error)
                return
        p_id = f"cmpl-{req.tid}-0-{secrets.token_hex(4)}"
        d_id = f"cmpl-{req.tid}-0-{secrets.token_hex(4)}"
        addr = p.address
        p.add_request(make_request(p_id, req.prompt, 1, {"do_remote_decode": True,
                                                          "do_remote_prefill": False}))
        d.add_request(make_request(d_id, req.prompt, req.max_tokens, {
            "do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": addr["engine_id"],
            "remote_host": addr["host"], "remote_port": addr["port"], "tp_size": addr["tp_size"],
            "pp_size": 1, "remote_request_id": req.tid, "remote_block_ids": []}))
        self.sent.append(Sent(req, p_id, d_id, time.monotonic(), instance))

    def abort_due(self, now: float) -> None:
        for s in self.sent:
            if s.plan.abort_after is not None and s.aborted_at is None and \
                    now - s.sent_at >= s.plan.abort_after:
                s.aborted_at = now
                with self.lock:
                    d = self.cores["D"] if s.d_engine == self.d_instance else None
                if d is not None:
                    d.abort(s.d_id)
            if s.plan.abort_prefill_leg and not s.p_aborted and now - s.sent_at >= 0.05:
                s.p_aborted = True
                with self.lock:
                    p = self.cores.get(s.plan.prefill)
                if p is not None:
                    p.abort(s.p_id)

    def fault(self, kind: str, seconds: float) -> None:
        with self.lock:
            if self.restarting:
                self.skipped_faults += 1
                return
            cores = dict(self.cores)
        if kind == "stall_p":
            cores["P"].stall(seconds)
        elif kind == "stall_d":
            cores["D"].stall(seconds)
        elif kind == "stall_writer_p":
            cores["P"].rank_call("stall_writer", seconds)
        elif kind == "stall_writer_d":
            cores["D"].rank_call("stall_writer", seconds)
        elif kind in ("slow_writes", "slow_writes_d_stalled"):
            for rank in range(len(cores["P"].ranks)):
                cores["P"].rank_call("slow_writes", 2.0, seconds, rank=rank)
            if kind == "slow_writes_d_stalled":
                cores["D"].stall(LEASE_S + 1.0)
        elif kind == "partition":
            for name in ("P", "D"):
                cores[name].rank_call("partition", seconds)
        elif kind == "restart_p":
            threading.Thread(target=self.restart, args=("P",), daemon=True).start()
        elif kind == "restart_d":
            threading.Thread(target=self.restart, args=("D",), daemon=True).start()
        elif kind == "ghost_dies" and "G" in cores:
            with self.lock:
                ghost = self.cores.pop("G")
            ghost.kill()
            self.retired.append(("G", ghost))

    def drive(self) -> None:
        """Send the requests and inject the faults on their schedule."""
        start = time.monotonic()
        requests = list(self.plan.requests)
        faults = list(self.plan.faults)
        while requests or faults:
            now = time.monotonic() - start
            while requests and requests[0].at <= now:
                self.send(requests.pop(0))
            while faults and faults[0].at <= now:
                f = faults.pop(0)
                try:
                    self.fault(f.kind, f.seconds)
                except EngineError:  # (its engine is restarting or gone: the fault lapses)
                    self.skipped_faults += 1
            self.abort_due(time.monotonic())
            time.sleep(0.005)  # the client's own pacing (requests arrive over time)

    # ---------------------------------------------------------------- wait
    def d_cores(self) -> list[EngineCore]:
        """D instances in order (retired first)."""
        return [c for n, c in self.retired if n == "D"] + [self.cores["D"]]

    def unsettled(self) -> list[Sent]:
        """Requests still on their way: D has not finished them, or (aborted) still holds
        them (their blocks are freed when vLLM's scheduler lets them go)."""
        d_cores = self.d_cores()
        out, aborted = [], []
        for s in self.sent:
            if s.d_engine != len(d_cores) - 1 or s.d_id in d_cores[s.d_engine].state.finished:
                continue
            (aborted if s.aborted_at is not None else out).append(s)
        if aborted:
            ids = [s.d_id for s in aborted]
            held = set(d_cores[-1].query(lambda sched: [r for r in ids if r in sched.requests]))
            out.extend(s for s in aborted if s.d_id in held)
        return out

    def wait(self, timeout_s: float) -> None:
        def settled() -> bool:
            self.abort_due(time.monotonic())
            return not self.restarting and not self.unsettled()

        with contextlib.suppress(PollTimeout):  # (what is left unsettled is judged)
            wait_until(settled, "every request to finish", timeout_s, interval_s=0.1)

    def drain(self, timeout_s: float) -> bool:
        """Every engine alive gives back every block (leases end, aborted receives fail)."""
        def empty() -> bool:
            for core in self.cores.values():
                n, usage = core.query(lambda s: (len(s.requests), s.kv_cache_manager.usage))
                if n or usage:
                    return False
            return True
        try:
            wait_until(empty, "every engine to give back every block", timeout_s, interval_s=0.1)
        except PollTimeout:
            return False
        return True


def run_seed(plan: Plan, workdir: Path, mutant: str | None = None, verify_ratio: float = 1.0) -> SeedResult:
    """Run one seed and judge it; engines stopped and scratch removed on the way out.
    `mutant`: a deliberate defect the engines run with (harness.mutants); `verify_ratio`:
    the engines' `kv_verify_ratio` (0: no KV check, the byte checker alone)."""
    result = SeedResult(plan.seed, plan.summary())
    started = time.monotonic()
    work = workdir / f"seed-{plan.seed}"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    run = SeedRun(plan, work, mutant, verify_ratio)
    try:
        phases = result.counters.setdefault("phase_seconds", {})
        t = time.monotonic()
        run.start()
        phases["start"], t = round(time.monotonic() - t, 1), time.monotonic()
        run.drive()
        phases["drive"], t = round(time.monotonic() - t, 1), time.monotonic()
        bound = REGISTRATION_TIMEOUT_S + HOLD_S + plan.held_back_s + BOUND_SLACK_S
        run.wait(bound + 40.0)  # (+ a restarted engine's start-up)
        phases["wait"], t = round(time.monotonic() - t, 1), time.monotonic()
        drained = run.drain(2 * LEASE_S + HOLD_S + BOUND_SLACK_S)
        phases["drain"] = round(time.monotonic() - t, 1)
        result.faults_injected = _fault_counts(run)  # (the KV check's verdicts are judged by it)
        judge(run, result, bound, drained)
    except Exception as exc:
        result.violations.append(f"campaign error: {type(exc).__name__}: {exc}")
        for name, core in [*run.cores.items(), *run.retired]:
            result.violations.extend(f"engine {name} exception: {e[:2000]}" for e in core.state.errors)
    finally:
        if not result.faults_injected:
            result.faults_injected = _fault_counts(run)
        run.stop()
        result.seconds = time.monotonic() - started
        if result.ok:
            shutil.rmtree(work, ignore_errors=True)
    return result


def _fault_counts(run: SeedRun) -> dict[str, Any]:
    """What the fault layers of the engines alive at the end injected (per engine)."""
    out: dict[str, Any] = {"skipped": run.skipped_faults}
    for name, core in run.cores.items():
        with contextlib.suppress(Exception):
            counts = core.rank_call("fault_counts")
            out[name] = {k: sum(c[k] for c in counts) for k in counts[0] if k != "by_kind"}
    return out


def judge(run: SeedRun, result: SeedResult, bound_s: float, drained: bool) -> None:
    v = result.violations
    unsettled = run.unsettled() if run.cores.get("D") is not None else []
    d_cores = run.d_cores()
    checks = [c for d in d_cores for c in d.state.checks]
    result.checked_positions = sum(c.positions for c in checks)
    # Finished requests' blocks a receive of the same step took over: not checked (the
    # prefill may already be writing them); how often, and how often they had changed.
    taken = [c for c in checks if c.reused]
    result.counters["finished_blocks_taken_by_a_receive"] = {
        "checks": len(taken), "positions": sum(c.reused for c in taken),
        "changed": sum(c.reused_changed for c in taken)}
    wrong_checks = [c for c in checks if not c.ok]
    events = {k: e for core in d_cores for k, e in core.state.kv_events.items()} if wrong_checks else {}
    for c in wrong_checks:
        v.append(f"wrong KV bytes: {c.req_id} ({c.when}): {c.wrong} of {c.positions} positions "
                 f"({c.unwritten} never written), first {c.wrong_positions}")
        receivers = [r for core in d_cores for b in c.blocks for r in core.state.receivers.get(b, ())]
        lead = [c.detail] + [f"  {r} receive: " + "; ".join(events.get(r, [])[-6:])
                             for r in dict.fromkeys([c.req_id, *c.writers, *receivers])]
        result.leads.append("\n".join(lead))
    landed = {c.req_id for c in checks if c.when == "landed"}
    result.outcomes["not_sent"] = run.not_sent
    for s in run.sent:
        d = d_cores[s.d_engine]
        st = d.state
        if s.d_engine != len(d_cores) - 1 and s.d_id not in st.finished:
            result.outcomes["lost_with_engine"] += 1
            continue
        if s.aborted_at is not None and s.d_id not in st.finished:
            result.outcomes["aborted"] += 1
            if s.d_id in st.finished_recving:
                held = st.finished_recving[s.d_id] - s.aborted_at
                if held > bound_s:
                    v.append(f"aborted {s.d_id}: blocks held {held:.1f} s (bound {bound_s:.0f} s)")
            if s in unsettled:
                v.append(f"aborted {s.d_id}: its blocks were never given back")
            continue
        if s.d_id not in st.finished:
            v.append(f"request {s.d_id} (#{s.plan.index}) never finished")
            continue
        wait = st.finished_recving.get(s.d_id, st.finished[s.d_id].at) - s.sent_at
        if wait > bound_s:
            v.append(f"request {s.d_id} waited {wait:.1f} s for its KV (bound {bound_s:.0f} s)")
        if s.d_id in st.failed_recving:
            result.outcomes["recomputed"] += 1
        elif s.d_id in landed:
            result.outcomes["kv_landed"] += 1
        else:
            v.append(f"request {s.d_id} finished with neither its KV landed nor a failed receive")
    if not drained:
        v.append("blocks still held after the run (an engine did not give back every block)")
    for name, core in [*run.cores.items(), *run.retired]:
        for err in core.state.errors:
            if name in {n for n, _ in run.retired} and core in {c for _, c in run.retired}:
                continue  # (a killed engine's own death)
            v.append(f"engine {name} exception: {err.splitlines()[0]}")
    for log in sorted(run.work.glob("*.log")):
        text = log.read_text(errors="replace")
        for marker in ENGINE_LOG_ERRORS:
            if marker in text:
                v.append(f"{log.name}: '{marker}'")
    counters(run, result, landed)


def _stat_counts(stats: list[dict[str, Any]], key: str) -> Counter:
    out: Counter = Counter()
    for s in stats:
        for value in s.get(key, ()):
            out[value if isinstance(value, str) else "n"] += 1
    return out


def counters(run: SeedRun, result: SeedResult, landed: set[str]) -> None:
    """The engines' own counts against what the campaign saw happen."""
    v = result.violations
    d_cores, p_cores = run.d_cores(), [c for n, c in [*run.retired, *run.cores.items()] if n != "D"]
    d_stats = [s for d in d_cores for s in d.state.stats]
    p_stats = [s for p in p_cores for s in p.state.stats]
    ok_receives = sum(1 for s in d_stats for r in s.get(StatKey.RECEIVES, ())
                      if isinstance(r, dict) and r.get("outcome") == "success")
    # (rank 0's view, which its telemetry counts: another rank may have failed a receive
    # rank 0 landed, as a KV check of its heads does; the scheduler then recomputed it)
    d_failed = sum(len(d.state.failed_on_rank0) for d in d_cores)
    failures = sum(_stat_counts(d_stats, StatKey.RECEIVE_FAILURES).values())
    pushes = sum(_stat_counts(p_stats, StatKey.PUSHES_COMPLETED).values())
    landed_ok = sum(len(set(d.state.finished_recving) - d.state.failed_on_rank0) for d in d_cores)
    expired_vllm = sum(len(s.get("num_kv_expired_reqs", ())) for s in p_stats)
    expired_ours = sum(_stat_counts(p_stats, StatKey.LEASE_EXPIRIES).values())
    push_fails = _stat_counts(p_stats, StatKey.PUSH_FAILS)
    failure_reasons = _stat_counts(d_stats, StatKey.RECEIVE_FAILURES)
    lease_refusals = failure_reasons["lease_expired"]
    telemetry_lost = _stat_counts(d_stats + p_stats, StatKey.TELEMETRY_ERRORS)
    verify_records = [str(v) for s in d_stats for v in s.get(StatKey.KV_VERIFY, ())]
    result.counters = {
        **result.counters,
        "d_receives_ok": ok_receives, "d_receives_landed_seen": landed_ok,
        "d_receive_failures": failures, "d_failed_recving_seen": d_failed,
        "p_pushes_completed": pushes, "p_lease_expiries_vllm": expired_vllm,
        "p_lease_expiries_ours": expired_ours, "p_push_fails": dict(push_fails),
        "p_push_reg_rejected": dict(_stat_counts(p_stats, StatKey.PUSH_REG_REJECTED)),
        "d_receives_abandoned": dict(_stat_counts(d_stats, StatKey.RECEIVES_ABANDONED)),
        "d_receive_failure_reasons": dict(failure_reasons),
        "write_aborts": dict(_stat_counts(p_stats, StatKey.WRITE_ABORTS)),
        "telemetry_errors": dict(telemetry_lost),
        # (each record is "outcome|reason": by outcome, and by why it was checked)
        "kv_verify": dict(Counter(v.partition("|")[0] for v in verify_records)),
        "kv_verify_reason": dict(Counter(v.rpartition("|")[2] for v in verify_records)),
    }
    verdicts = result.counters["kv_verify"]
    corrupted = sum(c.get("corrupted", 0) for name, c in result.faults_injected.items()
                    if name == "D" and isinstance(c, dict))
    restarted_d = any(f.kind == "restart_d" for f in run.plan.faults)
    # Every corrupted receive failed (recomputed), never decoded from: the KV check caught it.
    failed_here = set().union(*(c.state.failed_recving for c in d_cores)) if d_cores else set()
    try:
        per_rank = run.cores["D"].rank_call("corrupted_ids")
    except Exception:
        per_rank = []  # (D's engine is gone: its corruptions died with it)
    for rank_ids in per_rank:
        missed = sorted(set(rank_ids) - failed_here)
        if missed and run.verify_ratio >= 1.0:
            v.append(f"{len(missed)} corrupted receive(s) not failed by the KV check: {missed[:3]}")
    # A mismatch where nothing was corrupted is a false alarm (a mutant's defect is not).
    if verdicts.get("mismatch", 0) > corrupted and not restarted_d and run.mutant is None:
        v.append(f"D found {verdicts['mismatch']} KV mismatch(es) but only {corrupted} receive(s) "
                 "were corrupted: a false alarm of the KV check")
    if ok_receives != landed_ok:
        v.append(f"D counted {ok_receives} receives landed, the engines reported {landed_ok}")
    if failures != d_failed:
        v.append(f"D counted {failures} failed receives, the engines reported {d_failed}")
    if expired_vllm != expired_ours:
        v.append(f"P: vLLM counted {expired_vllm} expired leases, the fork {expired_ours}")
    if lease_refusals > expired_vllm:  # (each refused as lease-expired must be one P released)
        v.append(f"D failed {lease_refusals} receive(s) as lease-expired, P released {expired_vllm}")
    # Every landed receive is a completed push; a push can also complete on P's rank 0
    # for a receive that then failed (another rank's WRITE did not: D recomputes) or
    # whose decoder died.
    lost = result.outcomes["lost_with_engine"]
    if not landed_ok <= pushes <= landed_ok + lost + d_failed:
        v.append(f"P completed {pushes} pushes, D landed {landed_ok} ({lost} died with D, "
                 f"{d_failed} failed)")
    if telemetry_lost:
        v.append(f"telemetry lost: {dict(telemetry_lost)}")


def quiet_parent_logs(path: Path) -> None:
    """This process's vLLM and connector log lines (the schedulers run here) go to a
    file, not the console."""
    import logging

    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    for name in ("vllm", "connector", "harness"):
        log = logging.getLogger(name)
        for old in list(log.handlers):
            log.removeHandler(old)
        log.addHandler(handler)
        log.propagate = False


def replay_command(seed: int, requests: int) -> str:
    return f"python -m harness.campaign --seeds {seed}-{seed} --requests {requests}"



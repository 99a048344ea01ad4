"""What one seed of the fault campaign does: engines, requests and faults, all drawn
from the seed (the same seed replays the same plan)."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

# Engine settings every seed shares: short enough that leases, timeouts and holds all
# happen within a run. (kv_lease_duration is an integer in vLLM: heartbeats every
# lease // 6 s, renewals by lease * 2 // 3.)
LEASE_S = 6
WRITE_TIMEOUT_S = 3.0
MARGIN_S = 0.5
REGISTRATION_TIMEOUT_S = 30.0
UNMATCHED_S = 6.0
FORGET_AFTER_S = 20.0
EXTRA_CONFIG: dict[str, Any] = {
    "kv_lease_duration": LEASE_S, "push_write_timeout_s": WRITE_TIMEOUT_S,
    "push_lease_margin_s": MARGIN_S, "push_registration_timeout": REGISTRATION_TIMEOUT_S,
    "unmatched_push_reg_timeout_s": UNMATCHED_S, "peer_forget_after_s": FORGET_AFTER_S,
    "handshake_timeout_ms": 1000, "handshake_retry_budget_s": 4,
}
# How long a decoder may hold a given-up receive's blocks (connector/state/receives.py).
HOLD_S = LEASE_S + WRITE_TIMEOUT_S + 2 * MARGIN_S
# The documented bound on a request's wait for its KV: its registration timeout, then
# the hold; plus what the run itself held engines back (stalls, partitions) and slack
# for this 2-core machine.
BOUND_SLACK_S = 10.0

FAULT_KINDS = ("stall_p", "stall_d", "stall_writer_p", "stall_writer_d", "partition",
               "slow_writes", "slow_writes_d_stalled", "restart_p", "restart_d", "ghost_dies")


@dataclass
class RequestPlan:
    index: int
    at: float  # seconds after the start
    tid: str  # the transfer id the router sends (shared by reused-id requests)
    prompt: list[int]
    max_tokens: int
    prefill: str  # "P" or "G" (the ghost prefill that dies)
    abort_after: float | None = None  # the client goes away this long after sending
    abort_prefill_leg: bool = False


@dataclass
class FaultEvent:
    at: float
    kind: str
    seconds: float = 0.0


@dataclass
class Plan:
    seed: int
    p_tp: int
    d_tp: int
    d_blocks: int
    notif_faults: dict[str, dict[str, Any]]
    requests: list[RequestPlan] = field(default_factory=list)
    faults: list[FaultEvent] = field(default_factory=list)
    ghost: bool = False
    corrupt: float = 0.0  # share of D's landed receives with a bit flipped (KV check)
    corrupt_ranks: tuple[int, ...] = ()  # the D ranks that corrupt (none named: every rank)

    @property
    def duration_s(self) -> float:
        return max([r.at for r in self.requests] + [f.at for f in self.faults] + [0.0])

    @property
    def held_back_s(self) -> float:
        """The longest any engine is held back by a fault (stalls, partitions, restarts)."""
        return max([f.seconds for f in self.faults] + [0.0])

    def summary(self) -> dict[str, Any]:
        kinds: dict[str, int] = {}
        for f in self.faults:
            kinds[f.kind] = kinds.get(f.kind, 0) + 1
        return {"seed": self.seed, "p_tp": self.p_tp, "d_tp": self.d_tp, "d_blocks": self.d_blocks,
                "requests": len(self.requests), "ghost": self.ghost, "faults": kinds,
                "corrupt": self.corrupt, "corrupt_ranks": list(self.corrupt_ranks),
                "reused_ids": len(self.requests) - len({r.tid for r in self.requests}),
                "aborts": sum(r.abort_after is not None for r in self.requests),
                "prefill_leg_aborts": sum(r.abort_prefill_leg for r in self.requests),
                "notif_faults": self.notif_faults}


def make_plan(seed: int, requests: int, rate_per_s: float = 6.0) -> Plan:
    """Draw a seed's plan: a shape, KV pressure, the requests and a fault timeline."""
    rng = random.Random(seed)
    shape = rng.choice([(1, 1), (1, 1), (2, 1), (1, 2)])
    plan = Plan(seed=seed, p_tp=shape[0], d_tp=shape[1],
                d_blocks=rng.choice([40, 64, 128]),  # 40: D preempts and queues
                notif_faults={kind: {"drop": rng.choice([0.0, 0.02, 0.05]),
                                     "dup": rng.choice([0.0, 0.05]),
                                     "delay": rng.choice([0.0, 0.05, 0.1]),
                                     "delay_s": (0.05, rng.choice([0.5, 2.0, LEASE_S + 1.0]))}
                              for kind in ("heartbeat", "push_reg")},
                ghost=rng.random() < 0.5)
    t = 2.0
    recent: list[RequestPlan] = []
    for i in range(requests):
        t += rng.expovariate(rate_per_s)
        reuse = recent and rng.random() < 0.06
        tid = rng.choice(recent).tid if reuse else f"t{seed}x{i}"
        length = rng.choice([8, 31, 32, 33, 64, 100, 150, 200])
        prompt = [rng.randrange(256) for _ in range(length)]
        if reuse and rng.random() < 0.3:
            prompt = list(next(r for r in recent if r.tid == tid).prompt)  # the same prompt again
        req = RequestPlan(i, t, tid, prompt, rng.choice([1, 4, 16, 40]),
                          "G" if plan.ghost and rng.random() < 0.15 else "P")
        if rng.random() < 0.05:
            req.abort_after = rng.uniform(0.0, 3.0)
        elif rng.random() < 0.03:
            req.abort_prefill_leg = True
        plan.requests.append(req)
        recent = [*recent[-8:], req]
    end = t
    # Faults: main-thread and writer stalls around the lease (shorter, longer, and on its
    # deadline give or take a few ms), partitions, restarts, the ghost's death.
    for _ in range(rng.randint(3, 8)):
        kind = rng.choice(("stall_p", "stall_d", "stall_writer_p", "stall_writer_d"))
        seconds = rng.choice([0.3, 1.5, LEASE_S - 0.02, LEASE_S + 0.005, LEASE_S + 2.0,
                              2 * LEASE_S / 3 + rng.uniform(-0.01, 0.01)])
        plan.faults.append(FaultEvent(rng.uniform(3.0, end), kind, seconds))
    for _ in range(rng.randint(0, 2)):
        plan.faults.append(FaultEvent(rng.uniform(3.0, end), "partition",
                                      rng.choice([0.5, 2.0, LEASE_S + 1.0])))
    # Slow WRITEs (a congested link), alone or while the decoder's heartbeats stop (its
    # main thread stalled past the lease): the WRITEs outlive their lease's deadline.
    for _ in range(rng.randint(1, 3)):
        kind = rng.choice(("slow_writes", "slow_writes_d_stalled"))
        delay = rng.choice([1.0, WRITE_TIMEOUT_S - 0.5, WRITE_TIMEOUT_S + 1.0, LEASE_S + 1.0])
        plan.faults.append(FaultEvent(rng.uniform(3.0, end), kind, delay))
    if rng.random() < 0.35:
        restart = rng.choice(("restart_p", "restart_d"))
        plan.faults.append(FaultEvent(rng.uniform(end / 3, 2 * end / 3), restart))
    if plan.ghost:
        plan.faults.append(FaultEvent(rng.uniform(end / 4, end / 2), "ghost_dies"))
    plan.faults.sort(key=lambda f: f.at)
    # Corrupted landed KV, drawn apart (the draws above, and so every seed's plan from
    # before this fault existed, stay as they were): the KV check must catch each one.
    plan.corrupt = random.Random(seed * 7919 + 1).choice([0.0, 0.05, 0.1])
    return plan

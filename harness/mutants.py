"""Deliberate defects for proving the fault campaign catches them (tests only).

A harness engine started with `EngineSpec.mutant` set patches one rule of the push
state in its own process before it builds its worker. Each mutant re-creates a defect
the fork had or upstream has; tests/test_campaign.py checks the campaign fails on it.
"""

from __future__ import annotations

from typing import Any


def release_claimed() -> None:
    """The reaper releases a lease past its deadline even while its WRITE is claimed or in
    flight (upstream: vLLM's reaper does not look at the WRITEs it would free blocks under)."""
    from connector.state import leases as ledger_module

    original = ledger_module.LeaseLedger.plan_reap

    def plan_reap(self: Any, now: float, holds: Any) -> Any:
        with self._lock:
            for lease in list(self._claims.values()):
                if lease.state in (ledger_module.LeaseState.CLAIMED, ledger_module.LeaseState.WRITING) \
                        and lease.deadline <= now:
                    self._set_state(lease, ledger_module.LeaseState.HELD)
                    self._push_deadline(lease)
        return original(self, now, holds)

    ledger_module.LeaseLedger.plan_reap = plan_reap  # type: ignore[method-assign]


MUTANTS = {"release_claimed": release_claimed}


def apply(name: str) -> None:
    MUTANTS[name]()

"""The host settings a NIXL worker is built under, read from `kv_connector_extra_config` once.

Two keys, each in its own module: `nixl_progress_delay_us` (nixl_progress.py) and
`kv_transfer_cpu_affinity` (cpu_affinity.py). The connector checks them at start-up,
the fork's worker (and the benchmarks' stock connector) builds vLLM's worker under them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from connector.glue import cpu_affinity, nixl_progress

# What a bad value of either key raises (both ValueErrors naming the key).
SETTING_ERRORS = (nixl_progress.ProgressDelayError, cpu_affinity.AffinityPolicyError)


@dataclass(frozen=True)
class HostSettings:
    progress_delay_us: int | None
    affinity_policy: str

    @classmethod
    def from_extra_config(cls, get: Callable[[str, Any], Any]) -> HostSettings:
        """From `KVTransferConfig.get_from_extra_config`; raises one of SETTING_ERRORS."""
        return cls(nixl_progress.parse_delay(get(nixl_progress.EXTRA_CONFIG_KEY, None)),
                   cpu_affinity.parse_policy(get(cpu_affinity.EXTRA_CONFIG_KEY, None)))

    @contextmanager
    def applied(self) -> Iterator[tuple[bool, cpu_affinity.AffinityOutcome]]:
        """Build a NIXL worker inside: yields whether the poll delay is in force and what
        became of the building thread's cores."""
        with nixl_progress.progress_delay(self.progress_delay_us) as delayed, \
                cpu_affinity.contained_affinity(self.affinity_policy) as affinity:
            yield delayed, affinity

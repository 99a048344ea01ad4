"""How often NIXL's progress thread polls: `kv_connector_extra_config.nixl_progress_delay_us`.

NIXL's Python API (1.5) starts every agent's progress thread with a poll delay of 0 us
(`nixlAgentConfig.pthrDelay`, set inside `nixl_agent.__init__`, no argument for it):
a busy loop worth one core per vLLM worker, idle or not. On a GPU host with cores to
spare that is a latency choice. On a host with few cores per engine it takes them from
the engine's own threads: an idle P+D pair of `vllm serve` keeps a 2-core machine fully
busy (1.97 cores measured; 0.12 with a 100 us delay).

With the option set, the fork's worker builds vLLM's agent with that delay: the thread
still runs and still drives every transfer and notification, polling at most every
`delay_us` instead of continuously. Unset (the default) keeps NIXL's busy loop, as
upstream. The seam is the one call the NIXL API makes to its native binding
(`nixlBind.nixlAgent(name, config)`), wrapped only while an agent is being built.
"""

from __future__ import annotations

import logging
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from connector.settings import NIXL_PROGRESS_DELAY_US

logger = logging.getLogger(__name__)

EXTRA_CONFIG_KEY = NIXL_PROGRESS_DELAY_US.key
# More than a second between polls would stall every transfer; surely a unit mistake.
MAX_DELAY_US = 1_000_000
_LOCK = threading.RLock()
_delays: list[int] = []  # the delays in force, innermost last


class ProgressDelayError(ValueError):
    """`nixl_progress_delay_us` is not a whole number of microseconds in range."""


def parse_delay(value: Any) -> int | None:
    """The configured delay in microseconds; None (NIXL's busy loop) when unset."""
    if value is None or value == "":
        return None
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise ProgressDelayError(
            f"{EXTRA_CONFIG_KEY} must be a whole number of microseconds, got {value!r}")
    try:
        delay = int(value)
    except ValueError:
        raise ProgressDelayError(
            f"{EXTRA_CONFIG_KEY} must be a whole number of microseconds, got {value!r}") from None
    if not 0 <= delay <= MAX_DELAY_US:
        raise ProgressDelayError(
            f"{EXTRA_CONFIG_KEY} must be between 0 and {MAX_DELAY_US} microseconds, got {delay}")
    return delay


def _binding() -> Any | None:
    """NIXL's native binding module as vLLM's NixlWrapper uses it (None without NIXL)."""
    from vllm.distributed.nixl_utils import NixlWrapper

    if NixlWrapper is None:
        return None
    return getattr(sys.modules.get(NixlWrapper.__module__), "nixlBind", None)


@contextmanager
def progress_delay(delay_us: int | None) -> Iterator[bool]:
    """While inside, NIXL agents built in this process poll every `delay_us`.

    Yields whether the delay is in force (False for None, or when this NIXL has no
    such seam: then agents keep NIXL's default and a WARNING says so). Nested, the
    innermost delay wins; the lock keeps another thread's agent out meanwhile.
    """
    if delay_us is None:
        yield False
        return
    with _LOCK:
        bind = _binding()
        if getattr(bind, "nixlAgent", None) is None or not hasattr(
                getattr(bind, "nixlAgentConfig", None), "pthrDelay"):
            logger.warning("%s=%d ignored: this NIXL build has no progress-thread delay to set; "
                           "its progress thread keeps polling continuously", EXTRA_CONFIG_KEY, delay_us)
            yield False
            return
        if not _delays:
            build = bind.nixlAgent

            def build_with_delay(name: Any, config: Any) -> Any:
                config.pthrDelay = _delays[-1]
                return build(name, config)

            bind.nixlAgent = build_with_delay
        _delays.append(delay_us)
        try:
            yield True
        finally:
            _delays.pop()
            if not _delays:
                bind.nixlAgent = build

"""Peers refused for want of the secret: counted process-wide, logged once per peer.

The side-channel listener (the scheduler's process), the handshake client (a worker's
pool) and the notification router (a worker's writer) all note refusals here; whichever
stats interval of the process drains next exports them (the scheduler-role connector
and every worker drain: each refusal is counted once). The first refusal of each peer
(its address, or its NIXL agent's name) is logged at WARNING, later ones at DEBUG; the
set of peers warned about is bounded.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter

from connector.vocabulary import AuthChannel, AuthRefusal

logger = logging.getLogger(__name__)

MAX_PEERS_REMEMBERED = 1024
_lock = threading.Lock()
_counts: Counter[str] = Counter()
pending = _counts  # read-only alias: the per-step check without the lock (cleared in place)
_warned: dict[str, None] = {}


def note(channel: AuthChannel, reason: AuthRefusal, peer: str, detail: str) -> None:
    with _lock:
        _counts[f"{channel.value}|{reason.value}"] += 1
        first = peer not in _warned
        if first:
            _warned[peer] = None
            while len(_warned) > MAX_PEERS_REMEMBERED:
                _warned.pop(next(iter(_warned)))
    (logger.warning if first else logger.debug)(
        "Refused %s %s (%s): %s; counted in vllm:nixl_peer_auth_refusals_total{channel=%r,reason=%r}%s",
        "peer" if channel is AuthChannel.SIDE_CHANNEL else "a notification from", peer, reason.value,
        detail, channel.value, reason.value, " (further ones from it at DEBUG)" if first else "")


def drain() -> dict[str, int]:
    """{"channel|reason": count} since the last drain."""
    if not _counts:
        return {}
    with _lock:
        out = dict(_counts)
        _counts.clear()
    return out

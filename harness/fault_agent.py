"""Faults between a worker and its NIXL agent: what a network and a busy host do.

A pass-through wrapper of the worker's NIXL agent (the fork's probe, or vLLM's agent),
installed by a harness engine. On command it:
- drops, duplicates or delays notifications by kind (heartbeats, PUSH_REGs, PUSH_FAILs);
- partitions the engine from its peers: notifications either way are held (some
  delivered at the heal, the rest lost) and WRITEs posted meanwhile wait: they start at
  the heal, so they read P's blocks then, as a stalled transfer does;
- slows WRITEs down: those posted in a window start only a while later (a slow or
  congested link), so the blocks they read may be read long after the post;
- stalls the writer thread (its next pass sleeps), the way a starved host does;
- refuses WRITEs at posting (`make_prepped_xfer` raises), as NIXL does for a WRITE it
  cannot post;
- corrupts landed KV (D): when the last completion notification of a request arrives,
  before vLLM hears of it, one of its blocks gets one bit flipped, or the content of
  another block (another request's KV, or stale KV of a freed one), or two of its
  blocks are swapped: what a bad link, NIC, memory or a misrouted WRITE leaves
  (`corrupt_landed`; the KV check must catch each one).
Delayed and held work is released only from vLLM's own threads, inside calls vLLM
already makes to the agent (NIXL's agent is not thread-safe): a held notification at
the next `send_notif` or `get_new_notifs`, a held WRITE at the next `check_xfer_state`.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from connector.glue.wire import HEARTBEAT_PREFIX, PUSH_REG_PREFIX
from connector.vocabulary import KV_DIGEST_NOTIF_PREFIX, PUSH_FAIL_NOTIF_PREFIX

CORRUPTIONS = ("bit", "other_block", "swap")
KINDS = {"heartbeat": HEARTBEAT_PREFIX, "push_reg": PUSH_REG_PREFIX, "push_fail": PUSH_FAIL_NOTIF_PREFIX}


@dataclass
class NotifFaults:
    """Per kind of notification: probabilities of loss, duplication and delay."""

    drop: float = 0.0
    dup: float = 0.0
    delay: float = 0.0
    delay_s: tuple[float, float] = (0.05, 1.0)


@dataclass
class FaultCounts:
    dropped: int = 0
    duplicated: int = 0
    delayed: int = 0
    held: int = 0
    lost_in_partition: int = 0
    writes_held: int = 0
    corrupted: int = 0  # requests whose landed KV was changed (the three kinds below)
    corrupted_bit: int = 0
    corrupted_other_block: int = 0
    corrupted_swap: int = 0
    writer_stalls: int = 0
    writes_refused: int = 0
    by_kind: dict[str, int] = field(default_factory=dict)


class FaultyAgent:
    """See module docstring. Attributes not overridden pass straight to the agent."""

    def __init__(self, agent: Any, seed: int):
        object.__setattr__(self, "_agent", agent)
        object.__setattr__(self, "_rng", random.Random(seed))
        object.__setattr__(self, "_lock", threading.Lock())
        object.__setattr__(self, "_notif_faults", {})
        object.__setattr__(self, "_pending", [])  # (deliver_at, agent, message)
        object.__setattr__(self, "_partition_until", 0.0)
        object.__setattr__(self, "_partition_deliver", 0.5)
        object.__setattr__(self, "_held_writes", [])  # (handle, args, kwargs, start at)
        object.__setattr__(self, "_slow_until", 0.0)
        object.__setattr__(self, "_slow_by_s", 0.0)
        object.__setattr__(self, "_held_handles", set())
        object.__setattr__(self, "_stall_writer_s", 0.0)
        object.__setattr__(self, "_inbound", {})  # held inbound notifications, now due
        object.__setattr__(self, "_corrupt_rate", 0.0)
        object.__setattr__(self, "_flip", None)  # (request id, kind) -> whether the KV changed
        object.__setattr__(self, "corrupted_ids", [])
        object.__setattr__(self, "_landed", {})  # request id -> completions seen
        object.__setattr__(self, "counts", FaultCounts())

    def __getattr__(self, name: str) -> Any:
        return getattr(self._agent, name)

    # -------------------------------------------------------------- commands
    def set_notif_faults(self, faults: dict[str, NotifFaults]) -> None:
        with self._lock:
            self._notif_faults.clear()
            self._notif_faults.update(faults)

    def partition(self, seconds: float, deliver_fraction: float = 0.5) -> None:
        with self._lock:
            object.__setattr__(self, "_partition_until", time.monotonic() + seconds)
            object.__setattr__(self, "_partition_deliver", deliver_fraction)

    def slow_writes(self, window_s: float, delay_s: float) -> None:
        """WRITEs posted in the next `window_s` start `delay_s` after their post."""
        with self._lock:
            object.__setattr__(self, "_slow_until", time.monotonic() + window_s)
            object.__setattr__(self, "_slow_by_s", delay_s)

    def refuse_writes(self, n: int) -> None:
        """The next `n` WRITEs are refused when posted (`make_prepped_xfer` raises)."""
        with self._lock:
            object.__setattr__(self, "_refuse_writes", n)

    def corrupt_landed(self, rate: float, flip: Callable[[str, str], bool]) -> None:
        """Each request whose KV lands is corrupted with probability `rate`: `flip(id,
        kind)` changes its blocks (on the writer, before vLLM counts the completion)."""
        with self._lock:
            object.__setattr__(self, "_corrupt_rate", rate)
            object.__setattr__(self, "_flip", flip)

    def _corrupt(self, notifs: dict[Any, list[bytes]]) -> None:
        landed = self._landed
        for messages in notifs.values():
            for m in messages:
                if m.startswith((HEARTBEAT_PREFIX, PUSH_REG_PREFIX, PUSH_FAIL_NOTIF_PREFIX,
                                 KV_DIGEST_NOTIF_PREFIX)):
                    continue
                req_id, _, writers = m.decode("utf-8", "replace").rpartition(":")
                seen = landed[req_id] = landed.get(req_id, 0) + 1
                if not writers.isdigit() or seen != int(writers):
                    continue
                del landed[req_id]
                if self._rng.random() >= self._corrupt_rate:
                    continue
                kind = self._rng.choice(CORRUPTIONS)
                if self._flip(req_id, kind):
                    self.counts.corrupted += 1
                    setattr(self.counts, f"corrupted_{kind}", getattr(self.counts, f"corrupted_{kind}") + 1)
                    self.corrupted_ids.append(req_id)

    def make_prepped_xfer(self, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            refuse = getattr(self, "_refuse_writes", 0)
            if refuse:
                object.__setattr__(self, "_refuse_writes", refuse - 1)
                self.counts.writes_refused += 1
        if refuse:
            raise RuntimeError("injected: NIXL refused the WRITE")
        return self._agent.make_prepped_xfer(*args, **kwargs)

    def stall_writer(self, seconds: float) -> None:
        with self._lock:
            object.__setattr__(self, "_stall_writer_s", seconds)

    @property
    def partitioned(self) -> bool:
        return time.monotonic() < self._partition_until

    # ------------------------------------------------------------ notifications
    def send_notif(self, remote_agent_name: Any, *args: Any, **kwargs: Any) -> Any:
        message = kwargs["notif_msg"] if "notif_msg" in kwargs else args[0]
        self._release_due()
        kind = next((k for k, prefix in KINDS.items() if bytes(message).startswith(prefix)), None)
        now = time.monotonic()
        with self._lock:
            if now < self._partition_until:
                if self._rng.random() < self._partition_deliver:
                    self._pending.append((self._partition_until + 0.01, remote_agent_name, message))
                    self.counts.held += 1
                else:
                    self.counts.lost_in_partition += 1
                return None
            faults = self._notif_faults.get(kind) if kind else None
            copies, delay = 1, 0.0
            if faults is not None:
                roll = self._rng.random()
                if roll < faults.drop:
                    self.counts.dropped += 1
                    self.counts.by_kind[f"{kind}:dropped"] = self.counts.by_kind.get(f"{kind}:dropped", 0) + 1
                    return None
                if roll < faults.drop + faults.dup:
                    copies = 2
                    self.counts.duplicated += 1
                elif roll < faults.drop + faults.dup + faults.delay:
                    delay = self._rng.uniform(*faults.delay_s)
                    self.counts.delayed += 1
            if delay:
                self._pending.append((now + delay, remote_agent_name, message))
                return None
        result = None
        for _ in range(copies):
            result = self._agent.send_notif(remote_agent_name, notif_msg=message)
        return result

    def get_new_notifs(self) -> Any:
        stall = self._stall_writer_s
        if stall:
            object.__setattr__(self, "_stall_writer_s", 0.0)
            self.counts.writer_stalls += 1
            time.sleep(stall)  # the injected fault itself: this thread does nothing meanwhile
        self._release_due()
        notifs = self._agent.get_new_notifs()
        if notifs and self.partitioned:  # what arrives while partitioned was sent before it
            with self._lock:
                for agent, messages in notifs.items():
                    for m in messages:
                        self._pending.append((self._partition_until + 0.01, ("in", agent), m))
                        self.counts.held += 1
            return {}
        if self._inbound:
            with self._lock:
                inbound = self._inbound
                object.__setattr__(self, "_inbound", {})
            notifs = dict(notifs or {})
            for agent, messages in inbound.items():
                notifs[agent] = [*messages, *notifs.get(agent, [])]
        if notifs and self._corrupt_rate:
            self._corrupt(notifs)
        return notifs

    def _release_due(self) -> None:
        """Send (or hand back to `get_new_notifs`) what is due (a vLLM thread)."""
        if not self._pending:
            return
        now = time.monotonic()
        with self._lock:
            due = [p for p in self._pending if p[0] <= now]
            if not due:
                return
            object.__setattr__(self, "_pending", [p for p in self._pending if p[0] > now])
        inbound: dict[Any, list[bytes]] = {}
        for _, target, message in due:
            if isinstance(target, tuple) and target[0] == "in":
                inbound.setdefault(target[1], []).append(message)
                continue
            try:
                self._agent.send_notif(target, notif_msg=message)
            except Exception:  # (the peer may be gone by now: a lost notification)
                self.counts.lost_in_partition += 1
        if inbound:
            with self._lock:
                merged = dict(self._inbound)
                for agent, messages in inbound.items():
                    merged[agent] = [*merged.get(agent, []), *messages]
                object.__setattr__(self, "_inbound", merged)

    # ------------------------------------------------------------------ WRITEs
    def transfer(self, handle: Any, *args: Any, **kwargs: Any) -> Any:
        now = time.monotonic()
        start_at = self._partition_until if now < self._partition_until else (
            now + self._slow_by_s if now < self._slow_until else 0.0)
        if start_at:
            with self._lock:
                self._held_writes.append((handle, args, kwargs, start_at))
                self._held_handles.add(handle)
                self.counts.writes_held += 1
            return "PROC"
        return self._agent.transfer(handle, *args, **kwargs)

    def check_xfer_state(self, handle: Any) -> Any:
        if self._held_writes:
            now = time.monotonic()
            with self._lock:
                due = [w for w in self._held_writes if w[3] <= now and now >= self._partition_until]
                for w in due:
                    self._held_writes.remove(w)
                    self._held_handles.discard(w[0])
            for h, args, kwargs, _ in due:  # (they read P's blocks only now)
                self._agent.transfer(h, *args, **kwargs)
        if handle in self._held_handles:
            return "PROC"
        return self._agent.check_xfer_state(handle)

    def release_xfer_handle(self, handle: Any) -> Any:
        with self._lock:
            if handle in self._held_handles:  # aborted before it ever started
                self._held_handles.discard(handle)
                self._held_writes[:] = [w for w in self._held_writes if w[0] is not handle]
        return self._agent.release_xfer_handle(handle)

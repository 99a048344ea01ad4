"""What one handshake did, captured cheaply on the thread that runs it.

A `HandshakeRecord` is plain data: a few counters and a list of phase segments
(perf-counter free, epoch nanoseconds so spans can be emitted afterwards with exact
timestamps). The handshake thread only appends to it; spans and stats are built from
it once the handshake is over, so the data path never waits on telemetry.
"""

from __future__ import annotations

import re
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import zmq

from connector.vocabulary import (
    MAX_ERROR_MESSAGE,
    DescriptorList,
    Direction,
    ErrorType,
    Outcome,
    Phase,
    Trigger,
)


@dataclass
class PhaseSegment:
    """A contiguous stretch of time one handshake spent in one phase."""

    phase: Phase
    start_ns: int
    end_ns: int = 0
    remote_pp_rank: int | None = None
    remote_tp_rank: int | None = None

    @property
    def seconds(self) -> float:
        return max(0, self.end_ns - self.start_ns) / 1e9


class HandshakeError(RuntimeError):
    """A handshake failure that already knows its bounded error type."""

    def __init__(self, error_type: ErrorType, message: str):
        # Messages quote what the peer sent (engine id, hash, decoder errors): bound
        # them here, once, before they reach a log line, a span or the caller.
        if len(message) > MAX_ERROR_MESSAGE:
            message = message[:MAX_ERROR_MESSAGE] + f"... [{len(message)} chars]"
        super().__init__(message)
        self.error_type = error_type


# Phrases of vLLM's own decode failures (payload or metadata could not be decoded).
# A bare "decode" is not enough: vLLM's configuration errors name the decode engine
# ("... on prefill and decode", "... between prefill and decode").
_DECODE_FAILURE = re.compile(r"failed to decode|could not decode|unable to decode|decodeerror|"
                             r"invalid (?:msgpack|payload)")
# Phrases of vLLM's P/D configuration checks raised as RuntimeError (0.33 adds several:
# packed KV rows, head-sharded drafts, NVFP4 re-sharding; 0.34 its region pairing: a peer
# whose regions do not pair with this worker's layers).
_CONFIG_MISMATCH = re.compile(r"differ between|must match|not supported|does not support|"
                              r"\brequires?\b|expects same|use matching|use the same|needs the same|"
                              r"kv region metadata of different lengths|did not advertise the layers|"
                              r"does not hold the kv layers|has no counterpart here|"
                              r"lay out their kv regions differently")


def classify_error(exc: BaseException) -> ErrorType:
    """Map an exception from a handshake onto the bounded `ErrorType` set."""
    if isinstance(exc, HandshakeError):
        return exc.error_type
    if isinstance(exc, zmq.Again | TimeoutError):
        return ErrorType.TIMEOUT
    text = str(exc).lower()
    if "compatibility hash" in text:
        return ErrorType.COMPAT_HASH_MISMATCH
    if "engine id mismatch" in text:
        return ErrorType.ENGINE_ID_MISMATCH
    if isinstance(exc, UnicodeDecodeError) or "decodeerror" in type(exc).__name__.lower() \
            or _DECODE_FAILURE.search(text):
        return ErrorType.DECODE_ERROR
    if isinstance(exc, NotImplementedError | ValueError | AssertionError):
        return ErrorType.CONFIG_MISMATCH
    if "nixl" in type(exc).__module__.lower():  # raised by NIXL itself
        return ErrorType.NIXL_ERROR
    if isinstance(exc, RuntimeError) and _CONFIG_MISMATCH.search(text):
        return ErrorType.CONFIG_MISMATCH
    if "nixl" in text:
        return ErrorType.NIXL_ERROR
    return ErrorType.OTHER


@dataclass
class HandshakeRecord:
    """One handshake from submission to its end, as data."""

    direction: Direction
    trigger: Trigger
    notif_only: bool
    remote_engine_id: str
    host: str
    port: int
    remote_tp_size: int
    remote_pp_size: int
    local_tp_rank: int
    local_engine_id: str = ""
    upgrade: bool = False
    attempt: int = 1
    after_reset: str = ""  # PeerReset value when this handshake replaces a dropped connection
    peer_restarted: bool = False  # the peer came back with a new NIXL agent
    authenticated: bool = False  # the side channel proved the deployment's secret both ways
    # A failed attempt the handshake retries: its phase failure and any descriptors it
    # prepared count, the handshake itself counts once, with its final attempt.
    retried: bool = False
    submitted_ns: int = field(default_factory=time.time_ns)
    ended_ns: int = 0
    segments: list[PhaseSegment] = field(default_factory=list)
    outcome: Outcome | None = None
    error_type: ErrorType | None = None
    failed_phase: Phase | None = None
    error_message: str = ""
    registrations: dict[DescriptorList, int] = field(
        default_factory=lambda: dict.fromkeys(DescriptorList, 0)
    )
    descriptors: dict[DescriptorList, int] = field(
        default_factory=lambda: dict.fromkeys(DescriptorList, 0)
    )
    saved_registrations: int = 0
    saved_descriptors: int = 0
    nothing_saved_because: str = ""  # NoSaving value, when a full handshake prepares nothing
    # OTel context of whoever triggered the handshake (not serialized).
    parent_context: Any = None
    # Ids of the emitted spans (hex), for exemplars; empty when tracing is off.
    trace_id: str = ""
    span_id: str = ""
    phase_span_ids: dict[str, str] = field(default_factory=dict)
    _rank: tuple[int | None, int | None] = (None, None)

    # -- phase clock (called only on the handshake thread) ---------------------
    @property
    def current_phase(self) -> Phase | None:
        seg = self.segments[-1] if self.segments else None
        return seg.phase if seg is not None and seg.end_ns == 0 else None

    def set_rank(self, remote_pp_rank: int | None, remote_tp_rank: int | None) -> None:
        self._rank = (remote_pp_rank, remote_tp_rank)

    def enter(self, phase: Phase, now_ns: int | None = None) -> None:
        """Close the open segment (if any) and start one for `phase`."""
        now = time.time_ns() if now_ns is None else now_ns
        if self.segments and self.segments[-1].end_ns == 0:
            open_seg = self.segments[-1]
            if open_seg.phase == phase and (
                open_seg.remote_pp_rank,
                open_seg.remote_tp_rank,
            ) == self._rank:
                return
            open_seg.end_ns = now
        pp, tp = self._rank
        self.segments.append(PhaseSegment(phase, now, 0, pp, tp))

    def close_phase(self, now_ns: int | None = None) -> None:
        if self.segments and self.segments[-1].end_ns == 0:
            self.segments[-1].end_ns = time.time_ns() if now_ns is None else now_ns

    def count_registration(self, which: DescriptorList, num_descriptors: int) -> None:
        self.registrations[which] += 1
        self.descriptors[which] += num_descriptors

    def finish(self, exc: BaseException | None = None) -> None:
        now = time.time_ns()
        failed_phase = self.current_phase
        self.close_phase(now)
        self.ended_ns = now
        if exc is None:
            self.outcome = Outcome.SUCCESS
            return
        self.outcome = Outcome.FAILURE
        self.error_type = classify_error(exc)
        self.failed_phase = failed_phase or (
            self.segments[-1].phase if self.segments else Phase.QUEUE_WAIT
        )
        self.error_message = f"{type(exc).__name__}: {exc}"[:500]

    # -- derived views ---------------------------------------------------------
    @property
    def duration_s(self) -> float:
        return max(0, self.ended_ns - self.submitted_ns) / 1e9

    def phase_seconds(self) -> dict[str, float]:
        """Total seconds per phase that ran, summed over ranks and segments."""
        totals: dict[str, float] = {}
        for seg in self.segments:
            totals[seg.phase.value] = totals.get(seg.phase.value, 0.0) + seg.seconds
        return totals

    def to_stats(self) -> dict[str, Any]:
        """Compact, msgpack-friendly summary for vLLM's stats path.

        Span ids ride along (never as labels) only when the spans were emitted.
        """
        out = {
            "direction": self.direction.value,
            "trigger": self.trigger.value,
            "notif_only": self.notif_only,
            "upgrade": self.upgrade,
            "attempt": self.attempt,
            "outcome": (self.outcome or Outcome.FAILURE).value,
            "error_type": self.error_type.value if self.error_type else None,
            "failed_phase": self.failed_phase.value if self.failed_phase else None,
            "duration": self.duration_s,
            "phases": self.phase_seconds(),
            "registrations": {k.value: v for k, v in self.registrations.items()},
            "descriptors": {k.value: v for k, v in self.descriptors.items()},
            "saved_registrations": self.saved_registrations,
            "saved_descriptors": self.saved_descriptors,
        }
        if self.retried:
            out["retried"] = True
        if self.trace_id:
            out["trace_id"] = self.trace_id
            out["span_id"] = self.span_id
            out["phase_span_ids"] = dict(self.phase_span_ids)
        return out


class ActiveRecord:
    """The record of the handshake running on the current thread, if any.

    The NIXL probe and the add_remote_agent hooks look it up here; outside a
    handshake they see None and do nothing.
    """

    _local = threading.local()

    @classmethod
    def get(cls) -> HandshakeRecord | None:
        return getattr(cls._local, "record", None)

    @classmethod
    def set(cls, record: HandshakeRecord | None) -> None:
        cls._local.record = record

"""P's KV leases and the WRITEs that read them, under one lock.

A lease holds a finished prefill's blocks for its decoder. vLLM keeps the deadline
in its worker's `_reqs_to_send` and releases what is past it in its reaper, on the
engine's main thread; heartbeats (read by the writer thread) extend it, and the
writer WRITEs from the blocks. Those three used to meet in vLLM's map with no common
lock, so a WRITE could be refused for a lease a heartbeat had just renewed, or start
from blocks the reaper had just released. Here the ledger is the authority:

- the writer renews (heartbeats) and claims (a matching PUSH_REG) under the lock;
- the main thread asks the ledger which leases to release (`plan_reap`) and vLLM's
  reaper then releases exactly those (the worker sets vLLM's deadlines to match);
- a claimed lease is never released until its WRITE settled: done on every rank,
  failed on every rank, or aborted after `write_timeout_s`;
- a WRITE is refused only for a lease that was really released, never because a
  deadline looked past on a stale copy;
- a PUSH_FAIL is owed only once every rank's WRITE of the request settled.

The state machine is the table in docs/architecture.md ("Push state"). Methods say
which thread calls them; none calls out while holding the lock. What a step costs grows
with what changed, not with the leases held: HELD deadlines sit in a heap (reaping
pops what is due), claimed leases in claim order (timeouts look at the oldest only),
and WRITEs posted, leases failed and claims per decoder in their own indexes.
"""

from __future__ import annotations

import heapq
import re
import threading
from collections import OrderedDict
from collections.abc import Callable, Container, Iterable
from dataclasses import dataclass, field
from typing import Any

from connector.vocabulary import LeaseFate, LeaseRenewal, LeaseState, PushFailReason, PushRegRejection

# Bound on requests (and tombstones) the ledger tracks; past it the oldest go.
MAX_LEASES = 65536
MAX_RENEWALS_KEPT = 32

# The ids vLLM's OpenAI server gives a request from its `X-Request-Id` (before the
# engine adds its `-<8 hex>` suffix): completions `cmpl-<id>-<prompt index>`, chat
# `chatcmpl-<id>`.
_ROUTER_ID = (re.compile(r"cmpl-(.+)-\d+"), re.compile(r"chatcmpl-(.+)"))

_LIVE = frozenset({LeaseState.HELD, LeaseState.CLAIMED, LeaseState.POSTING, LeaseState.WRITING})
_CLAIMED = frozenset({LeaseState.CLAIMED, LeaseState.POSTING, LeaseState.WRITING})
_POSTED = frozenset({LeaseState.POSTING, LeaseState.WRITING})


def request_keys(req_id: str, base_of: Callable[[str], str]) -> tuple[str, ...]:
    """The keys one of P's request ids is known by: itself, its base id, and the id
    the router sent when vLLM's OpenAI server derived the base from it."""
    base = base_of(req_id)
    keys = [req_id, base] if base != req_id else [req_id]
    for pattern in _ROUTER_ID:
        match = pattern.fullmatch(base)
        if match:
            keys.append(match[1])
            break
    return tuple(keys)


@dataclass(slots=True)
class Lease:
    """One lease; fields other than the key ones are read under the ledger's lock."""

    req_id: str
    keys: tuple[str, ...]
    deadline: float  # vLLM's clock (perf_counter) while HELD
    granted_at: float  # monotonic
    digest: str | None = None
    state: LeaseState = LeaseState.HELD
    renewals: list[int] = field(default_factory=list)  # wall-clock ns, for span events
    wanted: bool = False  # a decoder heartbeated for it
    want_d: float | None = None  # latest "still wanted" time, in the decoder's clock
    d_request_id: str | None = None
    engine: str | None = None  # the decoder engine it is pushed to
    reg: dict[str, Any] | None = None
    claimed_at: float = 0.0  # perf_counter
    granted_pc: float = 0.0  # perf_counter at grant (prefill done), for the stage figures
    posted_pc: float = 0.0  # perf_counter when its WRITE started posting
    handles: int = 0
    failure: PushFailReason | None = None
    # The push counters (once per request, whatever the ranks): its WRITE was posted
    # (`posted` said so), and its push was counted failed (`push_failed` said so).
    started: bool = False
    failed_counted: bool = False


@dataclass(frozen=True, slots=True)
class Refusal:
    """Why P does not WRITE for a PUSH_REG (counted as `rejection`, told as `reason`)."""

    rejection: PushRegRejection | None
    reason: PushFailReason
    detail: str
    answer: bool = True  # tell the decoder (a duplicate of one being handled: no)


@dataclass(frozen=True, slots=True)
class Released:
    """A lease the reaper releases this step, with what P knew of it."""

    req_id: str
    fate: LeaseFate
    late: bool  # its deadline had passed before the previous reaper pass


@dataclass(frozen=True, slots=True)
class Settled:
    """A claimed lease whose WRITE settled this step."""

    req_id: str
    pushed: bool
    failure: PushFailReason | None
    # perf_counter times of its stages (0.0: not seen): granted, WRITE posting, claimed,
    # and this settle; the caller turns them into TTFT stage figures.
    granted: float = 0.0
    posted: float = 0.0
    claimed: float = 0.0
    at: float = 0.0


class LeaseLedger:
    """See module docstring. `base_of` strips vLLM's per-engine request id suffix."""

    def __init__(self, *, lease_s: float, extension_s: float, write_timeout_s: float,
                 margin_s: float, base_of: Callable[[str], str], limit: int = MAX_LEASES):
        self.lease_s = lease_s
        self.extension_s = extension_s
        self.write_timeout_s = write_timeout_s
        self.margin_s = margin_s
        self._base_of = base_of
        self._limit = limit
        self._lock = threading.Lock()
        self._leases: OrderedDict[str, Lease] = OrderedDict()
        # Any key -> the live (or prefilling) P request ids it names: a tuple (one id, as a
        # rule; a set per key cost 200 bytes a lease).
        self._by_key: dict[str, tuple[str, ...]] = {}
        self._prefilling: dict[str, tuple[str, ...]] = {}  # in the batch, not finished
        # D request id -> what became of its PUSH_REG ("pending", "claimed", "pushed",
        # "failed", "refused") and, for the last two, what its decoder was told: a
        # duplicate (or a decoder sending it again) is recognised, not acted on twice.
        self._registrations: OrderedDict[str, tuple[str, PushFailReason | None]] = OrderedDict()
        self._pending_bases: dict[str, str] = {}  # base id -> the D request waiting on it
        self._ended_keys: OrderedDict[str, bool] = OrderedDict()  # key -> released (True) / pushed
        self._owed: list[tuple[dict[str, Any], PushFailReason]] = []
        # Indexes kept with every state change (`_set_state`), so a step looks only at
        # what is due: HELD deadlines (a heap; an entry whose lease moved on or got a
        # later deadline is skipped when popped), claims in claim order, WRITEs posting
        # or in flight, FAILED leases the next reap releases, claims per decoder engine.
        self._deadlines: list[tuple[float, int, str]] = []
        self._pushed_deadlines = 0  # (a tie-breaker: heap entries never compare leases)
        self._claims: OrderedDict[str, Lease] = OrderedDict()
        self._posted: dict[str, Lease] = {}
        self._failed: dict[str, Lease] = {}
        self._by_engine: dict[str, set[str]] = {}
        self._live = 0  # leases HELD, CLAIMED, POSTING or WRITING
        self._writes = 0  # leases WRITING
        self._last_reap = 0.0
        # Counters of what the ledger kept from happening (read by tests and stats).
        self.claimed_past_deadline = 0

    # ------------------------------------------------------------------ views
    def __len__(self) -> int:
        return len(self._leases)

    @property
    def owes(self) -> bool:
        """PUSH_FAILs wait to be sent (a truth test, no lock)."""
        return bool(self._owed)

    def state_of(self, req_id: str) -> LeaseState | None:
        with self._lock:
            lease = self._leases.get(req_id)
            return None if lease is None else lease.state

    def snapshot(self) -> dict[str, Any]:
        """Counts by state (tests, the campaign's end-of-run checks)."""
        with self._lock:
            counts: dict[str, int] = {}
            for lease in self._leases.values():
                counts[lease.state.value] = counts.get(lease.state.value, 0) + 1
            return {"leases": counts, "prefilling": len(self._prefilling),
                    "registrations": len(self._registrations), "owed": len(self._owed),
                    "ended_keys": len(self._ended_keys)}

    def oldest_held(self, now_mono: float) -> tuple[int, float]:
        """(live leases, age of the oldest in s). Leases are kept in grant order: the
        oldest live one is the first found (what precedes it has ended this step)."""
        with self._lock:
            oldest = next((lease.granted_at for lease in self._leases.values()
                           if lease.state in _LIVE), now_mono)
            return self._live, now_mono - oldest

    def lease_history(self, req_id: str) -> tuple[list[int], LeaseFate | None]:
        """Renewal times (ns) and, if it was released unpushed, its fate."""
        with self._lock:
            lease = self._leases.get(req_id)
            if lease is None:
                return [], None
            fate = self._fate(lease) if lease.state is LeaseState.RELEASED else None
            return list(lease.renewals), fate

    # ------------------------------------------------------------ main thread
    def grant(self, deadlines: dict[str, float], digests: dict[str, str] | None,
              now_mono: float, now: float = 0.0) -> None:
        """Leases vLLM starts this step (its `_reqs_to_send` deadlines); `now`: the
        perf_counter time, kept for the prefill-done-to-WRITE stage."""
        with self._lock:
            for req_id, deadline in deadlines.items():
                lease = self._leases.get(req_id)
                if lease is not None and lease.state in _LIVE:
                    continue
                if lease is not None:  # (an ended one of the same id: replaced)
                    self._drop(lease)
                keys = self._prefilling.pop(req_id, None) or request_keys(req_id, self._base_of)
                lease = Lease(req_id, keys, deadline, now_mono, (digests or {}).get(req_id),
                              granted_pc=now)
                self._leases[req_id] = lease
                self._live += 1
                self._push_deadline(lease)
                for key in keys:
                    self._index(key, req_id)
            self._trim()

    def note_batch(self, added: Iterable[str], removed: Iterable[str]) -> None:
        """Requests P started (or stopped) prefilling for a decoder."""
        with self._lock:
            for req_id in added:
                if req_id not in self._prefilling and req_id not in self._leases:
                    keys = request_keys(req_id, self._base_of)
                    self._prefilling[req_id] = keys
                    for key in keys:
                        self._index(key, req_id)
            for req_id in removed:
                keys = self._prefilling.pop(req_id, None)
                if keys is not None and req_id not in self._leases:
                    self._unindex(req_id, keys)
            while len(self._prefilling) > self._limit:
                req_id, keys = next(iter(self._prefilling.items()))
                del self._prefilling[req_id]
                self._unindex(req_id, keys)

    def plan_reap(self, now: float, holds: Container[str]) -> list[Released]:
        """The leases vLLM's reaper releases now (of those it `holds`): HELD past its
        deadline, and FAILED (nothing in flight any more). Marked RELEASED here, under
        the lock: a claim racing this step finds it gone. Only what is due is looked at
        (the deadline heap, the failed index)."""
        released: list[Released] = []
        with self._lock:
            previous = self._last_reap
            self._last_reap = now
            for lease in list(self._failed.values()):
                if lease.req_id in holds:
                    released.append(Released(lease.req_id, self._fate(lease), False))
                    self._end(lease, LeaseState.RELEASED)
            heap = self._deadlines
            while heap and heap[0][0] <= now:
                deadline, _, req_id = heapq.heappop(heap)
                lease = self._leases.get(req_id)
                if lease is None or lease.state is not LeaseState.HELD or lease.deadline < deadline:
                    continue  # (moved on; or an earlier entry of its own stood for it)
                if lease.deadline > now:  # renewed since its entry was pushed: it moves
                    self._push_deadline(lease)
                    continue
                if req_id not in holds:
                    continue  # (vLLM let it go this step: its end reaches `ended`)
                released.append(Released(req_id, self._fate(lease), deadline < previous))
                self._end(lease, LeaseState.RELEASED)
        return released

    def ids_known_by(self, key: str) -> tuple[str, ...]:
        """P's live (or prefilling) request ids known by `key` (an id, base id or router
        id): how the writer finds a PUSH_REG's finished blocks without a scan."""
        with self._lock:
            return tuple(self._by_key.get(key, ()))

    def registration_waiting(self, base: str) -> str | None:
        """The decoder request whose PUSH_REG waits for a prefill of this base id."""
        with self._lock:
            return self._pending_bases.get(base)

    def deadline_of(self, req_id: str) -> float | None:
        """A HELD lease's deadline (None otherwise)."""
        with self._lock:
            lease = self._leases.get(req_id)
            return lease.deadline if lease is not None and lease.state is LeaseState.HELD else None

    def unknown(self, held: Iterable[str]) -> list[str]:
        """Of vLLM's held leases, those the ledger does not know (none, unless something
        granted a lease past the ledger: they keep vLLM's own rule)."""
        with self._lock:
            return [req_id for req_id in held if req_id not in self._leases]

    @property
    def writing(self) -> bool:
        """Some WRITE is posted and not settled (a truth test for the per-step check)."""
        return self._writes > 0

    def reconcile(self, granted: Iterable[str], held: dict[str, float]) -> None:
        """Main, after vLLM's `start_load_kv`: a lease granted ahead of it that vLLM did
        not start is dropped; the others take vLLM's exact deadline."""
        with self._lock:
            for req_id in granted:
                lease = self._leases.get(req_id)
                if lease is None or lease.state is not LeaseState.HELD:
                    continue
                deadline = held.get(req_id)
                if deadline is None:
                    self._drop(lease)
                    self._unindex(req_id, lease.keys)
                else:
                    new = max(lease.deadline, deadline) if lease.wanted else deadline
                    if new < lease.deadline:
                        self._push_deadline(lease, new)  # (earlier than its heap entry)
                    lease.deadline = new

    def settle(self, finished_sending: Iterable[str], open_writes: set[str],
               now: float = 0.0) -> list[Settled]:
        """After vLLM's step: WRITEs done (vLLM reported the request) or settled without
        success (no handle left open, not reported). The caller reads `open_writes` and
        calls this under vLLM's `_sending_transfers_lock`: the writer publishes handles
        under it before `posted`, so no lease turns WRITING between the read and here."""
        done = set(finished_sending)
        out: list[Settled] = []
        with self._lock:
            # POSTING and done: vLLM publishes a request's handles at the end of its
            # posting call, and this step's poll found them all done before the writer
            # called `posted` (which then finds the lease over).
            for lease in list(self._posted.values()):
                if lease.req_id in done:
                    self._end(lease, LeaseState.PUSHED)
                    out.append(Settled(lease.req_id, True, None, lease.granted_pc,
                                       lease.posted_pc, lease.claimed_at, now))
                elif lease.state is LeaseState.WRITING and lease.req_id not in open_writes:
                    self._fail(lease, lease.failure or PushFailReason.PUSH_FAILED)
                    out.append(Settled(lease.req_id, False, lease.failure))
            for req_id in done:  # pushed by a path the ledger did not see claimed
                lease = self._leases.get(req_id)
                if lease is not None and lease.state in (LeaseState.HELD, LeaseState.CLAIMED):
                    self._end(lease, LeaseState.PUSHED)
        return out

    def overdue(self, now: float) -> list[str]:
        """Claims past `write_timeout_s`: a CLAIMED one fails here (its writer has not
        posted; it will not now); WRITING ones are returned for the caller to abort."""
        limit = now - self.write_timeout_s
        abort: list[str] = []
        if not self._claims:
            return abort
        with self._lock:
            due = []
            for lease in self._claims.values():  # (in claim order: the oldest first)
                if lease.claimed_at > limit:
                    break
                due.append(lease)
            for lease in due:
                if lease.state is LeaseState.CLAIMED:
                    self._fail(lease, PushFailReason.WRITE_TIMEOUT)
                elif lease.state is LeaseState.WRITING:
                    lease.failure = PushFailReason.WRITE_TIMEOUT
                    abort.append(lease.req_id)
        return abort

    def aborted(self, req_id: str) -> None:
        """Main: the WRITE's handles were released by NIXL (nothing moves any more)."""
        with self._lock:
            lease = self._leases.get(req_id)
            if lease is not None and lease.state is LeaseState.WRITING:
                self._fail(lease, PushFailReason.WRITE_TIMEOUT)

    def ended(self, req_ids: Iterable[str]) -> list[str]:
        """Main: vLLM reported these requests done sending (pushed or released).
        Returns those whose push completed: posted, never counted failed."""
        completed = []
        with self._lock:
            for req_id in req_ids:
                lease = self._leases.get(req_id)
                if lease is not None:
                    if lease.state in _LIVE:
                        self._end(lease, LeaseState.PUSHED)
                    if lease.started and not lease.failed_counted:
                        completed.append(req_id)
                self._prefilling.pop(req_id, None)
        return completed

    def forget(self, req_id: str) -> None:
        """Main: the ended lease's telemetry is done with; its tombstone stays."""
        with self._lock:
            lease = self._leases.get(req_id)
            if lease is not None and lease.state not in _LIVE:
                self._drop(lease)

    # ----------------------------------------------------------- writer thread
    def renew(self, hb_ids: Iterable[str], want_d: float | None, now: float,
              stamp_ns: int) -> tuple[dict[str, int], int]:
        """A heartbeat: extend the leases it names. Returns (outcome counts by
        LeaseRenewal value, leases renewed)."""
        new_deadline = now + self.extension_s
        outcomes: dict[str, int] = {}
        renewed = 0
        with self._lock:
            for hb_id in hb_ids:
                targets = self._live_for(hb_id)
                if targets:
                    for lease in targets:
                        if lease.state is LeaseState.HELD and new_deadline > lease.deadline:
                            lease.deadline = new_deadline  # (its heap entry is moved when popped)
                        lease.wanted = True
                        if want_d is not None and (lease.want_d is None or want_d > lease.want_d):
                            lease.want_d = want_d
                        if len(lease.renewals) < MAX_RENEWALS_KEPT:
                            lease.renewals.append(stamp_ns)
                        renewed += 1
                    outcome = LeaseRenewal.RENEWED
                elif self._prefilling_for(hb_id):
                    outcome = LeaseRenewal.PREFILLING
                elif any(key in self._ended_keys for key in self._hb_keys(hb_id)):
                    outcome = LeaseRenewal.ALREADY_DONE
                else:
                    outcome = LeaseRenewal.UNKNOWN_REQUEST
                outcomes[outcome.value] = outcomes.get(outcome.value, 0) + 1
        return outcomes, renewed

    def intake(self, d_request_id: str) -> Refusal | None:
        """A PUSH_REG arrived: None to go on, or why it is dropped or refused.

        A duplicate (the same decoder request again) is dropped. One that names a
        base id another decoder request is already waiting on, or that two live
        requests of P share, is refused. One whose lease is gone is late.
        """
        base = self._base_of(d_request_id)
        with self._lock:
            seen = self._registrations.get(d_request_id)
            if seen is not None:
                status, told = seen
                # Refused or failed before: the decoder may have missed the answer (it
                # sends its PUSH_REG again while it waits), so it is told again.
                return Refusal(PushRegRejection.DUPLICATE, told or PushFailReason.LEASE_EXPIRED,
                               f"registered already ({status})", answer=told is not None)
            waiting = self._pending_bases.get(base)
            live = self._live_ids(base)
            if (waiting is not None and waiting != d_request_id) or len(live) > 1:
                self._note_registration(d_request_id, "refused", PushFailReason.AMBIGUOUS)
                return Refusal(PushRegRejection.AMBIGUOUS, PushFailReason.AMBIGUOUS,
                               f"{len(live)} live prefill request(s) and "
                               f"{int(waiting is not None)} other registration share its id")
            if not live and self._ended_keys.get(base):
                self._note_registration(d_request_id, "refused", PushFailReason.LEASE_EXPIRED)
                return Refusal(PushRegRejection.AFTER_LEASE, PushFailReason.LEASE_EXPIRED,
                               "this prefill's KV lease for it ended before the PUSH_REG arrived")
            self._note_registration(d_request_id, "pending")
            self._pending_bases[base] = d_request_id
        return None

    def claim(self, p_request_id: str, reg: dict[str, Any], d_digest: str | None,
              want_d: float | None, now: float) -> Refusal | None:
        """The writer matched a PUSH_REG to P's finished blocks: claim the lease (None)
        or refuse. A HELD lease is claimable whatever its deadline says: only the
        reaper releases, through `plan_reap`."""
        d_id = reg["request_id"]
        with self._lock:
            self._pending_bases.pop(self._base_of(d_id), None)
            lease = self._leases.get(p_request_id)
            refusal = None
            if lease is None or lease.state is LeaseState.RELEASED:
                refusal = Refusal(PushRegRejection.AFTER_LEASE, PushFailReason.LEASE_EXPIRED,
                                  "the KV lease ended before the WRITE could start")
            elif lease.state is not LeaseState.HELD:
                refusal = Refusal(PushRegRejection.AMBIGUOUS, PushFailReason.AMBIGUOUS,
                                  f"the prefill is {lease.state.value} by another registration")
            elif len(self._live_ids(self._base_of(p_request_id))) > 1:
                refusal = Refusal(PushRegRejection.AMBIGUOUS, PushFailReason.AMBIGUOUS,
                                  "two live prefill requests share its id")
            elif d_digest is not None and lease.digest is not None and d_digest != lease.digest:
                refusal = Refusal(PushRegRejection.PROMPT_MISMATCH, PushFailReason.PROMPT_MISMATCH,
                                  "its prompt differs from the prefill request of that id")
            if refusal is not None:
                self._note_registration(d_id, "refused", refusal.reason)
                return refusal
            assert lease is not None
            if lease.deadline <= now:
                self.claimed_past_deadline += 1
            lease.claimed_at = now
            lease.reg = reg
            lease.d_request_id = d_id
            lease.engine = reg.get("decode_engine_id")
            self._set_state(lease, LeaseState.CLAIMED)
            if want_d is not None and (lease.want_d is None or want_d > lease.want_d):
                lease.want_d = want_d
            self._note_registration(d_id, "claimed")
        return None

    def begin_post(self, p_request_id: str, d_clock_offset: float | None,
                   now: float) -> Refusal | None:
        """The writer is about to post the claimed lease's WRITEs: None to go on (the
        lease is POSTING), or a Refusal (the lease then FAILED, its PUSH_FAIL owed)."""
        with self._lock:
            lease = self._leases.get(p_request_id)
            if lease is None or lease.state is not LeaseState.CLAIMED:
                return Refusal(None, PushFailReason.WRITE_TIMEOUT,
                               f"the claim ended before the WRITE ({lease.state.value if lease else 'gone'})")
            # (The decoder's clock = ours + offset.) The decoder keeps given-up blocks a
            # lease plus the WRITE timeout after its last "still wanted": a WRITE
            # posted later than a lease after it could outlive them.
            if (lease.want_d is not None and d_clock_offset is not None
                    and now + d_clock_offset > lease.want_d + self.lease_s - self.margin_s):
                refusal = Refusal(None, PushFailReason.REGISTRATION_STALE,
                                  "the decoder last asked for this KV more than a lease ago")
                self._fail(lease, refusal.reason)
                return refusal
            self._set_state(lease, LeaseState.POSTING)
            lease.posted_pc = now
        return None

    def unpost(self, p_request_id: str) -> None:
        """The writer posted nothing after all (its decoder's connection is being
        dropped): POSTING back to CLAIMED, to be posted after the drop."""
        with self._lock:
            lease = self._leases.get(p_request_id)
            if lease is not None and lease.state is LeaseState.POSTING:
                self._set_state(lease, LeaseState.CLAIMED)

    def wrote(self, p_request_id: str) -> bool:
        """The writer got a WRITE handle for the request (before vLLM publishes it: vLLM
        may report it done at once). True the first time: count its push started."""
        with self._lock:
            lease = self._leases.get(p_request_id)
            if lease is None or lease.started:
                return lease is None
            lease.started = True
            return True

    def posted(self, p_request_id: str, handles: int) -> None:
        """The writer published the lease's WRITE handles (none: the push failed)."""
        with self._lock:
            lease = self._leases.get(p_request_id)
            if lease is None or lease.state is not LeaseState.POSTING:
                return  # (vLLM reported it done first: PUSHED already)
            if handles > 0:
                self._set_state(lease, LeaseState.WRITING)
                lease.handles = handles
            else:
                self._fail(lease, PushFailReason.PUSH_FAILED)

    def push_failed(self, p_request_id: str) -> bool:
        """The push of this request failed: True the first time (count it once)."""
        with self._lock:
            lease = self._leases.get(p_request_id)
            if lease is None:
                return True
            first = not lease.failed_counted
            lease.failed_counted = True
            return first

    def fail(self, p_request_id: str, reason: PushFailReason) -> bool:
        """A claim that posted nothing ends (handshake or set-up failed); for WRITING
        leases, the reason is kept for when its WRITEs settle. True if it failed now."""
        with self._lock:
            lease = self._leases.get(p_request_id)
            if lease is None:
                return False
            if lease.state in (LeaseState.CLAIMED, LeaseState.POSTING):
                self._fail(lease, reason)
                return True
            if lease.state is LeaseState.WRITING and lease.failure is None:
                lease.failure = reason
            return False

    def take_owed(self) -> list[tuple[dict[str, Any], PushFailReason]]:
        """Writer: the PUSH_FAILs to send now (each once)."""
        if not self._owed:
            return []
        with self._lock:
            owed, self._owed = self._owed, []
        return owed

    def owe(self, reg: dict[str, Any], reason: PushFailReason) -> None:
        """A PUSH_FAIL for a registration P never claimed (refused, unmatched)."""
        with self._lock:
            self._note_registration(reg.get("request_id", ""), "refused", reason)
            self._owed.append((reg, reason))

    def owe_again(self, reg: dict[str, Any], reason: PushFailReason) -> None:
        """A PUSH_FAIL that reached none of its decoder's agents, owed again now that the
        connection was replaced (connector/state/connections.py parked it)."""
        with self._lock:
            self._owed.append((reg, reason))

    def unmatched(self, d_request_id: str) -> None:
        """The writer gave up waiting for a prefill for this registration."""
        with self._lock:
            base = self._base_of(d_request_id)
            if self._pending_bases.get(base) == d_request_id:
                del self._pending_bases[base]
            self._note_registration(d_request_id, "refused", PushFailReason.NO_PREFILL)

    # ------------------------------------------------------------ any thread
    def posting_to(self, engine_id: str) -> bool:
        """Main, dropping the connection to `engine_id`: some WRITE to it is being
        posted or in flight (the drop waits; see connections.py for the order)."""
        with self._lock:
            claims = self._by_engine.get(engine_id, ())
            return any(self._claims[req_id].state in _POSTED for req_id in claims)

    def target_of(self, req_id: str) -> str | None:
        """The decoder engine a claimed lease is pushed to."""
        with self._lock:
            lease = self._leases.get(req_id)
            return None if lease is None else lease.engine

    def writes_to(self, engine_id: str) -> bool:
        """Some lease pushed to `engine_id` is claimed, posting or in flight."""
        with self._lock:
            return bool(self._by_engine.get(engine_id))

    # -------------------------------------------------------------- internals
    def _hb_keys(self, hb_id: str) -> tuple[str, ...]:
        base = self._base_of(hb_id)
        return (hb_id, base) if base != hb_id else (hb_id,)

    def _live_for(self, hb_id: str) -> list[Lease]:
        """The live leases a heartbeat id names (by internal, base or router id)."""
        ids = self._by_key.get(hb_id)  # (the usual case: no base id to compute)
        if ids:
            found = [self._leases[r] for r in ids if r in self._leases and self._leases[r].state in _LIVE]
            if found:
                return found
        for key in self._hb_keys(hb_id)[1:]:
            found = [self._leases[r] for r in self._by_key.get(key, ())
                     if r in self._leases and self._leases[r].state in _LIVE]
            if found:
                return found
        return []

    def _prefilling_for(self, hb_id: str) -> bool:
        return any(r in self._prefilling for key in self._hb_keys(hb_id)
                   for r in self._by_key.get(key, ()))

    def _live_ids(self, base: str) -> set[str]:
        ids = self._by_key.get(base, ())
        return {r for r in ids if r in self._prefilling
                or (r in self._leases and self._leases[r].state in _LIVE)}

    def _fate(self, lease: Lease) -> LeaseFate:
        if lease.failure is not None and lease.failure is not PushFailReason.LEASE_EXPIRED:
            return LeaseFate.PUSH_FAILED
        if lease.d_request_id is not None:
            return LeaseFate.REGISTERED
        return LeaseFate.WAITING if lease.wanted else LeaseFate.UNCLAIMED

    def _fail(self, lease: Lease, reason: PushFailReason) -> None:
        self._set_state(lease, LeaseState.FAILED)
        lease.failure = reason
        if lease.d_request_id is not None:
            self._registrations[lease.d_request_id] = ("failed", reason)
        if lease.reg is not None:
            self._owed.append((lease.reg, reason))

    def _end(self, lease: Lease, state: LeaseState) -> None:
        self._set_state(lease, state)
        if lease.d_request_id is not None and state is LeaseState.PUSHED:
            self._registrations[lease.d_request_id] = ("pushed", None)
        self._unindex(lease.req_id, lease.keys)
        for key in lease.keys[1:]:
            self._ended_keys[key] = state is LeaseState.RELEASED
            self._ended_keys.move_to_end(key)
        while len(self._ended_keys) > self._limit:
            self._ended_keys.popitem(last=False)

    def _set_state(self, lease: Lease, state: LeaseState) -> None:
        """The one place a lease changes state: the indexes follow."""
        old = lease.state
        if old is state:
            return
        req_id = lease.req_id
        self._live += (state in _LIVE) - (old in _LIVE)
        self._writes += (state is LeaseState.WRITING) - (old is LeaseState.WRITING)
        if old in _POSTED and state not in _POSTED:
            del self._posted[req_id]
        elif state in _POSTED and old not in _POSTED:
            self._posted[req_id] = lease
        if old in _CLAIMED and state not in _CLAIMED:
            del self._claims[req_id]
            claims = self._by_engine.get(lease.engine)
            if claims is not None:
                claims.discard(req_id)
                if not claims:
                    del self._by_engine[lease.engine]
        elif state in _CLAIMED and old not in _CLAIMED:
            self._claims[req_id] = lease
            self._by_engine.setdefault(lease.engine, set()).add(req_id)
        if old is LeaseState.FAILED:
            del self._failed[req_id]
        elif state is LeaseState.FAILED:
            self._failed[req_id] = lease
        lease.state = state

    def _drop(self, lease: Lease) -> None:
        """Take a lease out of the ledger (its indexes with it)."""
        self._set_state(lease, LeaseState.RELEASED if lease.state in _LIVE else lease.state)
        if lease.state is LeaseState.FAILED:
            del self._failed[lease.req_id]
        del self._leases[lease.req_id]

    def _push_deadline(self, lease: Lease, deadline: float | None = None) -> None:
        """A heap entry for the HELD lease at `deadline` (its own by default). A renewal
        pushes none: the entry is moved when it is popped before the new deadline, so a
        heartbeat costs no heap work and each lease has one entry, or two briefly."""
        heap = self._deadlines
        if len(heap) > 2 * self._live + 1024:  # mostly entries of leases gone
            heap[:] = [(le.deadline, n, le.req_id) for n, le in enumerate(self._leases.values())
                       if le.state is LeaseState.HELD]
            heapq.heapify(heap)
            self._pushed_deadlines = len(heap)
        self._pushed_deadlines += 1
        heapq.heappush(heap, (lease.deadline if deadline is None else deadline, self._pushed_deadlines,
                              lease.req_id))

    def _index(self, key: str, req_id: str) -> None:
        ids = self._by_key.get(key, ())
        if req_id not in ids:
            self._by_key[key] = (*ids, req_id)

    def _unindex(self, req_id: str, keys: tuple[str, ...]) -> None:
        for key in keys:
            ids = self._by_key.get(key)
            if ids is not None and req_id in ids:
                rest = tuple(r for r in ids if r != req_id)
                if rest:
                    self._by_key[key] = rest
                else:
                    del self._by_key[key]

    def _note_registration(self, d_request_id: str, what: str,
                           told: PushFailReason | None = None) -> None:
        self._registrations[d_request_id] = (what, told)
        self._registrations.move_to_end(d_request_id)
        while len(self._registrations) > self._limit:
            self._registrations.popitem(last=False)

    def _trim(self) -> None:
        """Past the bound, the oldest ENDED leases go first; a live one is never
        dropped (its blocks are held: vLLM's reaper still releases it)."""
        if len(self._leases) <= self._limit:
            return
        for lease in [le for le in self._leases.values()
                      if le.state not in _LIVE and le.state is not LeaseState.FAILED]:
            self._drop(lease)
            if len(self._leases) <= self._limit:
                return

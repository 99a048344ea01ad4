"""The notifications P and D send each other, each handed to the owner of its kind.

vLLM's writer thread reads NIXL notifications in one place: step 4 of its loop
(`_push_writer_loop`) calls `nixl_wrapper.get_new_notifs()`, hands PUSH_REGs to
`_handle_push_reg_notif` and forwards every other notification to the main thread's
queue (`_pending_completion_notifs`), where vLLM counts WRITE completions and applies
heartbeats a step later. The loop has no other seam, so the router stands in the
worker's `nixl_wrapper`, where that call lands, and routes the batch before vLLM sees it:

- every message: its agent's engine answered (the connection table: last contact);
- `HB:` (from D): the lease ledger, applied now (`LeaseFlow._renew_from`); not
  forwarded (vLLM would apply it a step late, by an exact id that never matches);
- `PUSH_FAIL:` (from a fork P): the receive ledger (`ReceiveFlow._push_fail_from`); not
  forwarded;
- `KV digest` (from a fork P, on D): the digest inbox (`IntegrityFlow._kv_digest_from`);
  not forwarded (vLLM would count it as a completion);
- `PUSH_REG:` (from D): forwarded; vLLM's loop hands it to `_handle_push_reg_notif`
  (ours, connector/glue/push.py);
- a completion `<D request>:<P TP>` (from P, on D): the receive ledger, that rank is done
  (`ReceiveFlow._write_landed_from`); forwarded too: vLLM counts them to finish the
  receive.

After each read (whether or not anything arrived) the router runs the writer's own due
work (`after_pass`: P sends the PUSH_FAILs owed and answers PUSH_REGs no request
matched). A handler that raises costs its one notification, never the batch: the
failure is logged at ERROR with what was lost and counted (`internal_errors`), a
PUSH_FAIL's receive is given up (it fails at its safe point), and a completion still
reaches vLLM.
With the deployment's secret (`auth`), every notification this worker sends (its own,
vLLM's, and the completion a WRITE carries) is wrapped with a MAC and the sender's
engine id (connector/trust/proofs.py), and every batch read is unwrapped first: a
notification without a valid MAC is dropped before anything reads it, counted and
logged (once per peer agent), so a forged PUSH_REG never reaches the match.
Every other attribute of the agent is bound straight through on first use.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import Any

from connector.glue.wire import HEARTBEAT_PREFIX, PUSH_REG_PREFIX
from connector.trust import refusals
from connector.trust.proofs import unwrap_notif, wrap_notif
from connector.trust.secret import PeerSecret
from connector.vocabulary import (
    KV_DIGEST_NOTIF_PREFIX,
    PUSH_FAIL_NOTIF_PREFIX,
    AuthChannel,
    InternalStep,
)

logger = logging.getLogger(__name__)


class Kind(Enum):
    HEARTBEAT = "heartbeat"
    PUSH_FAIL = "push_fail"
    PUSH_REG = "push_reg"
    KV_DIGEST = "kv_digest"
    COMPLETION = "completion"


def kind_of(message: bytes) -> Kind:
    if message.startswith(HEARTBEAT_PREFIX):
        return Kind.HEARTBEAT
    if message.startswith(PUSH_FAIL_NOTIF_PREFIX):
        return Kind.PUSH_FAIL
    if message.startswith(PUSH_REG_PREFIX):
        return Kind.PUSH_REG
    if message.startswith(KV_DIGEST_NOTIF_PREFIX):
        return Kind.KV_DIGEST
    return Kind.COMPLETION


Handler = Callable[[Any, bytes], None]


@dataclass(frozen=True)
class Owners:
    """Who each kind goes to (writer thread). `completion` is None where no WRITE lands
    (a pure producer); `after_pass` runs after every read."""

    contact: Callable[[Any, float], None]
    heartbeat: Handler
    push_fail: Handler
    push_fail_lost: Callable[[bytes], None]
    completion: Handler | None
    kv_digest: Handler | None  # None on a pure producer: a digest reaching it is dropped
    after_pass: Callable[[], None]
    fault: Callable[[InternalStep, str], None]  # log and count (the worker's `_internal_error`)


@dataclass(frozen=True)
class NotifAuth:
    """The secret and this engine's id, as every notification it sends carries them."""

    secret: PeerSecret
    sender: bytes

    def wrap(self, message: bytes | str) -> bytes:
        return wrap_notif(self.secret, self.sender, message.encode() if isinstance(message, str) else message)

    def unwrap(self, notifs: dict[Any, list[bytes]]) -> dict[Any, list[bytes]]:
        """The batch with every notification's MAC checked and stripped; the others dropped
        (an agent none of whose notifications held is not in the batch: no contact either)."""
        out: dict[Any, list[bytes]] = {}
        for agent, messages in notifs.items():
            kept = []
            for data in messages:
                message, sender, refusal = unwrap_notif(self.secret, data)
                if refusal is None:
                    kept.append(message)
                    continue
                refusals.note(AuthChannel.NOTIFICATION, refusal, f"NIXL agent {agent!r}",
                              f"a {kind_of(data).value} notification ({len(data)} bytes, claimed sender "
                              f"{sender.decode(errors='replace')!r}) without a valid MAC; dropped")
            if kept:
                out[agent] = kept
        return out


class NotificationRouter:
    """Wraps the worker's NIXL agent; see module docstring."""

    def __init__(self, agent: Any, owners: Owners, auth: NotifAuth | None = None):
        object.__setattr__(self, "_agent", agent)
        object.__setattr__(self, "_owners", owners)
        object.__setattr__(self, "_auth", auth)

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._agent, name)
        object.__setattr__(self, name, value)  # (cached: the hot path pays nothing)
        return value

    def interpose(self, factory: Any) -> Any:
        """Put `factory(agent)` below every wrapper of the fork (the harness's fault layer:
        the router then routes what the 'network' delivered); returns it."""
        for name in [n for n in self.__dict__ if n not in ("_agent", "_owners", "_auth")]:
            del self.__dict__[name]
        inner = self._agent
        if hasattr(type(inner), "interpose"):
            return inner.interpose(factory)
        wrapped = factory(inner)
        object.__setattr__(self, "_agent", wrapped)
        return wrapped

    def send_notif(self, remote_agent_name: Any, notif_msg: bytes | str = b"", *args: Any,
                   **kwargs: Any) -> Any:
        if self._auth is not None:
            notif_msg = self._auth.wrap(notif_msg)
        return self._agent.send_notif(remote_agent_name, *args, notif_msg=notif_msg, **kwargs)

    def make_prepped_xfer(self, *args: Any, **kwargs: Any) -> Any:
        """A WRITE (its completion notification wrapped, with the secret)."""
        if self._auth is not None and kwargs.get("notif_msg"):
            kwargs["notif_msg"] = self._auth.wrap(kwargs["notif_msg"])
        return self._agent.make_prepped_xfer(*args, **kwargs)

    def get_new_notifs(self) -> Any:
        """vLLM's writer, once per pass: the batch, routed; then the writer's due work."""
        notifs = self._agent.get_new_notifs()
        if notifs and self._auth is not None:
            notifs = self._auth.unwrap(notifs)
        if notifs:
            notifs = self.route(notifs)
        try:
            self._owners.after_pass()
        except Exception:
            self._owners.fault(InternalStep.WRITER_PASS, "the writer's due work (owed PUSH_FAILs, "
                               "unmatched PUSH_REGs; tried again next pass)")
        return notifs

    def route(self, notifs: dict[Any, list[bytes]]) -> dict[Any, list[bytes]]:
        """Hand each notification to its owner; returns what vLLM's loop handles."""
        owners = self._owners
        now = time.perf_counter()
        for agent, messages in notifs.items():
            owners.contact(agent, now)
            kept: list[bytes] = []
            for message in messages:
                kind = kind_of(message)
                if kind is Kind.PUSH_REG:
                    kept.append(message)
                    continue
                if kind is Kind.COMPLETION:
                    kept.append(message)  # (first: vLLM counts it whatever happens below)
                    if owners.completion is None:
                        continue
                handler = {Kind.HEARTBEAT: owners.heartbeat, Kind.PUSH_FAIL: owners.push_fail,
                           Kind.COMPLETION: owners.completion, Kind.KV_DIGEST: owners.kv_digest}[kind]
                if handler is None:
                    continue
                try:
                    handler(agent, message)
                except Exception:
                    self._lost(kind, agent, message)
            if len(kept) != len(messages):
                notifs[agent] = kept
        return notifs

    def _lost(self, kind: Kind, agent: Any, message: bytes) -> None:
        self._owners.fault(InternalStep.NOTIFICATION, "handling a {} notification from NIXL agent {!r} "
                           "({} bytes, starts {!r}){}".format(kind.value, agent, len(message), message[:48], {
                               Kind.HEARTBEAT: ": the leases it names were not renewed by it",
                               Kind.PUSH_FAIL: ": its receive is given up (it fails at its safe point)",
                               Kind.KV_DIGEST: ": its receive is not checked (counted skipped)",
                               Kind.COMPLETION: ": vLLM still counts it"}[kind]))
        if kind is Kind.PUSH_FAIL:
            try:
                self._owners.push_fail_lost(message)
            except Exception:
                logger.error("Giving up the receive of a lost PUSH_FAIL failed too; it fails at "
                             "its registration timeout", exc_info=True)

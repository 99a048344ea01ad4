"""A pass-through wrapper around the worker's NIXL agent.

It observes the two agent calls a handshake is made of (`add_remote_agent` and
`prep_xfer_dlist`) for the handshake record of the current thread, so we measure
what NIXL was actually asked to do rather than trusting a flag, and every
notification sent (heartbeats are counted from here). Every other attribute is
bound straight to the real agent on first use: the transfer hot path
(make_prepped_xfer, transfer, check_xfer_state) pays nothing. `get_new_notifs` is
the writer thread's one call per pass: the worker sees the notifications there
(contact, heartbeats) and does the writer's own due work (connector/glue/peers.py).
"""

from __future__ import annotations

import logging
from typing import Any

from connector.telemetry.record import ActiveRecord
from connector.vocabulary import DescriptorList, Phase

logger = logging.getLogger(__name__)

# NIXL's name for "this agent" when preparing local descriptor lists.
LOCAL_AGENT_NAME = "NIXL_INIT_AGENT"


# NIXL >= 1.5 also takes an Nx5 array of strided descriptors:
# (address, length, device id, stride, count), one row covering `count` blocks.
STRIDED_COLUMNS = 5
STRIDED_COUNT_COLUMN = 4


def count_descriptors(descs: Any) -> int:
    """Number of descriptors in what was handed to NIXL's `prep_xfer_dlist` (0 if unknown).

    vLLM 0.32 passes a descriptor list (`descCount()`); vLLM 0.33 passes Nx5 strided
    arrays, where one row stands for `count` descriptors: counting rows there would
    count regions, not descriptors, and break the registered-vs-saved comparison.
    """
    try:
        counter = getattr(descs, "descCount", None)
        if callable(counter):
            return int(counter())
        shape = getattr(descs, "shape", None)
        if shape is not None and len(shape) == 2:
            if shape[1] == STRIDED_COLUMNS:
                return int(descs[:, STRIDED_COUNT_COLUMN].sum())
            return int(shape[0])  # Nx3: one descriptor per row
        return len(descs)
    except Exception:
        return 0


class NixlAgentProbe:
    """Wraps a `nixl_agent`; see module docstring. `on_notif(message, ok, agent)` hears
    of every notification sent (or failed) through it; `on_receive(notifs)` sees what
    `get_new_notifs` returned ({agent: [messages]}) and returns what the caller gets.
    Neither may raise."""

    def __init__(self, agent: Any, on_notif: Any = None, on_receive: Any = None):
        object.__setattr__(self, "_agent", agent)
        object.__setattr__(self, "_on_notif", on_notif)
        object.__setattr__(self, "_on_receive", on_receive)

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._agent, name)
        # Cache bound methods and attributes on the wrapper: later lookups are
        # plain attribute hits, no __getattr__ round trip.
        object.__setattr__(self, name, value)
        return value

    def add_remote_agent(self, metadata: bytes) -> Any:
        record = ActiveRecord.get()
        if record is None:
            return self._agent.add_remote_agent(metadata)
        resume = record.current_phase
        record.enter(Phase.AGENT_LOAD)
        try:
            return self._agent.add_remote_agent(metadata)
        finally:
            # Whatever ran before the agent load (the transfer plan) resumes after it.
            if resume is not None and resume is not Phase.AGENT_LOAD:
                record.enter(resume)

    def prep_xfer_dlist(self, agent_name: Any, descs: Any, *args: Any, **kwargs: Any) -> Any:
        record = ActiveRecord.get()
        if record is None:
            return self._agent.prep_xfer_dlist(agent_name, descs, *args, **kwargs)
        record.enter(Phase.DESCRIPTOR_REGISTRATION)
        handle = self._agent.prep_xfer_dlist(agent_name, descs, *args, **kwargs)
        which = DescriptorList.LOCAL if agent_name == LOCAL_AGENT_NAME else DescriptorList.REMOTE
        try:
            record.count_registration(which, count_descriptors(descs))
        except Exception:  # telemetry must never break a handshake
            logger.debug("descriptor counting failed", exc_info=True)
        return handle

    def send_notif(self, remote_agent_name: Any, *args: Any, **kwargs: Any) -> Any:
        message = kwargs["notif_msg"] if "notif_msg" in kwargs else (args[0] if args else None)
        try:
            result = self._agent.send_notif(remote_agent_name, *args, **kwargs)
        except Exception:
            if self._on_notif is not None:
                self._on_notif(message, False, remote_agent_name)
            raise
        if self._on_notif is not None:
            self._on_notif(message, True, remote_agent_name)
        return result

    def get_new_notifs(self) -> Any:
        notifs = self._agent.get_new_notifs()
        hook = self._on_receive
        if hook is None:
            return notifs
        try:
            return hook(notifs)
        except Exception:
            logger.warning("handling received NIXL notifications failed; passing them on",
                           exc_info=True)
            return notifs

    def get_xfer_descs(self, *args: Any, **kwargs: Any) -> Any:
        record = ActiveRecord.get()
        if record is not None:
            record.enter(Phase.DESCRIPTOR_REGISTRATION)
        return self._agent.get_xfer_descs(*args, **kwargs)

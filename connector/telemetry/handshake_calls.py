"""What a handshake asks of the worker's NIXL agent, measured (telemetry only).

`HandshakeCallObserver` wraps the worker's NIXL agent and observes the calls a
handshake is made of (`add_remote_agent`, `prep_xfer_dlist`, `get_xfer_descs`) for the
handshake record active on the calling thread (`ActiveRecord`): the phase each call
belongs to and the descriptors NIXL was asked to prepare, so we report what NIXL was
actually asked to do rather than trusting a flag. With no record active (every call
outside a handshake) it passes straight through; every other attribute is bound to the
real agent on first use, so the transfer hot path (make_prepped_xfer, transfer,
check_xfer_state) pays nothing. It decides nothing: the data path never goes through
it (notifications are routed by connector/glue/notifications.py).
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


class HandshakeCallObserver:
    """Wraps a `nixl_agent`; see module docstring."""

    def __init__(self, agent: Any):
        object.__setattr__(self, "_agent", agent)

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._agent, name)
        # Cache bound methods and attributes on the wrapper: later lookups are
        # plain attribute hits, no __getattr__ round trip.
        object.__setattr__(self, name, value)
        return value

    def interpose(self, factory: Any) -> Any:
        """Put `factory(agent)` between this observer and the agent (the harness's fault
        layer); returns it."""
        inner = factory(self._agent)
        for name in [n for n in self.__dict__ if n != "_agent"]:  # (cached bindings)
            del self.__dict__[name]
        object.__setattr__(self, "_agent", inner)
        return inner

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

    def get_xfer_descs(self, *args: Any, **kwargs: Any) -> Any:
        record = ActiveRecord.get()
        if record is not None:
            record.enter(Phase.DESCRIPTOR_REGISTRATION)
        return self._agent.get_xfer_descs(*args, **kwargs)

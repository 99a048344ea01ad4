"""Engine commands that inject faults or watch for their effects (tests only).

What a buggy or hostile peer, or an operator, can do to a running engine that the
plain push flow never does: a PUSH_REG with fields replaced, raw NIXL notifications
that bypass the connector's encoding, and the log lines and pending tables the tests
read back to see how the engine took it. Mixed into `harness.engine.Engine`, whose
command loop dispatches `cmd_<name>`.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable
from typing import Any


class InjectedFault(RuntimeError):
    """Raised by a method `cmd_inject_fault` armed (a defect, on purpose)."""


def arm(target: str, times: int) -> Callable[[], int]:
    """Make `module.Class.method` (dotted) raise `InjectedFault` on its next `times`
    calls, then behave again; returns a counter of the faults raised so far."""
    module_name, cls_name, method = target.rsplit(".", 2)
    cls = getattr(importlib.import_module(module_name), cls_name)
    original = cls.__dict__[method]
    raised = [0]

    def faulty(self: Any, *args: Any, **kwargs: Any) -> Any:
        if raised[0] < times:
            raised[0] += 1
            raise InjectedFault(f"injected into {target} ({raised[0]} of {times})")
        return original(self, *args, **kwargs)

    setattr(cls, method, faulty)
    return lambda: raised[0]


class FaultCommands:
    """`cmd_*` fault injection; the engine provides the worker and its step metadata."""

    worker: Any
    pending_meta: Any
    fault_agent: Any
    cmd_register: Callable[..., None]
    _armed: dict[str, Callable[[], int]]

    def cmd_inject_fault(self, target: str, times: int = 1) -> None:
        """The next `times` calls of `target` (`module.Class.method`, a step of the
        connector's data path) raise, as a defect in it would."""
        if not hasattr(self, "_armed"):
            self._armed = {}
        self._armed[target] = arm(target, times)

    def cmd_faults_raised(self) -> dict[str, int]:
        return {target: count() for target, count in getattr(self, "_armed", {}).items()}

    def cmd_quiet_for(self, engine_id: str) -> float:
        """Seconds since `engine_id` last answered this worker (handshake, notification,
        probe reply), on this engine's clock."""
        import time

        return time.perf_counter() - self.worker._connections.last_contact(engine_id)

    def cmd_refuse_writes(self, n: int) -> None:
        """NIXL refuses the next `n` WRITEs at posting (`make_prepped_xfer` raises)."""
        assert self.fault_agent is not None, "engine started without faults_seed"
        self.fault_agent.refuse_writes(n)

    def cmd_register_as(self, req_id: str, block_ids: list[int], prefill: dict[str, Any],
                        remote_request_id: str, overrides: dict[str, Any]) -> None:
        """D side: `cmd_register` with fields of the PUSH_REG payload replaced (or added).

        Faults a real peer can produce: a side-channel address P cannot reach or that
        stalls (`decode_host`/`decode_port`), block ids outside this engine's cache,
        a hostile `otel_trace_context`.
        """
        self.cmd_register(req_id, block_ids, prefill, remote_request_id, False)
        self.pending_meta.push_registrations[req_id].update(overrides)

    def cmd_send_notifs(self, engine_id: str, payloads: list[bytes]) -> int:
        """Send raw NIXL notifications to every agent this worker holds for `engine_id`.

        Bypasses the connector's own encoding (what a buggy or hostile peer can do);
        returns how many notifications were sent.
        """
        agents = dict(self.worker._remote_agents.get(engine_id) or {})
        if not agents:
            raise RuntimeError(f"no NIXL agent for engine {engine_id}")
        sent = 0
        for payload in payloads:
            for agent_name in agents.values():
                self.worker.nixl_wrapper.send_notif(agent_name, notif_msg=payload)
                sent += 1
        return sent

    def cmd_suspect(self, engine_id: str) -> None:
        """Mark a remote engine's connection failed, as a failed notification or WRITE
        does: the next step drops it (the engine itself may be alive)."""

        self.worker.observed_suspect(engine_id)

    def cmd_answer_side_channel_late(self, delay_ms: float) -> None:
        """Every side-channel answer of this engine leaves `delay_ms` late: the round
        trip to a producer on another host, or one whose engine keeps its listener
        thread waiting. (The listener is vLLM's thread on a ZMQ ROUTER socket; its
        reply is delayed where pyzmq sends it, the only place reachable once it runs.)"""
        import time

        import zmq

        send = zmq.Socket.send_multipart
        delay_s = delay_ms / 1000

        def late_send(sock: Any, *args: Any, **kwargs: Any) -> Any:
            if sock.socket_type == zmq.ROUTER:
                time.sleep(delay_s)  # the injected latency, not synchronisation
            return send(sock, *args, **kwargs)

        zmq.Socket.send_multipart = late_send  # type: ignore[method-assign]

    def _watched_logs(self) -> dict[str, list[str]]:
        return self.__dict__.setdefault("_watched", {})

    def cmd_watch_log(self, logger_name: str) -> None:
        """Start keeping the WARNING+ records of one logger (read with `cmd_logged`)."""
        watched = self._watched_logs()
        if logger_name in watched:
            return
        kept: list[str] = []

        class _Keep(logging.Handler):
            def emit(self, record: logging.LogRecord) -> None:
                kept.append(record.getMessage())

        logging.getLogger(logger_name).addHandler(_Keep(level=logging.WARNING))
        watched[logger_name] = kept

    def cmd_logged(self, logger_name: str) -> list[str]:
        """WARNING+ messages of a watched logger since the last call."""
        kept = self._watched_logs()[logger_name]
        out = list(kept)
        del kept[:len(out)]
        return out

    def cmd_pending_registrations(self) -> list[str]:
        """P side: D request ids whose PUSH_REG arrived and waits for P's blocks."""
        return sorted(getattr(self.worker, "_pending_d_registrations", {}))

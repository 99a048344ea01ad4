"""The start-up guard: the installed vLLM passes; a missing or reshaped piece, or an
untested version, fails at once with a message naming it (or runs degraded on request)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from vllm.distributed.kv_transfer.kv_connector.v1.nixl import connector as stock_connector
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.push_worker import NixlPushConnectorWorker

from connector.glue import guard, pins
from connector.glue.connector import NixlPushConnector
from connector.glue.worker import ObservedPushWorker
from harness.frontend import Frontend

VERSION = guard.installed_version()
MINOR = guard.minor_of(VERSION)


def complete_worker() -> SimpleNamespace:
    """An object with every attribute vLLM's constructor sets (on this minor) that we read."""
    return SimpleNamespace(**dict.fromkeys(guard.worker_attributes(VERSION), 0))


def owner_of(cls: type, name: str) -> type:
    return next(k for k in cls.__mro__ if name in vars(k))


def test_installed_vllm_passes():
    verdict = guard.check_worker(complete_worker())
    assert verdict.ok and verdict.problems == [] and verdict.version == VERSION


def test_missing_method_fails_naming_it_the_version_and_the_range(monkeypatch):
    monkeypatch.delattr(owner_of(NixlPushConnectorWorker, "_do_send_reg_notif"), "_do_send_reg_notif")
    with pytest.raises(guard.UnsupportedVllmError) as info:
        guard.check_worker(complete_worker())
    text = str(info.value)
    assert "NixlPushConnectorWorker._do_send_reg_notif is missing" in text
    assert f"vLLM {VERSION}" in text and guard.TESTED_RANGE in text
    assert guard.ALLOW_UNTESTED_ENV in text


def test_changed_signature_fails(monkeypatch):
    monkeypatch.setattr(NixlPushConnectorWorker, "_do_start_push_kv", lambda self, request_id: None)
    monkeypatch.setattr(NixlPushConnectorWorker, "add_remote_agent",
                        lambda self, nixl_agent_meta, remote_tp_size=1: "agent")
    problems = guard.assess().problems
    assert any(p.startswith("NixlPushConnectorWorker._do_start_push_kv") and "does not accept" in p
               for p in problems), problems
    assert any("add_remote_agent" in p and "'remote_tp_rank'" in p for p in problems), problems


def test_missing_constructor_attribute_fails_naming_it():
    for name in ("nixl_wrapper", guard.worker_attributes(VERSION)[-1]):  # common, this minor's own
        worker = complete_worker()
        delattr(worker, name)
        with pytest.raises(guard.UnsupportedVllmError, match=f"'{name}'"):
            guard.check_worker(worker)


def test_attribute_sets_are_per_minor():
    """0.34 no longer sets the PP region offset or the layer-name routing tables; 0.32
    and 0.33 do. Each minor is checked against its own set, on the live worker
    (constructor) and in vLLM's source (assigned later)."""
    gone_in_034 = {"_remote_region_offset", "_transfer_layer_region_indices", "_transfer_layer_names"}
    for minor in ((0, 32), (0, 33)):
        wanted = set(pins.WORKER_ATTRIBUTES[minor]) | set(pins.LATER_ATTRIBUTES[minor])
        assert gone_in_034 <= wanted
    assert not gone_in_034 & (set(pins.WORKER_ATTRIBUTES[(0, 34)]) | set(pins.LATER_ATTRIBUTES[(0, 34)]))
    # The installed vLLM sets what its minor's set names, and 0.34 no longer sets the others.
    assert guard._later_attribute_problems(NixlPushConnectorWorker, guard.later_attributes(VERSION)) == []
    routing = ["_transfer_layer_region_indices", "_transfer_layer_names"]
    assert guard._later_attribute_problems(NixlPushConnectorWorker, routing) == (
        [f"NixlPushConnectorWorker no longer sets self.{n}" for n in routing] if MINOR >= (0, 34) else [])


def test_attributes_vllm_sets_later_are_checked_in_its_source():
    assert guard._later_attribute_problems(NixlPushConnectorWorker, ["num_descs", "num_desks"]) == [
        "NixlPushConnectorWorker no longer sets self.num_desks"]


def test_untested_version_fails_even_when_everything_is_there():
    with pytest.raises(guard.UnsupportedVllmError, match=r"vLLM 0\.35\.0 is outside the tested range"):
        guard.check_worker(complete_worker(), version="0.35.0")


def test_a_vllm_035_is_refused_at_start_up_naming_the_version_and_the_range(monkeypatch):
    """An installed vLLM the fork does not know (simulated: vLLM reports 0.35.0): start-up
    fails naming the version, the tested range and the minors CI runs."""
    import vllm

    monkeypatch.setattr(vllm, "__version__", "0.35.0")
    assert guard.installed_version() == "0.35.0"
    with pytest.raises(guard.UnsupportedVllmError) as info:
        guard.check_worker(complete_worker())
    text = str(info.value)
    head = f"nixl-push-observed: vLLM 0.35.0 is outside the tested range {guard.TESTED_RANGE}:"
    assert text.startswith(head)
    assert guard.TESTED_RANGE == ">=0.32,<0.35"
    assert "  - the version: CI tests the vLLM minors 0.32, 0.33, 0.34" in text
    assert guard.ALLOW_UNTESTED_ENV in text
    monkeypatch.setenv(guard.ALLOW_UNTESTED_ENV, "1")
    assert not guard.check_worker(complete_worker()).ok  # runs, degraded


def test_the_seam_the_connector_uses_is_checked(monkeypatch):
    assert guard._seam_problems() == []
    monkeypatch.delattr(stock_connector, guard.WORKER_SEAM)
    assert guard._seam_problems() == [
        f"NixlPushConnector.__init__ no longer builds its worker by the name {guard.WORKER_SEAM!r}"]


def test_worker_start_up_runs_the_guard(monkeypatch):
    """ObservedPushWorker.__init__ checks right after vLLM's constructor: with a
    constructor that sets nothing, start-up fails naming the missing attributes."""
    monkeypatch.setattr(NixlPushConnectorWorker, "__init__", lambda self, *a, **k: None)
    with pytest.raises(guard.UnsupportedVllmError, match="'nixl_wrapper'"):
        ObservedPushWorker(None, "e", None)


def test_switch_runs_anyway_and_metrics_say_degraded(monkeypatch):
    kv = SimpleNamespace(get_from_extra_config=lambda key, default=None: default)
    healthy = Frontend(NixlPushConnector, kv)
    assert healthy.sample("vllm:nixl_observed_degraded") == 0.0
    assert "vllm:nixl_observed_degraded{" in healthy.exposition()

    monkeypatch.delattr(owner_of(NixlPushConnectorWorker, "_send_heartbeats"), "_send_heartbeats")
    monkeypatch.setenv(guard.ALLOW_UNTESTED_ENV, "1")
    verdict = guard.check_worker(complete_worker())  # no exception: allowed
    assert not verdict.ok and any("_send_heartbeats" in p for p in verdict.problems)
    degraded = Frontend(NixlPushConnector, kv)
    assert degraded.sample("vllm:nixl_observed_degraded") == 1.0


def test_an_import_that_vllm_broke_names_the_version_and_range(monkeypatch):
    import sys

    import connector

    monkeypatch.setitem(sys.modules, "connector.glue.connector", None)  # import now fails
    with pytest.raises(ImportError, match=rf"Installed vLLM: {VERSION}; tested range {guard.TESTED_RANGE}"):
        connector.NixlPushConnector  # noqa: B018 - the attribute access is the import


def test_a_changed_source_of_a_function_we_reimplement_is_named(monkeypatch):
    """A patch release that edits `_handle_heartbeat` (ours in leases.py) fails at start-up
    naming it, though its signature is unchanged."""
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker import NixlBaseConnectorWorker

    assert guard.pinned_source_problems(VERSION) == []

    def _handle_heartbeat(self, payload: str) -> None:  # same signature, other body
        return None

    monkeypatch.setattr(NixlBaseConnectorWorker, "_handle_heartbeat", _handle_heartbeat)
    [problem] = guard.pinned_source_problems(VERSION)
    assert problem.startswith("NixlBaseConnectorWorker._handle_heartbeat is not the source")
    with pytest.raises(guard.UnsupportedVllmError, match="_handle_heartbeat is not the source"):
        guard.check_worker(complete_worker())


def test_a_changed_ordering_point_is_named(monkeypatch):
    """The fork relies on the order of vLLM's push step: heartbeats (the only handshakes
    `start_load_kv` starts) go last. A release that moves them is refused at start-up,
    naming the function and what the fork relies on in it."""
    stock = NixlPushConnectorWorker.start_load_kv

    def start_load_kv(self, metadata):  # same signature, heartbeats first
        self._send_heartbeats(metadata)
        return stock(self, metadata)

    monkeypatch.setattr(NixlPushConnectorWorker, "start_load_kv", start_load_kv)
    [problem] = guard.pinned_source_problems(VERSION)
    assert problem.startswith("NixlPushConnectorWorker.start_load_kv is not the source")
    assert pins.WHY_PINNED["NixlPushConnectorWorker.start_load_kv"] in problem
    assert f"vLLM {MINOR[0]}.{MINOR[1]}" in problem


def test_every_tested_minor_pins_the_same_functions_each_with_its_reason():
    pinned = {frozenset(p) for p in guard.PINNED_SOURCES.values()}
    assert len(pinned) == 1 and set(guard.PINNED_SOURCES) == set(guard.TESTED_MINORS)
    assert set(guard.TESTED_MINORS) == set(pins.WORKER_ATTRIBUTES) == set(pins.LATER_ATTRIBUTES)
    [names] = pinned
    assert names == set(pins.WHY_PINNED)
    ordering = {"NixlPushConnectorWorker.start_load_kv", "NixlPushConnectorWorker._push_writer_loop",
                "NixlPushConnectorWorker.get_transfer_results",
                "NixlBaseConnectorWorker.get_transfer_results"}
    assert ordering <= names


def test_the_pin_lines_printed_for_the_installed_vllm_are_its_minors(capsys):
    """`python -m connector.glue.guard` prints what the lead pastes for a new minor; for the
    installed (tested) one it is that minor's table, line for line."""
    assert guard.main([]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"# vLLM {VERSION}"
    printed = dict(line.strip().rstrip(",").replace('"', "").split(": ") for line in lines[1:])
    assert printed == guard.PINNED_SOURCES[MINOR]

"""`nixl_progress_delay_us`: the poll delay reaches the real NIXL agent vLLM builds, only while asked."""

from __future__ import annotations

import sys
import uuid

import pytest
from vllm.distributed.nixl_utils import NixlWrapper

from connector.glue.nixl_progress import ProgressDelayError, parse_delay, progress_delay


@pytest.fixture
def built_configs(monkeypatch):
    """Every config NIXL's Python API hands its native agent constructor, in order."""
    bind = sys.modules[NixlWrapper.__module__].nixlBind
    real = bind.nixlAgent
    seen: list[int] = []

    def recording(name, config):
        seen.append(config.pthrDelay)
        return real(name, config)

    monkeypatch.setattr(bind, "nixlAgent", recording)
    return seen


def test_agents_built_inside_poll_with_the_delay_and_after_it_spin_again(built_configs):
    bind = sys.modules[NixlWrapper.__module__].nixlBind
    before = bind.nixlAgent
    with progress_delay(250) as applied:
        agent = NixlWrapper(str(uuid.uuid4()), None)
    assert applied is True
    assert bind.nixlAgent is before  # restored
    later = NixlWrapper(str(uuid.uuid4()), None)
    assert built_configs == [250, 0]
    # The delayed agent is a working agent: it serves its own metadata.
    assert agent.get_agent_metadata() and later.get_agent_metadata()


def test_unset_leaves_nixl_alone(built_configs):
    with progress_delay(None) as applied:
        NixlWrapper(str(uuid.uuid4()), None)
    assert applied is False
    assert built_configs == [0]


def test_nested_delays_restore_in_order(built_configs):
    with progress_delay(100):
        with progress_delay(300):
            NixlWrapper(str(uuid.uuid4()), None)
        NixlWrapper(str(uuid.uuid4()), None)
    NixlWrapper(str(uuid.uuid4()), None)
    assert built_configs == [300, 100, 0]


@pytest.mark.parametrize("value,expected", [(None, None), ("", None), (0, 0), (100, 100), ("250", 250)])
def test_parse_accepts_whole_microseconds(value, expected):
    assert parse_delay(value) == expected


@pytest.mark.parametrize("value", [-1, 1_000_001, "fast", 1.5, True, [100]])
def test_parse_refuses_anything_else_with_the_key_named(value):
    with pytest.raises(ProgressDelayError, match="nixl_progress_delay_us"):
        parse_delay(value)

"""The scheduler subclass hands request trace context to workers (real vLLM `Request`s).

Runs vLLM's own push scheduler code (ours wraps it) on real `Request` objects carrying
`trace_headers`, and compares every output with the stock scheduler's for the same
inputs: the only difference allowed is our one extra key / attribute.
"""

from __future__ import annotations

import pickle

import pytest
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.push_scheduler import (
    NixlPushConnectorScheduler,
)
from vllm.sampling_params import SamplingParams
from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.kv_cache_utils import KVCacheBlock
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.request import Request, RequestStatus

from connector.glue.connector import NixlPushConnector
from connector.glue.scheduler import ObservedPushScheduler
from connector.glue.wire import prompt_digest
from connector.vocabulary import (
    METADATA_TRACE_ATTR,
    PUSH_REG_DIGEST_KEY,
    REGISTRATION_ARRIVAL_KEY,
    REGISTRATION_TRACE_KEY,
    REGISTRATION_VERIFY_KEY,
    KvVerifyReason,
)
from harness.config import EngineSpec, build_kv_cache_config, build_vllm_config

TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
TRACESTATE = "vendor=value"
P_COORDS = {"remote_engine_id": "prefill-x", "remote_host": "127.0.0.1", "remote_port": 5600,
            "tp_size": 1, "pp_size": 1, "remote_request_id": "cmpl-p"}


@pytest.fixture(scope="module")
def configs(tmp_path_factory):
    work = str(tmp_path_factory.mktemp("sched"))
    out = {}
    for role in ("kv_consumer", "kv_producer"):
        spec = EngineSpec(name=role, engine_id=f"{role}-0", kv_role=role, side_channel_port=5599,
                          workdir=work)
        out[role] = (build_vllm_config(spec), build_kv_cache_config(spec), spec.engine_id)
    return out


def schedulers(configs, role):
    """Our connector's scheduler (built the way vLLM builds it) and a stock one."""
    vllm_config, kv_cache_config, engine_id = configs[role]
    ours = NixlPushConnector(vllm_config, KVConnectorRole.SCHEDULER, kv_cache_config)
    stock = NixlPushConnectorScheduler(vllm_config, engine_id, kv_cache_config)
    return ours.connector_scheduler, stock


def a_request(req_id, params, trace_headers=None, n_tokens=64):
    sampling = SamplingParams(max_tokens=1, extra_args={"kv_transfer_params": dict(params)})
    return Request(req_id, list(range(n_tokens)), sampling, None, trace_headers=trace_headers)


def blocks(*ids):
    return KVCacheBlocks(blocks=([KVCacheBlock(i) for i in ids],))


def test_connector_uses_the_observed_scheduler(configs):
    ours, _ = schedulers(configs, "kv_consumer")
    assert type(ours) is ObservedPushScheduler
    assert isinstance(ours, NixlPushConnectorScheduler)


@pytest.mark.parametrize("headers", [
    {"traceparent": TRACEPARENT, "tracestate": TRACESTATE},
    {"Traceparent": TRACEPARENT, "TraceState": TRACESTATE, "x-other": "dropped"},
])
def test_d_registration_carries_the_request_trace_context(configs, headers):
    ours, stock = schedulers(configs, "kv_consumer")
    params = {"do_remote_prefill": True, **P_COORDS}
    for conn in (ours, stock):
        req = a_request("cmpl-d-1", params, trace_headers=headers)
        conn.update_state_after_alloc(req, blocks(3, 4), 64)
    meta = ours.build_connector_meta(SchedulerOutput.make_empty())
    stock_meta = stock.build_connector_meta(SchedulerOutput.make_empty())
    reg = meta.push_registrations["cmpl-d-1"]
    assert reg[REGISTRATION_TRACE_KEY] == {"traceparent": TRACEPARENT, "tracestate": TRACESTATE}
    # Everything vLLM put there is unchanged; ours adds the trace context, the prompt
    # digest (which P checks its match against), the request's arrival and the KV
    # check's decision (every request at the default ratio).
    stock_reg = stock_meta.push_registrations["cmpl-d-1"]
    assert {k: v for k, v in reg.items()
            if k not in (REGISTRATION_TRACE_KEY, PUSH_REG_DIGEST_KEY, REGISTRATION_ARRIVAL_KEY,
                         REGISTRATION_VERIFY_KEY)} == stock_reg
    assert reg[REGISTRATION_VERIFY_KEY] == KvVerifyReason.SAMPLED.value
    assert reg[PUSH_REG_DIGEST_KEY] == prompt_digest(a_request("cmpl-d-1", params).prompt_token_ids)
    assert set(meta.reqs_to_recv) == set(stock_meta.reqs_to_recv) == {"cmpl-d-1"}
    # The metadata crosses to the workers by pickle (vLLM's multiproc executor).
    assert pickle.loads(pickle.dumps(meta)).push_registrations["cmpl-d-1"] == reg


@pytest.mark.parametrize("headers", [None, {}, {"tracestate": TRACESTATE}, {"x-other": "1"}])
def test_d_registration_without_a_traceparent_is_stock(configs, headers):
    ours, stock = schedulers(configs, "kv_consumer")
    params = {"do_remote_prefill": True, **P_COORDS}
    for conn in (ours, stock):
        conn.update_state_after_alloc(a_request("cmpl-d-2", params, headers), blocks(5), 64)
    reg = ours.build_connector_meta(SchedulerOutput.make_empty()).push_registrations["cmpl-d-2"]
    stock_reg = stock.build_connector_meta(SchedulerOutput.make_empty()).push_registrations["cmpl-d-2"]
    assert {k: v for k, v in reg.items()
            if k not in (PUSH_REG_DIGEST_KEY, REGISTRATION_ARRIVAL_KEY, REGISTRATION_VERIFY_KEY)} == stock_reg
    assert REGISTRATION_TRACE_KEY not in reg


def test_d_registration_carries_the_requests_arrival(configs):
    """The start of the request's wait for KV: vLLM's own `arrival_time`, where its TTFT starts."""
    ours, _ = schedulers(configs, "kv_consumer")
    req = a_request("cmpl-d-9", {"do_remote_prefill": True, **P_COORDS})
    req.arrival_time = 1234.5
    ours.update_state_after_alloc(req, blocks(7), 64)
    reg = ours.build_connector_meta(SchedulerOutput.make_empty()).push_registrations["cmpl-d-9"]
    assert reg[REGISTRATION_ARRIVAL_KEY] == 1234.5


def test_re_entry_and_non_push_requests_stage_nothing(configs):
    ours, _ = schedulers(configs, "kv_consumer")
    params = {"do_remote_prefill": True, **P_COORDS}
    req = a_request("cmpl-d-3", params, {"traceparent": TRACEPARENT})
    ours.update_state_after_alloc(req, blocks(6), 64)
    ours.update_state_after_alloc(req, blocks(6), 64)  # re-entry (preemption): no second stage
    plain = a_request("cmpl-plain", {}, {"traceparent": TRACEPARENT})
    ours.update_state_after_alloc(plain, blocks(7), 0)
    meta = ours.build_connector_meta(SchedulerOutput.make_empty())
    assert list(meta.push_registrations) == ["cmpl-d-3"]
    assert ours.build_connector_meta(SchedulerOutput.make_empty()).push_registrations == {}


def finished_prefill(req_id, headers):
    req = a_request(req_id, {"do_remote_decode": True}, headers)
    req.status = RequestStatus.FINISHED_LENGTH_CAPPED
    req.num_computed_tokens = 64
    return req


def test_p_metadata_carries_the_finished_request_trace_context(configs):
    ours, stock = schedulers(configs, "kv_producer")
    headers = {"traceparent": TRACEPARENT}
    results = [conn.request_finished(finished_prefill("cmpl-p-1", headers), ([8, 9],))
               for conn in (ours, stock)]
    assert results[0] == results[1]  # what vLLM returns to the API server is unchanged
    untraced = ours.request_finished(finished_prefill("cmpl-p-2", None), ([10],))
    assert untraced[0] is True
    meta = ours.build_connector_meta(SchedulerOutput.make_empty())
    stock_meta = stock.build_connector_meta(SchedulerOutput.make_empty())
    assert getattr(meta, METADATA_TRACE_ATTR) == {"cmpl-p-1": {"traceparent": TRACEPARENT}}
    assert not hasattr(stock_meta, METADATA_TRACE_ATTR)
    assert set(meta.push_finished_blocks) == {"cmpl-p-1", "cmpl-p-2"}
    assert meta.push_finished_blocks["cmpl-p-1"] == stock_meta.push_finished_blocks["cmpl-p-1"]
    assert getattr(pickle.loads(pickle.dumps(meta)), METADATA_TRACE_ATTR) == {
        "cmpl-p-1": {"traceparent": TRACEPARENT}}
    # Shipped once, like the finished blocks.
    assert not hasattr(ours.build_connector_meta(SchedulerOutput.make_empty()), METADATA_TRACE_ATTR)


def test_p_request_that_did_not_finish_normally_ships_no_context(configs):
    ours, _ = schedulers(configs, "kv_producer")
    req = a_request("cmpl-p-3", {"do_remote_decode": True}, {"traceparent": TRACEPARENT})
    req.status = RequestStatus.FINISHED_ABORTED
    assert ours.request_finished(req, ([11],)) == (False, None)
    assert not hasattr(ours.build_connector_meta(SchedulerOutput.make_empty()), METADATA_TRACE_ATTR)


def test_unreadable_trace_headers_never_reach_vllm(configs):
    class Broken(dict):
        def items(self):
            raise RuntimeError("boom")

    ours, _ = schedulers(configs, "kv_consumer")
    params = {"do_remote_prefill": True, **P_COORDS}
    ours.update_state_after_alloc(a_request("cmpl-d-4", params, Broken(a=1)), blocks(12), 64)
    reg = ours.build_connector_meta(SchedulerOutput.make_empty()).push_registrations["cmpl-d-4"]
    assert REGISTRATION_TRACE_KEY not in reg

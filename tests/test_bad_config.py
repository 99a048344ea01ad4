"""Bad configuration fails early with a message that says what to fix."""

from __future__ import annotations

import pytest
from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker

from connector.glue.connector import ConnectorConfigError, NixlPushConnector, check_connector_config
from harness.config import EngineSpec, build_kv_cache_config, build_vllm_config


def test_module_path_loads_our_class_by_the_stock_name():
    kv = KVTransferConfig(kv_connector="NixlPushConnector", kv_connector_module_path="connector",
                          kv_role="kv_consumer", engine_id="e")
    assert KVConnectorFactory.get_connector_class(kv) is NixlPushConnector


def test_wrong_connector_name_says_which_name_to_use():
    kv = KVTransferConfig(kv_connector="NixlConnector", kv_connector_module_path="connector",
                          kv_role="kv_consumer", engine_id="e")
    with pytest.raises(AttributeError) as info:
        KVConnectorFactory.get_connector_class(kv)
    chain = f"{info.value} {info.value.__cause__}"
    assert "NixlPushConnector" in chain and "kv_connector" in chain


def test_our_class_refuses_a_config_that_names_another_connector(tmp_path):
    spec = EngineSpec(name="x", engine_id="e", kv_role="kv_consumer", side_channel_port=1,
                      workdir=str(tmp_path))
    config = build_vllm_config(spec)
    config.kv_transfer_config.kv_connector = "NixlPullConnector"
    with pytest.raises(ConnectorConfigError, match='"kv_connector":"NixlPushConnector"'):
        check_connector_config(config)


def test_missing_nixl_fails_with_install_hint(tmp_path, monkeypatch):
    spec = EngineSpec(name="x", engine_id="e", kv_role="kv_consumer", side_channel_port=1,
                      workdir=str(tmp_path))
    config = build_vllm_config(spec)
    monkeypatch.setattr(base_worker, "NixlWrapper", None)
    with pytest.raises(ConnectorConfigError, match=r"pip install nixl==1\.5\.1"):
        NixlPushConnector(config, KVConnectorRole.WORKER, build_kv_cache_config(spec))


@pytest.mark.parametrize("key,value,says", [
    ("nixl_progress_delay_us", "100us", "nixl_progress_delay_us must be a whole number"),
    ("nixl_progress_delay_us", -5, "nixl_progress_delay_us must be between 0 and"),
    ("kv_transfer_cpu_affinity", "last-core", "kv_transfer_cpu_affinity must be one of contain, upstream"),
    ("kv_verify_ratio", 2, "kv_verify_ratio must be from 0 to 1"),
    ("kv_verify_escalate_s", -60, "kv_verify_escalate_s must be 0 or more seconds"),
    ("kv_verify_new_peer_requests", "some", "kv_verify_new_peer_requests must be a whole number"),
])
def test_a_bad_deployment_setting_fails_start_up_naming_it(tmp_path, key, value, says):
    spec = EngineSpec(name="x", engine_id="e", kv_role="kv_consumer", side_channel_port=1,
                      workdir=str(tmp_path))
    config = build_vllm_config(spec)
    config.kv_transfer_config.kv_connector_extra_config[key] = value
    with pytest.raises(ConnectorConfigError, match=says):
        check_connector_config(config)

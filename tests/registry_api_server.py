"""One vLLM API-server process's metrics path, for tests/test_metric_registry.py.

Run as a script: builds vLLM's real `PrometheusStatLogger` (which builds
`KVConnectorProm` -> our `build_prom_metrics`) with a real VllmConfig naming the
fork, observes stats dicts read from a JSON plan, and prints the exposition of the
default registry. `PROMETHEUS_MULTIPROC_DIR`, when the caller sets it, is in the
environment before prometheus_client is imported, as in vLLM's API servers.

Plan steps: ["logger", name] builds a PrometheusStatLogger (vLLM's rebuild path,
which unregisters vLLM's metrics first); ["kv_prom", name] builds a bare
KVConnectorProm (no unregister); ["observe", name, stats_dict] observes through it.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any


def main(plan_path: str) -> None:
    from prometheus_client import REGISTRY, generate_latest
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorProm
    from vllm.v1.metrics.loggers import PrometheusStatLogger

    from harness.config import EngineSpec, build_vllm_config

    with open(plan_path) as f:
        plan = json.load(f)
    # One model directory for every API server of a run: vLLM's model_name label
    # (the served model path) must be the same, as for API servers of one engine.
    spec = EngineSpec(name="api", engine_id="registry-test", kv_role="kv_consumer",
                      side_channel_port=1, workdir=str(Path(plan_path).parent))
    config = build_vllm_config(spec)
    model = config.model_config.served_model_name
    proms: dict[str, Any] = {}
    for step in plan:
        if step[0] == "logger":
            proms[step[1]] = PrometheusStatLogger(config, [0]).kv_connector_prom
        elif step[0] == "kv_prom":
            proms[step[1]] = KVConnectorProm(config, ["model_name", "engine"], {0: [model, "0"]})
        elif step[0] == "observe":
            proms[step[1]].observe(step[2], 0)
    sys.stdout.write("===EXPOSITION===\n" + generate_latest(REGISTRY).decode())


if __name__ == "__main__":
    main(sys.argv[1])

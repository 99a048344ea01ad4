"""deploy/ (Kubernetes), validated offline: every overlay renders with a real kubectl kustomize and passes
strict Kubernetes schemas and prometheus-operator's CRD models; its monitoring objects are the ones
dashboards/ generates; its engines run the demo's `vllm serve` arguments; its router names exactly the
overlay's P pods; its UCX port range is the one a real NIXL agent listens in. Each check is also shown
to fail on a broken manifest. Nothing here needs a cluster, a container runtime or the network.
"""

from __future__ import annotations

import copy
import functools
import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

from connector import vocabulary as V
from connector.glue import guard
from demo import engines as demo
from deploy import render

ROOT = Path(__file__).resolve().parents[1]
Obj = dict[str, Any]


@functools.cache
def _rendered(overlay: str) -> tuple[Obj, ...]:
    return tuple(render.kustomize(render.OVERLAYS / overlay))


def rendered(overlay: str) -> list[Obj]:
    """A private deep copy of one overlay's `kubectl kustomize` output (rendered once per session)."""
    return copy.deepcopy(list(_rendered(overlay)))


def by(objs: list[Obj], kind: str, name: str) -> Obj:
    [obj] = render.find(objs, kind, name)
    return obj


def router_args(objs: list[Obj]) -> list[str]:
    return by(objs, "Deployment", "router")["spec"]["template"]["spec"]["containers"][0]["args"]


def engine_container(objs: list[Obj], kind: str, name: str) -> Obj:
    return by(objs, kind, name)["spec"]["template"]["spec"]["containers"][0]


def set_kv(container: Obj, **changes: Any) -> None:
    args = container["args"]
    i = args.index(render.KV_FLAG) + 1
    kv = json.loads(args[i])
    kv.update(changes)
    args[i] = json.dumps(kv)


OVERLAYS = [p.name for p in render.overlays()]


def test_overlays_exist():
    assert OVERLAYS == ["1p1d", "2p2d"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_renders_and_passes_every_check(overlay):
    objs = rendered(overlay)
    kinds = sorted({o["kind"] for o in objs})
    assert kinds == ["ConfigMap", "Deployment", "NetworkPolicy", "PodMonitor", "PrometheusRule", "Service",
                     "StatefulSet"]
    assert render.overlay_problems(objs) == []


def test_base_renders_without_the_monitoring_component():
    objs = render.kustomize(render.ROOT / "base")
    assert not render.find(objs, "PodMonitor") and not render.find(objs, "PrometheusRule")
    assert render.engine_problems(objs) == [] and render.router_problems(objs) == []


@pytest.mark.parametrize(("overlay", "p_pods", "d_replicas"), [("1p1d", ["prefill-0"], 1),
                                                               ("2p2d", ["prefill-0", "prefill-1"], 2)])
def test_router_names_each_p_pod_with_its_engine_id_and_side_channel(overlay, p_pods, d_replicas):
    from connector.router.__main__ import parse_args
    from connector.router.config import PrefillTarget

    objs = rendered(overlay)
    args = parse_args(router_args(objs))
    targets = [PrefillTarget.parse(s) for s in args.prefill]
    assert sorted(t.engine_id for t in targets) == p_pods
    for t in targets:
        assert t.url == f"http://{t.engine_id}.prefill:8000"
        assert (t.side_channel_host, t.side_channel_port) == (f"{t.engine_id}.prefill", 5600)
    assert args.decode == ["http://decode:8000"]
    assert by(objs, "StatefulSet", "prefill")["spec"]["replicas"] == len(p_pods)
    assert by(objs, "Deployment", "decode")["spec"]["replicas"] == d_replicas


# ---------------------------------------------------------------------------------------- router <-> P
def test_a_p_pod_missing_from_the_router_is_reported():
    objs = rendered("2p2d")
    del router_args(objs)[-2:]  # the overlay's --prefill for prefill-1
    assert any("prefill-1" in p and "no --prefill entry" in p for p in render.router_problems(objs))


def test_scaling_p_without_the_router_is_reported():
    objs = rendered("1p1d")
    by(objs, "StatefulSet", "prefill")["spec"]["replicas"] = 3
    problems = render.router_problems(objs)
    assert any("['prefill-1', 'prefill-2']" in p for p in problems), problems


def test_a_router_entry_for_no_p_pod_or_a_wrong_side_channel_is_reported():
    objs = rendered("1p1d")
    args = router_args(objs)
    args[-1] = args[-1].replace("side_channel=prefill-0.prefill:5600", "side_channel=prefill-0.prefill:5601")
    problems = render.router_problems(objs)
    assert any("name no P pod" in p for p in problems) and any("no --prefill entry" in p for p in problems)


def test_a_p_service_that_is_not_headless_is_reported():
    objs = rendered("1p1d")
    by(objs, "Service", "prefill")["spec"].pop("clusterIP")
    assert any("headless" in p for p in render.router_problems(objs))


def test_a_decode_url_that_reaches_no_d_pod_is_reported():
    objs = rendered("1p1d")
    args = router_args(objs)
    args[args.index("http://decode:8000")] = "http://decode:8080"
    assert any("--decode http://decode:8080" in p for p in render.router_problems(objs))


def test_a_router_on_loopback_is_reported():
    objs = rendered("1p1d")
    args = router_args(objs)
    args[args.index("--host") + 1] = "127.0.0.1"
    assert any("loopback" in p for p in render.router_problems(objs))


# ---------------------------------------------------------------------------------------- engine args
def test_engine_args_are_the_demos_with_the_documented_differences_only():
    """The manifest's list, rebuilt from demo/engines.py: the model, no demo model flags, GPU KV buffers,
    the pod name as engine id, port 8000, the Collector as OTLP endpoint."""
    objs = rendered("1p1d")
    roles = (("StatefulSet", "prefill", "kv_producer"), ("Deployment", "decode", "kv_consumer"))
    for kind, name, role in roles:
        c = engine_container(objs, kind, name)
        kv = demo.kv_transfer_config("fork", role, "$(POD_NAME)", demo.PROGRESS_DELAY_US,
                                     kv_buffer_device="cuda")
        expected = demo.serve_args("Qwen/Qwen3-0.6B", kv, served_model_name="qwen3-0.6b", model_flags=(),
                                   otlp_endpoint="http://otel-collector:4317")
        assert c["command"] == ["vllm", "serve"]
        assert c["args"] == [*expected, "--port", "8000"]
        assert set(demo.DEMO_MODEL_FLAGS) & set(c["args"]) == set()


def test_a_change_to_the_demos_connector_config_fails_the_check(monkeypatch):
    """If the demo's engines change (here: the NIXL poll delay), deploy/ must follow."""
    objs = rendered("1p1d")
    monkeypatch.setattr(demo, "PROGRESS_DELAY_US", 250)
    problems = render.engine_problems(objs)
    assert len([p for p in problems if "differ from demo/engines.py" in p]) == 2, problems


@pytest.mark.parametrize("change", [{"kv_connector_module_path": None}, {"kv_role": "kv_both"},
                                    {"engine_id": "prefill"}, {"kv_connector_extra_config": {}}])
def test_a_different_kv_transfer_config_is_reported(change):
    objs = rendered("1p1d")
    set_kv(engine_container(objs, "StatefulSet", "prefill"), **change)
    assert any("StatefulSet/prefill: vllm serve arguments differ" in p for p in render.engine_problems(objs))


def test_an_extra_flag_or_a_model_mismatch_is_reported():
    objs = rendered("1p1d")
    engine_container(objs, "StatefulSet", "prefill")["args"] += ["--enforce-eager"]
    engine_container(objs, "Deployment", "decode")["args"][0] = "other/model"
    problems = render.engine_problems(objs)
    assert any("StatefulSet/prefill: vllm serve arguments differ" in p for p in problems)
    assert any("same model" in p for p in problems)


@pytest.mark.parametrize(("var", "value", "expect"), [
    ("VLLM_NIXL_SIDE_CHANNEL_HOST", "localhost", "VLLM_NIXL_SIDE_CHANNEL_HOST"),
    ("VLLM_NIXL_SIDE_CHANNEL_PORT", "5601", "container port `nixl`"),
    ("UCX_TCP_PORT_RANGE", "5500-5699", "UCX_TCP_PORT_RANGE"),
    ("OTEL_SERVICE_NAME", "vllm", "OTEL_SERVICE_NAME"),
])
def test_engine_env_the_connector_needs_is_checked(var, value, expect):
    objs = rendered("1p1d")
    c = engine_container(objs, "Deployment", "decode")
    [entry] = [e for e in c["env"] if e["name"] == var]
    entry.pop("valueFrom", None)
    entry["value"] = value
    assert any(expect in p and "Deployment/decode" in p for p in render.engine_problems(objs))


# ---------------------------------------------------------------------------------- trust boundary
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_network_policies_let_in_exactly_the_ports_the_engines_use(overlay):
    objs = rendered(overlay)
    assert render.network_policy_problems(objs) == []
    for role, peer in (("prefill", "decode"), ("decode", "prefill")):
        [workload] = render.engines(objs, role)
        c = render.main_container(workload)
        env = render.env(c)
        side = int(env["VLLM_NIXL_SIDE_CHANNEL_PORT"])
        low, high = render.ucx_port_range(env["UCX_TCP_PORT_RANGE"])
        http = render.container_port(c, "http")
        nixl = int(env["NIXL_TELEMETRY_PROMETHEUS_PORT"])  # NIXL's own exporter: the scraper only
        assert render.allowed_ingress(objs, render.pod_labels(workload)) == {
            (peer, side, side), (peer, low, high), ("router", http, http), ("prometheus", http, http),
            ("prometheus", nixl, nixl)}


def test_nixls_exporter_runs_as_the_demo_runs_it_and_is_scraped():
    objs = rendered("1p1d")
    assert render.nixl_monitor_problems(objs) == []
    c = engine_container(objs, "Deployment", "decode")
    next(e for e in c["env"] if e["name"] == "NIXL_TELEMETRY_EXPORTER")["value"] = "prometheus"
    assert any("NIXL_TELEMETRY_EXPORTER is 'prometheus', want 'prometheus_mp'" in p
               for p in render.engine_problems(objs))
    objs = rendered("1p1d")
    c = engine_container(objs, "Deployment", "decode")
    c["volumeMounts"] = [m for m in c["volumeMounts"] if m["mountPath"] != render.K8S_NIXL_MULTIPROC_DIR]
    assert any("must be an emptyDir volume" in p for p in render.engine_problems(objs))
    objs = rendered("1p1d")  # NIXL's port moved: the policy no longer fits
    c = engine_container(objs, "Deployment", "decode")
    next(e for e in c["env"] if e["name"] == "NIXL_TELEMETRY_PROMETHEUS_PORT")["value"] = "9401"
    assert render.network_policy_problems(objs) == [
        "decode pods: the NetworkPolicies do not let prometheus reach port(s) 9401-9401",
        "decode pods: the NetworkPolicies let prometheus reach port(s) 9400-9400, which the engines do not "
        "use for it"]
    objs = [o for o in rendered("1p1d") if not (o["kind"] == "PodMonitor"
                                                and o["metadata"]["name"] == "nixl-agents")]
    assert render.nixl_monitor_problems(objs) == [
        "expected one PodMonitor for NIXL's exporter (port nixl-metrics), found 0"]


@pytest.mark.parametrize(("var", "value", "missing", "unused"), [
    ("VLLM_NIXL_SIDE_CHANNEL_PORT", "5601", "5601-5601", "5600-5600"),
    ("UCX_TCP_PORT_RANGE", "5800-5899", "5800-5899", "5700-5799"),
])
def test_a_port_the_engines_move_fails_the_policy_check(var, value, missing, unused):
    objs = rendered("1p1d")
    c = engine_container(objs, "Deployment", "decode")
    next(e for e in c["env"] if e["name"] == var)["value"] = value
    assert render.network_policy_problems(objs) == [
        f"decode pods: the NetworkPolicies do not let prefill reach port(s) {missing}",
        f"decode pods: the NetworkPolicies let prefill reach port(s) {unused}, which the engines do not use "
        "for it"]


def test_a_missing_policy_or_an_extra_port_fails_the_policy_check():
    objs = rendered("1p1d")
    by(objs, "NetworkPolicy", "prefill-ingress")["spec"]["ingress"][1]["ports"].append({"protocol": "TCP",
                                                                                      "port": 9090})
    assert render.network_policy_problems(objs) == [
        "prefill pods: the NetworkPolicies let prometheus reach port(s) 9090-9090, which the engines do not "
        "use for it",
        "prefill pods: the NetworkPolicies let router reach port(s) 9090-9090, which the engines do not use "
        "for it"]
    objs = [o for o in rendered("1p1d") if o["kind"] != "NetworkPolicy"]
    assert render.network_policy_problems(objs) == [
        f"no NetworkPolicy selects the {role} pods: anything that reaches them can fetch their NIXL metadata"
        for role in ("prefill", "decode")]


# ---------------------------------------------------------------------------------------- monitoring
def test_monitoring_copies_are_what_dashboards_generates():
    from dashboards.generate import render_all

    generated = render_all()
    for source, dest in render.COPIES.items():
        text = (render.ROOT / dest).read_text()
        assert text == render.copy_header(source) + generated[source]
    assert render.copy_problems() == []


def test_a_stale_copy_is_reported(tmp_path):
    for dest in render.COPIES.values():
        (tmp_path / dest).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(render.ROOT / dest, tmp_path / dest)
    edited = tmp_path / render.COPIES["k8s/prometheusrule.yaml"]
    edited.write_text(edited.read_text().replace("for: ", "for:  ", 1))
    (tmp_path / render.COPIES["k8s/configmap.yaml"]).unlink()
    problems = render.copy_problems(tmp_path)
    assert len(problems) == 2 and "differs" in problems[0] and "missing" in problems[1]


def test_rendered_monitoring_objects_must_equal_the_generated_ones():
    objs = rendered("2p2d")
    rule = by(objs, "PrometheusRule", "nixl-push")
    rule["spec"]["groups"][0]["rules"].pop()
    dashboard = by(objs, "ConfigMap", "nixl-push-dashboards")
    dashboard["metadata"]["labels"]["grafana_dashboard"] = "0"
    problems = render.monitoring_problems(objs)
    assert any("PrometheusRule/nixl-push differs" in p for p in problems)
    assert any("ConfigMap/nixl-push-dashboards differs" in p for p in problems)


def test_an_overlay_may_add_a_namespace_and_selector_labels_to_the_monitoring_objects():
    objs = rendered("1p1d")
    for kind, name in (("PrometheusRule", "nixl-push"), ("ConfigMap", "nixl-push-dashboards")):
        metadata = by(objs, kind, name)["metadata"]
        metadata["namespace"] = "monitoring"
        metadata["labels"]["release"] = "kube-prometheus-stack"
    assert render.monitoring_problems(objs) == []


def test_podmonitor_scrapes_openmetrics_with_exemplars_from_every_engine():
    objs = rendered("2p2d")
    spec = by(objs, "PodMonitor", "nixl-push-engines")["spec"]
    [endpoint] = spec["podMetricsEndpoints"]
    assert endpoint["path"] == "/metrics/" and spec["scrapeProtocols"][0] == "OpenMetricsText1.0.0"
    endpoint["path"] = "/metrics"
    spec["selector"]["matchExpressions"][0]["values"] = ["decode"]
    endpoint["metricRelabelings"][0]["replacement"] = "vllm_$1"
    problems = render.monitoring_problems(objs)
    assert any("path '/metrics'" in p for p in problems)
    assert any("does not select the prefill pods" in p for p in problems)
    assert any("metricRelabelings" in p for p in problems)


def test_a_podmonitor_scrapes_the_routers_own_metrics():
    objs = rendered("1p1d")
    spec = by(objs, "PodMonitor", "nixl-push-router")["spec"]
    [endpoint] = spec["podMetricsEndpoints"]
    router_pod = by(objs, "Deployment", "router")["spec"]["template"]["metadata"]["labels"]
    assert render.selects(spec["selector"], router_pod)
    assert endpoint["path"] == V.ROUTER_METRICS_PATH and router_pod[spec["jobLabel"]] == "router"
    # Neither PodMonitor scrapes the other's pods.
    engines = by(objs, "PodMonitor", "nixl-push-engines")["spec"]["selector"]
    assert not render.selects(engines, router_pod)
    assert not any(render.selects(spec["selector"], render.pod_labels(w))
                   for role in render.KV_ROLES for w in render.engines(objs, role))


@pytest.mark.parametrize(("change", "expect"), [
    (lambda m, r: m["spec"]["podMetricsEndpoints"][0].update(path="/metrics/"),
     "is not the router's /metrics"),
    (lambda m, r: m["spec"]["podMetricsEndpoints"][0].update(port="grpc"), "is not the router's --port 8000"),
    (lambda m, r: m["spec"].update(jobLabel="app.kubernetes.io/part-of"), "does not give job='router'"),
    (lambda m, r: m["spec"].update(scrapeProtocols=["PrometheusText0.0.4"]), "OpenMetricsText1.0.0 first"),
    (lambda m, r: m["spec"]["selector"]["matchLabels"].update({"app.kubernetes.io/component": "gateway"}),
     "expected one PodMonitor for the router's /metrics, found 0"),
    (lambda m, r: r["spec"]["template"]["metadata"]["labels"].pop("app.kubernetes.io/name"),
     "does not give job='router'"),
])
def test_a_router_podmonitor_that_misses_the_routers_metrics_is_reported(change, expect):
    objs = rendered("1p1d")
    change(by(objs, "PodMonitor", "nixl-push-router"), by(objs, "Deployment", "router"))
    problems = render.monitoring_problems(objs)
    assert any(expect in p for p in problems), problems


def test_without_the_router_podmonitor_the_check_fails():
    objs = [o for o in rendered("2p2d") if o["metadata"]["name"] != "nixl-push-router"]
    assert "expected one PodMonitor for the router's /metrics, found 0" in render.monitoring_problems(objs)


# ---------------------------------------------------------------------------------------- tracing
def test_every_otlp_endpoint_reaches_the_collectors_grpc_receiver():
    objs = rendered("1p1d")
    c = engine_container(objs, "Deployment", "decode")
    args = c["args"]
    args[args.index("http://otel-collector:4317")] = "http://otel-collector:4318"  # the HTTP receiver
    problems = render.collector_problems(objs)
    assert problems == ["Deployment/decode: http://otel-collector:4318 does not reach the Collector's "
                        "OTLP/gRPC receiver (:4317)"]


def test_collector_pipelines_name_only_defined_components():
    objs = rendered("1p1d")
    cm = by(objs, "ConfigMap", "otel-collector-config")
    config = yaml.safe_load(cm["data"]["config.yaml"])
    assert render.pipeline_problems(config) == []
    config["service"]["pipelines"]["traces"]["exporters"] = ["otlp/tempo"]
    cm["data"]["config.yaml"] = yaml.safe_dump(config)
    assert any("exporter 'otlp/tempo' is not defined" in p for p in render.collector_problems(objs))


# ---------------------------------------------------------------------------------------- schemas
def test_schema_validation_catches_unknown_fields_and_bad_values():
    objs = rendered("1p1d")
    engine_container(objs, "StatefulSet", "prefill")["portz"] = []
    by(objs, "Service", "router")["spec"]["ports"][0]["port"] = "eight thousand"
    monitor = by(objs, "PodMonitor", "nixl-push-engines")["spec"]
    monitor["scrapeProtocol"] = monitor.pop("scrapeProtocols")  # a typo the operator would ignore
    rule = by(objs, "PrometheusRule", "nixl-push")["spec"]["groups"][0]
    rule["rules"][0]["expr"] = {"not": "a string"}
    problems = render.schema_problems(objs, versions=["1.37.0"])
    assert any(p.startswith("StatefulSet/prefill (Kubernetes 1.37.0)") and "portz" in p for p in problems)
    assert any(p.startswith("Service/router (Kubernetes 1.37.0)") for p in problems)
    assert any(p == "PodMonitor/nixl-push-engines: unknown field /spec/scrapeProtocol" for p in problems)
    assert any(p.startswith("PrometheusRule/nixl-push:") for p in problems)
    assert {p.split(":")[0].split(" (")[0] for p in problems} == {  # nothing else is flagged
        "StatefulSet/prefill", "Service/router", "PodMonitor/nixl-push-engines", "PrometheusRule/nixl-push"}


def test_a_wrong_scrape_protocol_value_is_reported():
    objs = rendered("1p1d")
    by(objs, "PodMonitor", "nixl-push-engines")["spec"]["scrapeProtocols"] = ["OpenMetrics"]
    assert render.operator_problems(by(objs, "PodMonitor", "nixl-push-engines"))


# ---------------------------------------------------------------------------------------- UCX ports
UCX_PROBE = """
import json, os, sys
from nixl._api import nixl_agent, nixl_agent_config

def listening():  # TCP ports this process listens on
    sockets = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            sockets.add(target[8:-1])
    ports = set()
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        for line in open(table).read().splitlines()[1:]:
            f = line.split()
            if f[3] == "0A" and f[9] in sockets:
                ports.add(int(f[1].rsplit(":", 1)[1], 16))
    return ports

agents, result, before = [], {}, listening()  # agents kept alive: their sockets
for label, value in (("unset", None), ("range", sys.argv[1])):
    if value is None:
        os.environ.pop("UCX_TCP_PORT_RANGE", None)
    else:
        os.environ["UCX_TCP_PORT_RANGE"] = value  # UCX reads it when the agent's context is created
    agents.append(nixl_agent(f"deploy-probe-{label}", nixl_agent_config(backends=["UCX"])))
    now = listening()
    result[label] = sorted(now - before)
    before = now
print(json.dumps(result))
"""


def test_a_real_nixl_agent_listens_inside_the_manifests_ucx_port_range():
    """The UCX_TCP_PORT_RANGE the engines get is what pins UCX's TCP listeners (a NetworkPolicy can
    then allow it); an agent made without it listens on random ports."""
    objs = rendered("1p1d")
    value = render.env(engine_container(objs, "StatefulSet", "prefill"))["UCX_TCP_PORT_RANGE"]
    low, high = render.ucx_port_range(value)
    environment = {k: v for k, v in os.environ.items() if not k.startswith("UCX_")}
    out = subprocess.run([sys.executable, "-c", UCX_PROBE, value], env=environment, capture_output=True,
                         text=True, timeout=300, check=True).stdout
    ports = json.loads(out.strip().splitlines()[-1])
    assert ports["range"] and all(low <= p <= high for p in ports["range"]), (value, ports)
    assert ports["unset"] and not all(low <= p <= high for p in ports["unset"]), ports


# ---------------------------------------------------------------------------------------- image
def _lock_version(name: str, lock: str) -> str:
    for line in (ROOT / "requirements" / lock).read_text().splitlines():
        if line.startswith(name + "=="):
            return line.split("==", 1)[1]
    raise AssertionError(f"{name} not in {lock}")


def test_image_recipe_builds_on_the_newest_tested_vllm_and_manifests_use_its_tag():
    text = (render.ROOT / "Containerfile").read_text()
    vllm = _lock_version("vllm", "vllm034.lock")
    assert guard.version_tested(vllm)
    [image] = re.findall(r"^ARG VLLM_IMAGE=(\S+)$", text, re.M)
    assert image == f"docker.io/vllm/vllm-openai:v{vllm}"
    assert re.search(r"^FROM \$\{VLLM_IMAGE\}$", text, re.M)
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    tag = f"nixl-push-observed:{version}-vllm{vllm}"
    for overlay in OVERLAYS:
        ours = {c["image"] for w in render.workloads(rendered(overlay)) for c in render.containers(w)
                if "nixl-push-observed" in c["image"]}
        assert ours == {tag}
    assert '"nixl==1.5.1"' in (ROOT / "pyproject.toml").read_text() and 'm.version("nixl") == "1.5.1"' in text


def test_image_build_context_admits_exactly_what_the_recipe_copies():
    text = (render.ROOT / "Containerfile").read_text()
    sources = [s for line in re.findall(r"^COPY (?!--from)(.+)$", text, re.M) for s in line.split()[:-1]]
    ignore = (render.ROOT / "Containerfile.dockerignore").read_text().splitlines()
    allowed = {line[1:].rstrip("/") for line in ignore if line.startswith("!")}
    assert sorted(sources) == sorted(allowed)
    assert all((ROOT / s).exists() for s in sources)
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert pyproject["project"]["readme"] in sources  # setuptools reads it while building the package
    assert pyproject["tool"]["setuptools"]["packages"]["find"]["include"][0] in sources


def test_deploy_render_check_passes(capsys):
    assert render.main(["--check"]) == 0
    assert "deploy check OK" in capsys.readouterr().out


# ---------------------------------------------------------------------------------------- docs
def yaml_block_after(marker: str) -> str:
    text = (ROOT / "docs" / "kubernetes.md").read_text()
    start = text.index(marker)
    match = re.search(r"```yaml\n(.*?)```", text[start:], re.S)
    assert match, f"no yaml block after {marker!r}"
    return match.group(1)


def test_the_user_overlay_in_the_docs_renders_and_passes_every_check(tmp_path):
    """docs/kubernetes.md's own overlay (image from a registry, traces to Tempo), as written there."""
    (tmp_path / "deploy").symlink_to(render.ROOT, target_is_directory=True)
    overlay = tmp_path / "my-overlay"
    overlay.mkdir()
    (overlay / "kustomization.yaml").write_text(yaml_block_after("renders the next yaml block"))
    (overlay / "config.yaml").write_text(yaml_block_after("uses the next yaml block as config.yaml"))
    objs = render.kustomize(overlay)
    assert render.overlay_problems(objs) == []
    images = {c["image"] for w in render.workloads(objs) for c in render.containers(w)}
    assert "registry.example.com/team/nixl-push-observed:0.1.0-vllm0.34.0" in images
    config = yaml.safe_load(by(objs, "ConfigMap", "otel-collector-config")["data"]["config.yaml"])
    assert list(config["exporters"]) == ["otlp/tempo"]

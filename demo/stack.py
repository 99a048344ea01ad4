"""The whole deployment on loopback: OTLP receiver, P and D `vllm serve`, router, Prometheus.

Shared by `python -m demo` and the end-to-end test. `close()` stops every process it
started, by pid (and their sessions), also when start-up failed half way.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dashboards import promrun
from demo.engines import LOOPBACK, PROGRESS_DELAY_US, REPO, Process, RouterProcess, VllmServer, alive
from demo.model import random_checkpoint
from harness.otlp_receiver import OtlpGrpcReceiver

JOB = "vllm"
# vLLM 0.32 serves `/metrics` through prometheus-fastapi-instrumentator, which always
# answers the classic text format (no exemplars, whatever the Accept header says).
# `/metrics/` reaches prometheus_client's own ASGI app, mounted behind it, which
# negotiates OpenMetrics and so carries exemplars.
OPENMETRICS_PATH = "/metrics/"
MODEL_CACHE = REPO / ".cache" / "demo-model"


class Stack:
    """Start with `start()`, stop with `close()` (or use as a context manager)."""

    def __init__(self, workdir: Path, *, connector: str = "fork", otlp_endpoint: str | None = None,
                 progress: Callable[[str], None] = lambda _: None,
                 nixl_progress_delay_us: int | None = PROGRESS_DELAY_US,
                 kv_overrides: dict[str, Any] | None = None):
        self.workdir = workdir
        self.kv_overrides = kv_overrides
        self.nixl_progress_delay_us = nixl_progress_delay_us
        self.connector = connector
        self.user_endpoint = otlp_endpoint
        self.progress = progress
        self.receiver: OtlpGrpcReceiver | None = None
        self.prefill: VllmServer | None = None
        self.decode: VllmServer | None = None
        self.router: RouterProcess | None = None
        self.prometheus: promrun.PrometheusServer | None = None
        self.model: Path | None = None
        self.prometheus_pid: int | None = None
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

    def _start(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.model = random_checkpoint(MODEL_CACHE)
        if not self.user_endpoint:
            self.receiver = OtlpGrpcReceiver()
        self.progress(f"OTLP/gRPC traces -> {self.otlp_endpoint}"
                      + ("" if self.user_endpoint else " (local receiver)"))
        self.prefill = VllmServer(self.workdir, name="prefill", kv_role="kv_producer",
                                  engine_id="prefill-0", cpu=0, model=self.model,
                                  connector=self.connector, otlp_endpoint=self.otlp_endpoint,
                                  progress_delay_us=self.nixl_progress_delay_us,
                                  kv_overrides=self.kv_overrides)
        self.decode = VllmServer(self.workdir, name="decode", kv_role="kv_consumer",
                                 engine_id="decode-0", cpu=1, model=self.model,
                                 connector=self.connector, otlp_endpoint=self.otlp_endpoint,
                                  progress_delay_us=self.nixl_progress_delay_us,
                                  kv_overrides=self.kv_overrides)
        self.progress(f"vllm serve P pid {self.prefill.pid} log {self.prefill.log_path}")
        self.progress(f"vllm serve D pid {self.decode.pid} log {self.decode.log_path}")
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
        self.router = RouterProcess(self.workdir, [self.prefill], [self.decode], self.otlp_endpoint)
        self.router.wait_ready()
        self.progress(f"router {self.router.url} pid {self.router.pid} log {self.router.log_path}")
        targets = [f"{LOOPBACK}:{s.port}" for s in (self.prefill, self.decode)]
        job = promrun.scrape_job(JOB, targets)
        job["metrics_path"] = OPENMETRICS_PATH
        self.prometheus = promrun.PrometheusServer(
            [job], rule_files=[promrun.RULES_PATH],
            workdir=self.workdir / "prometheus", features=["exemplar-storage"]).start()
        self.prometheus_pid = self.prometheus.process.pid  # type: ignore[union-attr]
        self.prometheus.wait_for(f'sum(up{{job="{JOB}"}})', lambda v: v == 2, timeout_s=60,
                                 what="Prometheus scraping both engines")
        self.progress(f"Prometheus {self.prometheus.url} pid {self.prometheus_pid} "
                      f"scraping both engines, rules loaded, exemplar storage on")

    def spans(self) -> list[dict[str, Any]]:
        return self.receiver.snapshot() if self.receiver is not None else []

    def close(self) -> None:
        """Stop everything started (idempotent)."""
        if self._closed:
            return
        self._closed = True
        if self.prometheus is not None:
            self.prometheus.stop()
        for proc in reversed(self.processes):
            proc.stop()
        if self.receiver is not None:
            self.receiver.close()

    def leftovers(self) -> list[int]:
        """Pids of anything this stack started that is still alive."""
        out = [pid for p in self.processes for pid in p.leftovers()]
        if self.prometheus_pid is not None and alive(self.prometheus_pid):
            out.append(self.prometheus_pid)
        return out

    def __enter__(self) -> Stack:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


def wait_until(cond: Callable[[], Any], timeout_s: float, what: str, step_s: float = 0.25) -> Any:
    """Poll `cond` until it returns something truthy; raise TimeoutError naming `what`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(step_s)
    raise TimeoutError(f"timed out after {timeout_s:.0f}s waiting for {what}")

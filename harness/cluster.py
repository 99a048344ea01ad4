"""Multi-rank engines: one OS process per TP/PP rank, like vLLM's multiprocess executor.

Each rank runs `harness.engine.engine_main` with its own NIXL agent and KV cache
(its slice of KV heads and layers), and all ranks of one engine join one real
torch.distributed (gloo, file://) group. As in vLLM, rank 0's scheduler-role
connector hosts the side channel; the parent gathers every rank's handshake
payload and hands the `{(pp_rank, tp_rank): payload}` map to rank 0.
"""

from __future__ import annotations

import multiprocessing as mp
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from harness.config import EngineSpec
from harness.runner import EngineError, EngineHandle

# Ranks of several engines start at once on a small, shared machine: be patient.
START_TIMEOUT_S = 600.0


# Rank processes fork from one server that has imported these once: on a 2-core
# machine, importing torch + vLLM in every rank process is most of the start-up.
PRELOAD = ["torch", "vllm.config", "vllm.distributed", "vllm.v1.worker.utils",
           "vllm.distributed.kv_transfer.kv_connector.factory", "connector", "harness.engine"]


def rank_context() -> Any:
    """The multiprocessing context rank processes start from (forkserver, preloaded)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


class Cluster:
    """One engine made of `tp_size * pp_size` rank processes."""

    def __init__(self, spec: EngineSpec):
        self.spec = spec
        work = Path(spec.workdir)
        work.mkdir(parents=True, exist_ok=True)
        init_file = str(work / f"dist-{spec.engine_id}")
        Path(init_file).unlink(missing_ok=True)
        self.rank_specs = [
            replace(spec, name=f"{spec.name}.r{r}", rank=r, dist_init_file=init_file,
                    log_file=str(work / f"{spec.name}.rank{r}.log"))
            for r in range(spec.world_size)
        ]
        self.ranks: list[EngineHandle] = []
        self._next_block = 0

    @property
    def name(self) -> str:
        return self.spec.name

    def start(self) -> Cluster:
        """Spawn every rank at once (they rendezvous in gloo), then serve metadata."""
        self.launch()
        return self.finish_start()

    def launch(self) -> None:
        """Spawn the rank processes without waiting (start several engines in parallel)."""
        ctx = rank_context()
        self.ranks = [EngineHandle(s, ctx) for s in self.rank_specs]

    def finish_start(self) -> Cluster:
        """Wait for every rank, then hand rank 0 every rank's metadata."""
        try:
            for handle in self.ranks:
                handle.wait_ready(START_TIMEOUT_S)
            payloads = {}
            for handle, rs in zip(self.ranks, self.rank_specs):
                payloads[(rs.pp_rank, rs.tp_rank)] = handle.call("handshake_payload")
            self.ranks[0].call("serve_metadata", payloads)
        except Exception:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        for handle in self.ranks:  # every rank shuts down at once
            handle.request_stop()
        for handle in self.ranks:
            handle.finish_stop()

    def __enter__(self) -> Cluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def address(self) -> dict[str, Any]:
        """What a D needs to reach this engine (kv_transfer_params of the router)."""
        return {"engine_id": self.spec.engine_id, "host": "127.0.0.1",
                "port": self.spec.side_channel_port, "tp_size": self.spec.tp_size,
                "pp_size": self.spec.pp_size}

    def call_all(self, name: str, *args: Any, timeout: float = 60.0) -> list[Any]:
        """Send a command to every rank first, then collect the answers (ranks work in parallel)."""
        for handle in self.ranks:
            handle._conn.send((name, args))
        return [handle._receive(timeout) for handle in self.ranks]

    def allocate(self, n: int) -> list[int]:
        """Distinct block ids (same on every rank, as vLLM's one scheduler hands out)."""
        total = self.spec.num_blocks - 1
        if self._next_block + n > total:
            raise EngineError(f"engine {self.name} ran out of blocks ({total} usable)")
        ids = list(range(1 + self._next_block, 1 + self._next_block + n))
        self._next_block += n
        return ids

    def kv_view(self, block_ids: list[int]) -> np.ndarray:
        """The engine's KV for `block_ids` as one array over all ranks.

        Shape [layers, heads, tokens, C] with global layer and head order: PP
        ranks contribute their layers, TP ranks their heads; blocks are
        flattened to tokens so engines with different block sizes compare.
        """
        per_rank = self.call_all("blocks", block_ids)
        layers: dict[int, list[Any]] = {}
        for rs, caches in zip(self.rank_specs, per_rank):
            for name, arr in caches.items():
                layer = int(name.split(".")[2])
                layers.setdefault(layer, [None] * self.spec.tp_size)[rs.tp_rank] = arr
        out = []
        for layer in sorted(layers):
            # The CPU backend's per-layer view is [blocks, heads, block_size, C].
            arr = np.concatenate(layers[layer], axis=1)
            nb, heads, bs, c = arr.shape
            out.append(arr.transpose(1, 0, 2, 3).reshape(heads, nb * bs, c))
        return np.stack(out)

    def head_slices(self) -> list[tuple[int, int]]:
        """[start, end) of the global KV heads each TP rank holds."""
        per = self.spec.num_kv_heads // self.spec.tp_size
        return [(t * per, (t + 1) * per) for t in range(self.spec.tp_size)]


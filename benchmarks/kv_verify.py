"""What the KV check costs: the digest against a gather of the same blocks; engine CPU on real serve.

Part 1, `digest` (this process; torch only, no vLLM or NIXL: `--device cuda` runs on a
GPU machine with torch alone): on `--threads` threads (1 by default), for the demo's
tiny Llama (fp32, 2 KV heads of 32 channels) and a Llama-3.1-8B layer (bf16, 8 KV heads
of 128 channels), blocks of 16 tokens with K and V packed in a block's content as vLLM
lays a layer out: a request's blocks scattered in a cache of at least 2,048 blocks,
8 MiB and 64 MiB of them. Side by side in one run, medians of `--repeats`: the digest
(`connector.integrity.digest.digest`) and a gather of the same blocks into a buffer
allocated once (`index_select`, the floor of any digest that reads the blocks), each
with the caches cold (a buffer larger than the last-level cache written before each
repeat: the KV a check reads was written by the forward pass or the NIC, not by this
core) and warm (the same blocks read again). Then the digest of one request's whole
KV at the demo's prompt sizes and at an 8k-token Llama-3.1-8B prompt (32 layers).
On CUDA also: how long the host waits for `digest()` while a long kernel is queued on
the compute stream, against the same digest read back on the compute stream.

Part `alternatives` (torch only, like part 1): the candidates for fusing the digest's
passes into one, for the Llama-3.1-8B layer at 8 MiB and 64 MiB, side by side with the
gather and the shipped digest over the same blocks: `torch.compile` of the digest's row
sums as one function (gather, weighting and row sums: one loop; compiled once, dynamic
shapes; its compile time is printed), and `torch._int_mm`, an int8 matrix product with
int32 sums (a fused multiply-and-sum of another definition: the KV's bytes times int8
weights; timed on the gathered blocks, plus the gather), and a native loop (C++ built
here with torch's `load_inline`, `-O3 -march=native`: each block read in place, each
row's weighted lanes summed in 32-bit registers; skipped where no compiler is found).
Each is checked against its eager form before it is timed. Then one tiny request (the
demo's 2 layers, 64 tokens, cold): the shipped digest against the native row sums of
both layers plus the same fold, the fixed cost a thread that digests rarely pays.

Part 2, `serve` (paired on real `vllm serve`): a fresh P/D pair of the fork per
`kv_verify_ratio` (P and D each pinned to its own core, the project's router, the
demo's model), a steady stream of `--concurrency` clients with fresh prompts; over a
window of `--seconds`, the CPU of every thread of both engines from /proc and each
request's latency (non-streamed, `--max-tokens` tokens: TTFT plus a few decode
steps). The pairs run one after the other in alternating order over `--rounds`
rounds; medians over rounds. Figures, not checks. (`engine-cpu` splits the same by
thread.)
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import BenchRun
from connector.integrity.digest import digest, layer_digest

BLOCK = 16
MIB = 1 << 20
SIZES_MIB = (8, 64)
# (name, kv heads, channels per head (K and V: twice this), dtype)
LAYERS = (
    ("demo tiny Llama", 2, 32, torch.float32),
    ("Llama-3.1-8B layer", 8, 128, torch.bfloat16),
)
# (name, layers, kv heads, channels per head, dtype, prompt tokens): one request's whole KV
REQUESTS = (
    ("demo tiny Llama, 64 tokens", 2, 2, 32, torch.float32, 64),
    ("demo tiny Llama, 480 tokens", 2, 2, 32, torch.float32, 480),
    ("Llama-3.1-8B, 8k tokens", 32, 8, 128, torch.bfloat16, 8192),
)


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--parts", default="digest,serve",
                    help="comma-separated: digest, alternatives, serve")
    ap.add_argument("--device", default="cpu", help="the digest part's device: cpu or cuda")
    ap.add_argument("--threads", type=int, default=1, help="torch threads for the digest part")
    ap.add_argument("--repeats", type=int, default=7, help="timings per figure (median)")
    ap.add_argument("--ratios", default="0,0.01,0.1,1", help="kv_verify_ratio of each pair")
    ap.add_argument("--rounds", type=int, default=2, help="rounds over the ratios (alternating order)")
    ap.add_argument("--seconds", type=int, default=30, help="measurement window per pair")
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=20, help="requests before the window")


# ------------------------------------------------------------------- part 1
class Timer:
    """Median wall time of a call on `device` (CUDA: synchronized around it), with the
    caches evicted before each repeat or not."""

    def __init__(self, device: torch.device, repeats: int):
        self.device, self.repeats = device, repeats
        # Larger than any last-level cache we run on (a CPU's L3, an H100's 50 MB L2).
        self._scratch = torch.zeros(256 * MIB // 4, dtype=torch.int32, device=device)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def median(self, fn: Callable[[], Any], *, cold: bool) -> float:
        fn()  # (weights built, buffers allocated: as after a first request)
        times = []
        for _ in range(self.repeats):
            if cold:
                self._scratch.add_(1)
            self._sync()
            t = time.perf_counter()
            fn()
            self._sync()
            times.append(time.perf_counter() - t)
        return statistics.median(times)


def _cache(blocks: int, heads: int, channels: int, dtype: torch.dtype, device: torch.device,
           seed: int = 1) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn((blocks, heads, BLOCK, 2 * channels), generator=gen).to(dtype).to(device)


def _scattered(timer: Timer, heads: int, channels: int, dtype: torch.dtype,
               mib: int) -> tuple[torch.Tensor, torch.Tensor, list[int], int]:
    """A cache of at least 2,048 blocks and `mib` MiB of its blocks in a random order: the
    cache, their ids (on the device and as a list) and one block's bytes."""
    block_bytes = heads * BLOCK * 2 * channels * torch.empty((), dtype=dtype).element_size()
    count = mib * MIB // block_bytes
    cache = _cache(max(2048, 2 * count), heads, channels, dtype, timer.device)
    ids = torch.randperm(cache.shape[0], generator=torch.Generator().manual_seed(mib))[:count]
    return cache, ids.to(timer.device), ids.tolist(), block_bytes


def speed_row(timer: Timer, name: str, heads: int, channels: int, dtype: torch.dtype,
              mib: int) -> dict[str, Any]:
    """The digest against a gather of the same blocks, for one layer shape and size."""
    cache, ids, block_ids, block_bytes = _scattered(timer, heads, channels, dtype, mib)
    count = len(block_ids)
    out = torch.empty((count, *cache.shape[1:]), dtype=dtype, device=timer.device)
    row: dict[str, Any] = {"shape": name, "kv_mib": mib, "blocks": count, "block_kib": block_bytes / 1024}
    for cold in (True, False):
        which = "cold" if cold else "warm"
        gather = timer.median(lambda: torch.index_select(cache, 0, ids, out=out), cold=cold)
        dig = timer.median(lambda: digest([(0, cache)], block_ids, head0=0), cold=cold)
        row[f"gather_gbps_{which}"] = mib * MIB / gather / 1e9
        row[f"digest_gbps_{which}"] = mib * MIB / dig / 1e9
        row[f"digest_share_of_gather_{which}"] = gather / dig
    return row


def speed_rows(timer: Timer, bench: BenchRun) -> list[dict[str, Any]]:
    rows = []
    for name, heads, channels, dtype in LAYERS:
        for mib in SIZES_MIB:
            row = speed_row(timer, name, heads, channels, dtype, mib)
            rows.append(row)
            bench.say(f"{name}, {mib} MiB in {row['blocks']} blocks: digest {row['digest_gbps_cold']:.1f} "
                      f"GB/s, gather {row['gather_gbps_cold']:.1f} GB/s cold "
                      f"({row['digest_share_of_gather_cold']:.0%}); warm "
                      f"{row['digest_gbps_warm']:.1f} / {row['gather_gbps_warm']:.1f} GB/s "
                      f"({row['digest_share_of_gather_warm']:.0%})")
    return rows


def _request_kv(timer: Timer, layers: int, heads: int, channels: int, dtype: torch.dtype,
                tokens: int) -> tuple[list[tuple[int, torch.Tensor]], list[int]]:
    """One request's KV: a cache per layer (its own values) and the request's blocks in it."""
    blocks = -(-tokens // BLOCK)
    caches = [(layer, _cache(blocks + 8, heads, channels, dtype, timer.device, seed=layer))
              for layer in range(layers)]
    return caches, list(range(4, 4 + blocks))


def request_row(timer: Timer, name: str, layers: int, heads: int, channels: int, dtype: torch.dtype,
                tokens: int) -> dict[str, Any]:
    """One digest of a request's whole KV, as P computes it before a WRITE and D after it
    landed (the same function)."""
    caches, ids = _request_kv(timer, layers, heads, channels, dtype, tokens)
    blocks = len(ids)
    mib = blocks * heads * BLOCK * 2 * channels * caches[0][1].element_size() * layers / MIB
    median = timer.median(lambda: digest(caches, ids, head0=0), cold=True)
    return {"shape": name, "layers": layers, "kv_heads": heads, "channels": channels,
            "dtype": str(dtype).removeprefix("torch."), "tokens": tokens, "kv_mib": round(mib, 3),
            "digest_ms": median * 1e3, "ms_per_mib": median * 1e3 / mib}


def request_rows(timer: Timer, bench: BenchRun) -> list[dict[str, Any]]:
    rows = []
    for spec in REQUESTS:
        row = request_row(timer, *spec)
        rows.append(row)
        bench.say(f"digest of one request, {row['shape']}: {row['kv_mib']:.2f} MiB of KV in "
                  f"{row['digest_ms']:.2f} ms ({row['kv_mib'] / 1024 / row['digest_ms'] * 1e3:.2f} GiB/s; "
                  f"median of {timer.repeats})")
    return rows


def host_wait(timer: Timer, bench: BenchRun) -> dict[str, Any]:
    """CUDA: the host's wait for `digest()` while the compute stream is busy, against the
    same digest computed on the compute stream and read back there (what a digest that
    used the current stream would cost the engine's thread)."""
    device = timer.device
    heads, channels, dtype = LAYERS[-1][1:]
    cache = _cache(2048, heads, channels, dtype, device)
    ids = list(range(0, 2048, 2))  # 64 MiB
    busy_ms = 200.0
    cycles = _cycles_for(busy_ms, device)

    def waited(read_back_on_compute: bool) -> float:
        torch.cuda.synchronize(device)
        torch.cuda._sleep(cycles)  # a long kernel queued on the compute stream
        t = time.perf_counter()
        if read_back_on_compute:
            layer_digest(cache, ids, layer=0, head0=0).cpu()
        else:
            digest([(0, cache)], ids, head0=0)
        elapsed = time.perf_counter() - t
        torch.cuda.synchronize(device)
        return elapsed

    waited(False)
    ours = statistics.median(waited(False) for _ in range(timer.repeats))
    compute = statistics.median(waited(True) for _ in range(timer.repeats))
    bench.say(f"host wait with a {busy_ms:.0f} ms kernel queued on the compute stream: digest() "
              f"{ours * 1e3:.1f} ms; the same digest read back on the compute stream {compute * 1e3:.1f} ms")
    return {"queued_kernel_ms": busy_ms, "digest_host_wait_ms": ours * 1e3,
            "compute_stream_read_back_ms": compute * 1e3}


def _cycles_for(ms: float, device: torch.device) -> int:
    """GPU clock cycles that `torch.cuda._sleep` spins for about `ms` here (measured)."""
    probe = 10_000_000
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(probe)
    end.record()
    torch.cuda.synchronize(device)
    return int(probe * ms / max(start.elapsed_time(end), 1e-3))


def digest_part(args: argparse.Namespace, bench: BenchRun) -> dict[str, Any]:
    device = torch.device(args.device)
    torch.set_num_threads(args.threads)
    timer = Timer(device, args.repeats)
    what = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    bench.say(f"digest on {device} ({what}), {args.threads} thread(s), medians of {args.repeats}")
    result = {"device": str(device), "threads": args.threads,
              "speed": speed_rows(timer, bench), "requests": request_rows(timer, bench)}
    if device.type == "cuda":
        result["host_wait"] = host_wait(timer, bench)
    print("\nshape | KiB/block | MiB | digest GB/s | gather GB/s | digest/gather (cold) | (warm)")
    for r in result["speed"]:
        print(f"{r['shape']} | {r['block_kib']:.0f} | {r['kv_mib']} | {r['digest_gbps_cold']:.1f} | "
              f"{r['gather_gbps_cold']:.1f} | {r['digest_share_of_gather_cold']:.0%} | "
              f"{r['digest_share_of_gather_warm']:.0%}")
    return result


# ------------------------------------------------------ part: alternatives
# A candidate, not shipped: the row sums as one loop that reads each block where it lies.
# Unsigned 32-bit arithmetic wraps by definition, which is the digest's modulo 2^32.
_NATIVE_DIGEST = r"""
#include <torch/extension.h>
#include <cstdint>
torch::Tensor row_sums(torch::Tensor lanes, torch::Tensor ids, torch::Tensor weights) {
  TORCH_CHECK(lanes.dim() == 4 && lanes.is_contiguous() && lanes.scalar_type() == torch::kInt32,
              "lanes: a contiguous int32 [blocks, heads, slots, lanes] view");
  TORCH_CHECK(weights.is_contiguous() && weights.scalar_type() == torch::kInt32, "weights: int32");
  TORCH_CHECK(ids.is_contiguous() && ids.scalar_type() == torch::kInt64, "ids: int64");
  const int64_t heads = lanes.size(1), slots = lanes.size(2), width = lanes.size(3);
  const int64_t n = ids.size(0), blocks = lanes.size(0);
  auto out = torch::empty({n, heads, slots}, lanes.options());
  const auto* base = reinterpret_cast<const uint32_t*>(lanes.data_ptr<int32_t>());
  const auto* w = reinterpret_cast<const uint32_t*>(weights.data_ptr<int32_t>());
  auto* o = reinterpret_cast<uint32_t*>(out.data_ptr<int32_t>());
  const int64_t* id = ids.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(id[i] >= 0 && id[i] < blocks, "block id out of range");
    const uint32_t* block = base + id[i] * heads * slots * width;
    for (int64_t h = 0; h < heads; ++h) {
      const uint32_t* wh = w + h * width;
      for (int64_t s = 0; s < slots; ++s) {
        const uint32_t* row = block + (h * slots + s) * width;
        uint32_t sum = 0;
        for (int64_t l = 0; l < width; ++l) sum += row[l] * wh[l];
        *o++ = sum;
      }
    }
  }
  return out;
}

// The whole digest of several layers in one call: row sums, per token over the heads, times
// a 64-bit position weight, summed modulo 2^64 (unsigned: wrapping by definition).
torch::Tensor digest_layers(std::vector<torch::Tensor> lanes, torch::Tensor ids,
                            std::vector<torch::Tensor> weights, torch::Tensor positions) {
  TORCH_CHECK(lanes.size() == weights.size(), "one weight tensor per layer");
  const int64_t n = ids.size(0);
  auto out = torch::empty({static_cast<int64_t>(lanes.size())}, ids.options());
  const auto* pos = reinterpret_cast<const uint64_t*>(positions.data_ptr<int64_t>());
  const int64_t* id = ids.data_ptr<int64_t>();
  for (size_t k = 0; k < lanes.size(); ++k) {
    const auto& t = lanes[k];
    TORCH_CHECK(t.dim() == 4 && t.is_contiguous() && t.scalar_type() == torch::kInt32, "lanes");
    const int64_t heads = t.size(1), slots = t.size(2), width = t.size(3);
    TORCH_CHECK(positions.size(0) >= n * slots, "a position weight per token");
    const auto* base = reinterpret_cast<const uint32_t*>(t.data_ptr<int32_t>());
    const auto* w = reinterpret_cast<const uint32_t*>(weights[k].data_ptr<int32_t>());
    uint64_t total = 0;
    for (int64_t i = 0; i < n; ++i) {
      TORCH_CHECK(id[i] >= 0 && id[i] < t.size(0), "block id out of range");
      const uint32_t* block = base + id[i] * heads * slots * width;
      for (int64_t s = 0; s < slots; ++s) {
        uint64_t token = 0;
        for (int64_t h = 0; h < heads; ++h) {
          const uint32_t* row = block + (h * slots + s) * width;
          const uint32_t* wh = w + h * width;
          uint32_t sum = 0;
          for (int64_t l = 0; l < width; ++l) sum += row[l] * wh[l];
          token += sum;
        }
        total += token * pos[i * slots + s];
      }
    }
    out[k] = static_cast<int64_t>(total);
  }
  return out;
}
"""


def _native(build_dir: Path) -> Any:
    """The native candidate's module, built once into `build_dir` (None where it cannot be
    built)."""
    from torch.utils.cpp_extension import load_inline

    build_dir.mkdir(parents=True, exist_ok=True)
    try:
        module = load_inline("kv_verify_native", cpp_sources=_NATIVE_DIGEST,
                             functions=["row_sums", "digest_layers"], extra_cflags=["-O3", "-march=native"],
                             build_directory=str(build_dir))
    except Exception as exc:  # (no compiler, no ninja: the candidate is left out)
        print(f"the native candidate could not be built ({type(exc).__name__}: {exc}); left out")
        return None
    return module


def _row_sums_eager(lanes: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """The digest's row sums written as one expression: each row's weighted 32-bit lanes
    summed modulo 2^32 (what `torch.compile` is asked to fuse)."""
    return (lanes[ids] * weights).sum(-1, dtype=torch.int32)


def alternative_row(timer: Timer, mib: int, compiled: Callable[..., torch.Tensor],
                    native: Callable[..., torch.Tensor] | None) -> dict[str, Any]:
    """The Llama-3.1-8B layer at `mib`: gather, shipped digest, compiled row sums, int8
    GEMM and the native loop, cold and warm, in one run."""
    _, heads, channels, dtype = LAYERS[-1]
    cache, ids, block_ids, _ = _scattered(timer, heads, channels, dtype, mib)
    count = len(block_ids)
    lanes = cache.view(torch.int32)  # [blocks, heads, slots, 32-bit lanes]
    gen = torch.Generator().manual_seed(7)
    weights = (torch.randint(-(1 << 31), 1 << 31, (heads, 1, lanes.shape[-1]), generator=gen,
                             dtype=torch.int64) | 1).to(torch.int32).to(timer.device)
    out = torch.empty((count, *cache.shape[1:]), dtype=dtype, device=timer.device)
    rows_bytes = out.view(torch.int8).view(-1, 2 * channels * out.element_size())
    int8_weights = torch.randint(-128, 128, (rows_bytes.shape[1], 8), generator=gen,
                                 dtype=torch.int8).to(timer.device)
    if not torch.equal(compiled(lanes, ids, weights), _row_sums_eager(lanes, ids, weights)):
        raise AssertionError("the compiled row sums differ from the eager ones")
    eager = _row_sums_eager(lanes, ids, weights)
    if native is not None and not torch.equal(native(lanes, ids, weights), eager):
        raise AssertionError("the native row sums differ from the eager ones")
    torch.index_select(cache, 0, ids, out=out)
    if not torch.equal(torch._int_mm(rows_bytes, int8_weights),
                       rows_bytes.to(torch.int32) @ int8_weights.to(torch.int32)):
        raise AssertionError("the int8 GEMM differs from its int32 form")

    def gather_then_gemm() -> None:
        torch.index_select(cache, 0, ids, out=out)
        torch._int_mm(rows_bytes, int8_weights)

    fns = {"gather": lambda: torch.index_select(cache, 0, ids, out=out),
           "digest": lambda: digest([(0, cache)], block_ids, head0=0),
           "compiled": lambda: compiled(lanes, ids, weights),
           "int8_gemm": gather_then_gemm}
    if native is not None:
        fns["native"] = lambda: native(lanes, ids, weights)
    row: dict[str, Any] = {"shape": LAYERS[-1][0], "kv_mib": mib, "blocks": count}
    for cold in (True, False):
        which = "cold" if cold else "warm"
        for name, fn in fns.items():
            row[f"{name}_gbps_{which}"] = mib * MIB / timer.median(fn, cold=cold) / 1e9
    return row


def tiny_request_row(timer: Timer, native: Any) -> dict[str, Any]:
    """The demo's 64-token request (2 layers), cold: the shipped digest against (a) the
    native row sums of each layer plus a fold like the digest's in torch (to 64 bits, per
    token, times a position weight, summed, read back) and (b) the whole digest in one
    native call: the fixed cost of a digest."""
    name, layers, heads, channels, dtype, tokens = REQUESTS[0]
    caches, block_ids = _request_kv(timer, layers, heads, channels, dtype, tokens)
    width = 2 * channels * torch.empty((), dtype=dtype).element_size() // 4
    weights = [torch.full((heads, 1, width), 2 * layer + 1, dtype=torch.int32) for layer in range(layers)]
    positions = torch.arange(1, 2 * tokens, 2, dtype=torch.int64)

    def native_digest() -> list[int]:
        ids = torch.as_tensor(block_ids, dtype=torch.int64)
        rows = torch.stack([native.row_sums(cache.view(torch.int32), ids, w)
                            for (_, cache), w in zip(caches, weights, strict=True)])
        per_token = rows.to(torch.int64).bitwise_and_(0xFFFFFFFF).sum(-2).flatten(-2)
        return per_token.mul_(positions[:per_token.shape[-1]]).sum(-1).tolist()

    lanes = [cache.view(torch.int32) for _, cache in caches]

    def one_call() -> list[int]:
        ids = torch.as_tensor(block_ids, dtype=torch.int64)
        return native.digest_layers(lanes, ids, weights, positions).tolist()

    if one_call() != native_digest():
        raise AssertionError("the one-call native digest differs from row sums and fold")
    shipped = timer.median(lambda: digest(caches, block_ids, head0=0), cold=True)
    rows_and_fold = timer.median(native_digest, cold=True)
    whole = timer.median(one_call, cold=True)
    return {"shape": name, "shipped_ms": shipped * 1e3, "native_rows_torch_fold_ms": rows_and_fold * 1e3,
            "native_one_call_ms": whole * 1e3}


def alternatives_part(args: argparse.Namespace, bench: BenchRun) -> dict[str, Any]:
    device = torch.device(args.device)
    torch.set_num_threads(args.threads)
    timer = Timer(device, args.repeats)
    t = time.perf_counter()
    compiled = torch.compile(_row_sums_eager, dynamic=True)
    probe = torch.zeros((4, 2, BLOCK, 8), dtype=torch.int32, device=device)
    compiled(probe, torch.tensor([1, 0], device=device), torch.ones((2, 1, 8), dtype=torch.int32,
                                                                   device=device))
    compile_s = time.perf_counter() - t
    bench.say(f"alternatives on {device}: torch.compile of the row sums took {compile_s:.1f} s")
    native, build_s = None, None
    if device.type == "cpu":
        t = time.perf_counter()
        native = _native(bench.dir / "native-build")
        build_s = time.perf_counter() - t
        bench.say(f"the native loop built in {build_s:.1f} s" if native else "no native loop")
    names = ["digest", "compiled", "int8_gemm"] + (["native"] if native else [])
    rows = []
    for mib in SIZES_MIB:
        row = alternative_row(timer, mib, compiled, native.row_sums if native else None)
        rows.append(row)
        for which in ("cold", "warm"):
            g = row[f"gather_gbps_{which}"]
            bench.say(f"{row['shape']}, {mib} MiB, {which}: gather {g:.1f} GB/s; "
                      + "; ".join(f"{name} {row[f'{name}_gbps_{which}']:.1f} GB/s "
                                  f"({row[f'{name}_gbps_{which}'] / g:.0%})" for name in names))
    tiny = tiny_request_row(timer, native) if native else None
    if tiny:
        bench.say(f"one request, {tiny['shape']}, cold: shipped digest {tiny['shipped_ms']:.3f} ms, "
                  f"native row sums and torch's fold {tiny['native_rows_torch_fold_ms']:.3f} ms, "
                  f"the whole digest in one native call {tiny['native_one_call_ms']:.3f} ms")
    titles = {"digest": "digest (shipped)", "compiled": "torch.compile row sums",
              "int8_gemm": "gather + int8 GEMM", "native": "native loop"}
    print("\nMiB | caches | gather GB/s | " + " | ".join(titles[n] for n in names))
    for r in rows:
        for which in ("cold", "warm"):
            g = r[f"gather_gbps_{which}"]
            print(f"{r['kv_mib']} | {which} | {g:.1f} | "
                  + " | ".join(f"{r[f'{n}_gbps_{which}']:.1f} ({r[f'{n}_gbps_{which}'] / g:.0%})"
                               for n in names))
    return {"device": str(device), "threads": args.threads, "compile_s": compile_s, "native_build_s": build_s,
            "rows": rows, "tiny_request": tiny}


# ------------------------------------------------------------------- part 2
def timed_stream(*args: Any) -> Any:
    """The overhead benchmark's client stream, with each request's latency kept (imported
    here: the digest part runs where neither vLLM nor the demo is installed)."""
    from benchmarks.overhead import Stream

    class TimedStream(Stream):
        def __init__(self, *args: Any, **kwargs: Any):
            self.latencies: list[float] = []
            super().__init__(*args, **kwargs)

        def send(self, prompt: list[int], request_id: str) -> bool:
            t = time.perf_counter()
            ok = super().send(prompt, request_id)
            if ok:
                self.latencies.append(time.perf_counter() - t)
            return ok

    return TimedStream(*args)


def serve_pair(workdir: Path, ratio: float, model: Path, args: argparse.Namespace,
               bench: BenchRun) -> dict[str, Any]:
    from benchmarks.common import cpu_delta, thread_cpu
    from demo.engines import RouterProcess, VllmServer, session_pids
    from harness.poll import wait_until

    extra = {"kv_connector_extra_config": {"kv_verify_ratio": ratio}}
    servers: list[VllmServer] = []
    router = None
    t = time.monotonic()
    try:
        for name, role, cpu in (("prefill", "kv_producer", 0), ("decode", "kv_consumer", 1)):
            servers.append(VllmServer(workdir, name=name, kv_role=role, engine_id=f"verify{ratio}-{name}",
                                      cpu=cpu, model=model, connector="fork", kv_overrides=extra))
        for server in servers:
            server.wait_healthy()
        router = RouterProcess(workdir, servers[:1], servers[1:], None)
        router.wait_ready()
        bench.say(f"ratio {ratio}: P and D vllm serve and router up in {time.monotonic() - t:.0f} s "
                  f"(logs in {workdir})")
        pids = [pid for server in servers for pid in session_pids(server.pid)]
        stream = timed_stream(router.url, args.concurrency, args.max_tokens, f"verify{ratio}")
        try:
            warm = args.warmup + args.concurrency
            wait_until(lambda: stream.done >= warm, f"{warm} warm-up requests", 600, interval_s=0.2)
            n0, lat0, cpu0, t0 = stream.done, len(stream.latencies), thread_cpu(pids), time.monotonic()
            time.sleep(args.seconds)  # the measurement window itself
            cpu, window = cpu_delta(cpu0, thread_cpu(pids)), time.monotonic() - t0
            requests, latencies = stream.done - n0, stream.latencies[lat0:]
        finally:
            stream.stop()
    finally:
        if router is not None:
            router.stop()
        for server in reversed(servers):
            server.stop()
    n = max(requests, 1)
    return {"ratio": ratio, "requests": requests, "window_s": window,
            "cpu_ms_per_request": sum(cpu.values()) / n * 1e3,
            "latency_p50_ms": statistics.median(latencies) * 1e3 if latencies else None}


Rows = list[dict[str, Any]]


def serve_rows(args: argparse.Namespace, bench: BenchRun) -> tuple[Rows, Rows]:
    """(medians per ratio, every pair's figures)."""
    from demo.model import random_checkpoint
    from demo.stack import MODEL_CACHE

    ratios = [float(r) for r in args.ratios.split(",") if r]
    model = random_checkpoint(MODEL_CACHE)
    runs: list[dict[str, Any]] = []
    for rnd in range(args.rounds):
        for ratio in ratios if rnd % 2 == 0 else ratios[::-1]:
            row = serve_pair(bench.dir / f"round{rnd}-ratio{ratio}", ratio, model, args, bench)
            runs.append({"round": rnd, **row})
            bench.say(f"round {rnd + 1}, ratio {ratio}: {row['requests']} requests in "
                      f"{row['window_s']:.0f} s, {row['cpu_ms_per_request']:.2f} ms engine CPU per request, "
                      "latency p50 "
                      f"{row['latency_p50_ms']:.0f} ms")
    rows = []
    for ratio in ratios:
        mine = [r for r in runs if r["ratio"] == ratio]
        rows.append({"ratio": ratio, "rounds": len(mine),
                     "cpu_ms_per_request": statistics.median(r["cpu_ms_per_request"] for r in mine),
                     "latency_p50_ms": statistics.median(r["latency_p50_ms"] for r in mine),
                     "requests": sum(r["requests"] for r in mine)})
    return rows, runs


def run(args: argparse.Namespace, bench: BenchRun) -> dict[str, Any]:
    parts = set(args.parts.split(","))
    result: dict[str, Any] = {"block_size": BLOCK}
    if "digest" in parts:
        result["digest"] = digest_part(args, bench)
    if "alternatives" in parts:
        result["alternatives"] = alternatives_part(args, bench)
    if "serve" in parts:
        result["serve"], result["serve_runs"] = serve_rows(args, bench)
        off = next((r for r in result["serve"] if r["ratio"] == 0), None)
        print("\nkv_verify_ratio | engine CPU per request (ms) | vs off | latency p50 (ms) | vs off")
        for r in result["serve"]:
            vs = (f"{100 * (r['cpu_ms_per_request'] / off['cpu_ms_per_request'] - 1):+.1f}%",
                  f"{100 * (r['latency_p50_ms'] / off['latency_p50_ms'] - 1):+.1f}%") if off else ("", "")
            print(f"{r['ratio']:>15} | {r['cpu_ms_per_request']:27.2f} | {vs[0]:>6} | "
                  f"{r['latency_p50_ms']:16.0f} | {vs[1]:>6}")
    return result

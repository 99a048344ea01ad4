"""Telemetry cost per request: the connector's own telemetry work, by stage, in CPU microseconds.

Drives the connector's real per-request telemetry code, the functions and objects the
worker, scheduler and API server call (not copies): the flows' telemetry steps (declared
in connector/glue/flow.py) are called on an `ObservedPushWorker` built without vLLM's
engine (`ObservedPushWorker.without_engine`, its declared seam: its push state and
telemetry), so only what a request costs the connector is run. Per request, in engine
steps of `--batch` requests:

- D `receive_start`: the receive's clock, its arrival and span (`ReceiveFlow._start_receives`
  without its ledger line, which is state, not telemetry);
- D `register`: the register span and its trace context into the PUSH_REG
  (`_open_register_span`), then the PUSH_REG counted and the span ended (the tail of
  `_do_send_reg_notif`);
- P `write_start`: P's request context kept (`_keep_request_contexts`), the write span
  (`_open_write_span`), its handshake wait (`_note_handshake_wait`), the push counted;
- P `write_done`: the push's TTFT stages (`_record_push_stages`, from the lease ledger's
  settle) and the worker's telemetry of the step's results (`_observe_results`); D
  `landed`: the same for the finished receives (their wait for KV included);
- per step and engine: `stats` (the worker's `get_kv_connector_stats`: vLLM's
  clone-and-reset of our stats object), `serialise` (`to_dict` and vLLM's msgpack encode
  and decode of the step's `EngineCoreOutputs`, minus the same without our payload,
  side by side), `observe` (the API server: vLLM's `KVConnectorLogging.observe` and our
  `ObservedPromMetrics.observe`, exemplars included);
- `export`: the CPU of every other thread of the process (the SDK's
  `BatchSpanProcessor` and the real OTLP/gRPC exporter to a local receiver run in the
  parent) plus the main thread's time in `force_flush`.

vLLM's own per-request tracing, measured the same way in the same process: its
`OutputProcessor.do_tracing` (the `llm_request` span, in P's API server and in D's) and
those spans' export.

Modes: `off` (no tracer), `traced` (vLLM's tracer installed as `vllm serve
--otlp-traces-endpoint` does, the SDK's default sampler: every request traced),
`sampled` (`OTEL_TRACES_SAMPLER=parentbased_traceidratio`, arg 0.1: the router's root
decides, as in a deployment). Each mode runs in a fresh process, `--repeats` times (the
A/A spread: the same mode twice). Figures, not checks.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from types import SimpleNamespace
from typing import Any

from benchmarks.common import BenchRun

MODES = ("off", "traced", "sampled")
STAGES = ("receive_start", "register", "write_start", "write_done", "landed",
          "stats", "serialise", "observe", "export")
GOALS_US = {"off": 60.0, "traced": 300.0, "sampled": 90.0}
_SAMPLED_ENV = {"OTEL_TRACES_SAMPLER": "parentbased_traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0.1"}
_FLUSH_EVERY = 64  # requests between force_flush: keeps the SDK's queue (2,048 spans) from dropping


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--requests", type=int, default=20000, help="requests per mode and run")
    ap.add_argument("--batch", type=int, default=8, help="requests per engine step")
    ap.add_argument("--repeats", type=int, default=2, help="runs per mode (A/A spread)")
    ap.add_argument("--modes", default=",".join(MODES), help="comma-separated subset of " + ", ".join(MODES))
    ap.add_argument("--baseline", default=None, metavar="DIR",
                    help="also run another checkout of the project (its own copy of this benchmark), "
                         "interleaved with this one: a before/after measured side by side")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)


# ------------------------------------------------------------------ the parent
def run(args: argparse.Namespace, bench: BenchRun) -> dict[str, Any]:
    if args.child:
        raise SystemExit("--child is for the benchmark's own processes")
    from connector.vocabulary import TRACER_NAME
    from harness.otlp_receiver import OtlpGrpcReceiver

    receiver = OtlpGrpcReceiver(count_only=True)
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) > 1:  # the receiver's threads (this process) and the measured child apart
        os.sched_setaffinity(0, cores[:1])
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    trees = {"this": os.getcwd(), **({"baseline": os.path.abspath(args.baseline)} if args.baseline else {})}
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {t: {m: [] for m in modes} for t in trees}
    try:
        for rep in range(args.repeats):
            for mode in modes:  # modes and trees interleaved: drift hits them alike
                for tree, where in trees.items():
                    started, before = time.monotonic(), receiver.by_scope[TRACER_NAME]
                    figures = _child_run(mode, args, receiver.port, cores[1:], where)
                    figures["spans_per_request"] = (receiver.by_scope[TRACER_NAME] - before) / args.requests
                    runs[tree][mode].append(figures)
                    bench.say(f"{mode} ({tree}) run {rep + 1}/{args.repeats}: {args.requests} requests "
                              f"in {time.monotonic() - started:.1f} s")
    finally:
        receiver.close()
        os.sched_setaffinity(0, cores)
    result: dict[str, Any] = {"requests": args.requests, "batch": args.batch, "repeats": args.repeats,
                              "modes": {m: _summarise(m, r) for m, r in runs["this"].items()}}
    if args.baseline:
        result["baseline"] = {"dir": trees["baseline"], "commit": _commit_of(trees["baseline"]),
                              "modes": {m: _summarise(m, r) for m, r in runs["baseline"].items()}}
        bench.say(f"baseline: {args.baseline} ({result['baseline']['commit']})")
        _print_table(result["baseline"], bench)
        bench.say("this checkout:")
    _print_table(result, bench)
    if args.baseline:
        result["paired_ratio"] = {}
        for mode, now in result["modes"].items():
            was = result["baseline"]["modes"][mode]
            # Run i of this checkout beside run i of the baseline: the host's speed moves both.
            ratios = [a / b for a, b in zip(now["ours_runs_us"], was["ours_runs_us"], strict=True) if b]
            if not ratios:
                bench.say(f"{mode}: no baseline figure")
                continue
            result["paired_ratio"][mode] = statistics.median(ratios)
            bench.say(f"{mode}: {now['ours_us']:.1f} us per request, baseline {was['ours_us']:.1f} us; "
                      f"paired runs x{statistics.median(ratios):.2f} "
                      f"({', '.join(f'x{r:.2f}' for r in ratios)})")
    return result


def _commit_of(where: str) -> str:
    try:
        return subprocess.run(["git", "-C", where, "rev-parse", "--short", "HEAD"], check=True,
                              capture_output=True, text=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _child_run(mode: str, args: argparse.Namespace, port: int, cores: list[int],
               where: str) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env.update(OTEL_SERVICE_NAME="telemetry-cost", PYTHONHASHSEED="0")
    if mode != "off":
        env.update(OTEL_EXPORTER_OTLP_TRACES_ENDPOINT=f"http://127.0.0.1:{port}",
                   OTEL_EXPORTER_OTLP_TRACES_PROTOCOL="grpc", OTEL_EXPORTER_OTLP_TRACES_INSECURE="true")
    if mode == "sampled":
        env.update(_SAMPLED_ENV)
    cmd = [sys.executable, "-m", "benchmarks.telemetry_cost", "--child", mode,
           "--requests", str(args.requests), "--batch", str(args.batch)]
    env["PYTHONPATH"] = where  # (the checkout measured: its connector and its copy of this file)
    if cores:  # (set by the child itself: a fork with gRPC's threads running here warns)
        env["TELEMETRY_COST_CORES"] = ",".join(map(str, cores))
    out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True, cwd=where)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _summarise(mode: str, runs: list[dict[str, Any]]) -> dict[str, Any]:
    stages = {s: [r["us_per_request"][s] for r in runs] for s in STAGES}
    ours = [sum(r["us_per_request"][s] for s in STAGES) for r in runs]
    vllm = [r["vllm_us_per_request"]["span"] + r["vllm_us_per_request"]["export"] for r in runs]
    return {
        "stages_us": {s: statistics.median(v) for s, v in stages.items()},
        "stage_spread": {s: _spread(v) for s, v in stages.items()},
        "ours_us": statistics.median(ours), "ours_runs_us": ours, "ours_spread": _spread(ours),
        "vllm_us": statistics.median(vllm), "vllm_runs_us": vllm,
        "goal_us": GOALS_US[mode],
        "spans_per_request": statistics.median(r["spans_per_request"] for r in runs),
    }


def _spread(values: list[float]) -> float:
    """(max - min) / median: the A/A spread of one figure."""
    mid = statistics.median(values)
    return (max(values) - min(values)) / mid if mid else 0.0


def _print_table(result: dict[str, Any], bench: BenchRun) -> None:
    modes = result["modes"]
    head = f"{'stage (CPU us per request)':28}" + "".join(f"{m:>16}" for m in modes)
    lines = [head]
    for stage in STAGES:
        lines.append(f"{stage:28}" + "".join(
            f"{v['stages_us'][stage]:9.2f} ±{100 * v['stage_spread'][stage]:4.0f}%" for v in modes.values()))
    lines.append(f"{'connector, all stages':28}" + "".join(
        f"{v['ours_us']:9.2f} ±{100 * v['ours_spread']:4.0f}%" for v in modes.values()))
    lines.append(f"{'goal':28}" + "".join(f"{v['goal_us']:16.0f}" for v in modes.values()))
    lines.append(f"{'vLLM llm_request x2, export':28}" + "".join(
        f"{v['vllm_us']:16.2f}" for v in modes.values()))
    lines.append(f"{'connector spans per request':28}" + "".join(
        f"{v['spans_per_request']:16.2f}" for v in modes.values()))
    for line in lines:
        bench.say(line)
    for mode, v in modes.items():
        verdict = "meets" if v["ours_us"] <= v["goal_us"] else "misses"
        worst = max(STAGES, key=lambda s: v["stages_us"][s])
        bench.say(f"{mode}: {v['ours_us']:.1f} us per request {verdict} the {v['goal_us']:.0f} us goal "
                  f"(largest stage: {worst}, {v['stages_us'][worst]:.1f} us); vLLM's own tracing "
                  f"{v['vllm_us']:.1f} us")


# ------------------------------------------------------------------- the child
class _Clock:
    """Main-thread CPU per stage (CLOCK_THREAD_CPUTIME_ID, ns)."""

    def __init__(self) -> None:
        self.ns = dict.fromkeys(STAGES, 0)
        self.flush_ns = 0
        self.vllm_span_ns = 0

    @staticmethod
    def now() -> int:
        return time.thread_time_ns()


def _worker(role: str, tracer: Any) -> Any:
    """An `ObservedPushWorker` with its push state and per-request telemetry, the default
    settings, and no vLLM engine, NIXL agent or threads (its declared seam)."""
    from connector.glue.worker import ObservedPushWorker

    return ObservedPushWorker.without_engine(role, tracer=tracer, engine_id=f"telemetry-cost-{role}")


def _vllm_tracer(mode: str) -> Any:
    """vLLM's tracer where `vllm serve --otlp-traces-endpoint` installs it; ours then
    resolves to the same provider, as in the engines."""
    if mode == "off":
        return None
    from vllm.tracing import init_tracer

    init_tracer("vllm.llm_engine", os.environ["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"])
    return True


def child(mode: str, requests: int, batch: int) -> dict[str, Any]:
    import msgspec  # noqa: F401  (vLLM's serialiser needs it; fail early if absent)
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from prometheus_client import Counter, Gauge, Histogram
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorLogging
    from vllm.v1.engine import EngineCoreOutputs
    from vllm.v1.engine.output_processor import OutputProcessor
    from vllm.v1.metrics.stats import SchedulerStats
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    from connector.glue.worker import ObservedPushWorker
    from connector.telemetry.prometheus import ObservedPromMetrics
    from connector.telemetry.tracing import SpanEmitter, inject_context, resolve_tracer
    from connector.vocabulary import METADATA_TRACE_ATTR, REGISTRATION_ARRIVAL_KEY, StatKey

    _vllm_tracer(mode)
    tracer = resolve_tracer() if mode != "off" else None
    provider = trace.get_tracer_provider()
    # The router's root spans come from a provider of their own with the same sampler and
    # no processor: they decide sampling as the router does and cost this process nothing.
    router = TracerProvider().get_tracer("router") if mode != "off" else None
    d, p = _worker("kv_consumer", tracer), _worker("kv_producer", tracer)
    kv = KVTransferConfig(kv_connector="NixlPushConnector", kv_connector_module_path="connector",
                          kv_role="kv_both", engine_id="telemetry-cost")
    prom = ObservedPromMetrics(SimpleNamespace(kv_transfer_config=kv),
                               {Counter: Counter, Gauge: Gauge, Histogram: Histogram},
                               ["model_name", "engine"], {0: ["m", "0"]})
    logging_observer = KVConnectorLogging(kv)
    encoder, decoder = MsgpackEncoder(), MsgpackDecoder(EngineCoreOutputs)
    clock = _Clock()
    # As vLLM's engine core does after start-up: what is alive now is never scanned again,
    # so a collection costs what the requests allocate, not the imports.
    gc.collect()
    gc.freeze()
    process0, main0 = time.process_time_ns(), clock.now()

    for first in range(0, requests, batch):
        ids = [f"cmpl-{os.urandom(6).hex()}-0" for _ in range(min(batch, requests - first))]
        carriers = {}
        for req_id in ids:  # the router's decision (untimed: not the connector's)
            if router is not None:
                root = router.start_span("router")
                carriers[req_id] = inject_context(root)
        arrived = time.time() - 0.05  # (our scheduler puts vLLM's arrival_time in)
        regs = {r: {"remote_engine_id": p.engine_id, "remote_host": "10.0.0.2", "remote_port": 5600,
                    "local_block_ids": [[1, 2, 3]], "trace": carriers.get(r),
                    REGISTRATION_ARRIVAL_KEY: arrived} for r in ids}
        now = time.perf_counter()
        d._receives.start(regs, now)  # state, untimed
        p._leases.grant({r: now + 30.0 for r in ids}, None, time.monotonic(), now)

        t = clock.now()  # D: receives start (ReceiveFlow._start_receives, its telemetry)
        d._receive_clock.start_all(regs)
        d._receive_clock.note_arrivals(regs)
        if d._spans.enabled:
            d._open_receive_spans(_with_trace_key(regs))
        t = _lap(clock, "receive_start", t)
        push_regs = {}
        for req_id in ids:  # D: PUSH_REG out (the register span, its context into the payload)
            reg = {"request_id": req_id, "decode_engine_id": d.engine_id, "remote_engine_id": p.engine_id,
                   "remote_host": "10.0.0.2", "remote_port": 5600}
            if d._spans.enabled:
                d._open_register_span(req_id, reg)
            d.xfer_stats.record_push_reg_notif(sent=True, count=1)
            if d._spans.enabled:
                SpanEmitter.end(d._register_spans.pop(req_id))
            push_regs[req_id] = reg
        t = _lap(clock, "register", t)
        if p._spans.enabled and carriers:  # P: its own request contexts, from its scheduler
            p._keep_request_contexts(SimpleNamespace(**{METADATA_TRACE_ATTR: carriers}))
        for req_id in ids:  # P: PUSH_REG matched, WRITE started
            span, kept = (p._open_write_span(req_id, [[4, 5, 6]], push_regs[req_id])
                          if p._spans.enabled else (None, True))
            if span is not None and kept:
                p._note_handshake_wait(req_id, span)
            p.xfer_stats.record_push(StatKey.PUSHES_STARTED)  # (its first WRITE posted)
        t = _lap(clock, "write_start", t)
        now = time.perf_counter()  # P's push state: claimed, posted, settled (untimed)
        for req_id in ids:
            p._leases.claim(req_id, {"request_id": req_id, "decode_engine_id": d.engine_id}, None,
                            None, now)
            p._leases.begin_post(req_id, None, now)
            p._leases.posted(req_id, 1)
        settled = p._leases.settle(ids, set(), time.perf_counter())
        completed = p._leases.ended(ids)  # (the ledgers learn what ended: untimed state)
        failures = {req_id: d._receives.over(req_id) for req_id in ids}
        t = clock.now()
        for done in settled:  # P: WRITE done (its stages, `get_transfer_results`), then the step's
            p._record_push_stages(done)  # telemetry of what ended
        p._observe_results(KVConnectorTransferResults(finished_sending=set(ids)), completed, {})
        t = _lap(clock, "write_done", t)
        d._observe_results(KVConnectorTransferResults(finished_recving=set(ids)), (), failures)
        t = _lap(clock, "landed", t)
        for req_id in ids:
            p._leases.forget(req_id)
        payloads = []
        for worker in (p, d):  # per step and engine: worker stats, to the API server
            stats = ObservedPushWorker.get_kv_connector_stats(worker)
            t = _lap(clock, "stats", t)
            if stats is None:
                continue
            payload = stats.to_dict()
            step = EngineCoreOutputs(scheduler_stats=SchedulerStats(kv_connector_stats=payload))
            frames = encoder.encode(step)
            received = decoder.decode(frames).scheduler_stats.kv_connector_stats
            t = _lap(clock, "serialise", t)
            frames = encoder.encode(EngineCoreOutputs(scheduler_stats=SchedulerStats()))
            decoder.decode(frames)
            t = _unlap(clock, "serialise", t)  # (vLLM's frame without our payload)
            payloads.append(received)
        for received in payloads:
            logging_observer.observe(received)
            prom.observe(received, 0)
            t = _lap(clock, "observe", t)
        logging_observer.reset()
        if mode != "off" and (first // batch) % (_FLUSH_EVERY // batch or 1) == 0:
            f = clock.now()
            provider.force_flush()
            clock.flush_ns += clock.now() - f
    if mode != "off":
        f = clock.now()
        provider.force_flush()
        clock.flush_ns += clock.now() - f
    process1, main1 = time.process_time_ns(), clock.now()
    clock.ns["export"] = (process1 - process0) - (main1 - main0) + clock.flush_ns

    vllm_span_us, vllm_export_us = _vllm_own(mode, requests, batch, provider, router, OutputProcessor)
    return {"mode": mode, "requests": requests,
            "us_per_request": {s: ns / 1e3 / requests for s, ns in clock.ns.items()},
            "vllm_us_per_request": {"span": vllm_span_us, "export": vllm_export_us}}


def _vllm_own(mode: str, requests: int, batch: int, provider: Any, router: Any,
              output_processor: Any) -> tuple[float, float]:
    """vLLM's per-request tracing in the API servers (`OutputProcessor.do_tracing`: the
    `llm_request` span, once on P and once on D), and its export, measured as ours is."""
    if mode == "off":
        return 0.0, 0.0
    from connector.telemetry.tracing import inject_context

    span_ns = flush_ns = 0
    process0, main0 = time.process_time_ns(), time.thread_time_ns()
    now = time.time()
    stats = SimpleNamespace(arrival_time=now - 0.2, first_token_latency=0.05, scheduled_ts=now - 0.19,
                            queued_ts=now - 0.195, first_token_ts=now - 0.15, last_token_ts=now,
                            num_generation_tokens=16)
    iteration = SimpleNamespace(iteration_timestamp=now)
    for i in range(requests):
        headers = inject_context(router.start_span("router"))
        output = SimpleNamespace(trace_headers=headers)
        state = SimpleNamespace(stats=stats, prompt_token_ids=list(range(64)), prompt_embeds=None,
                                external_req_id=f"cmpl-{i}", top_p=1.0, max_tokens_param=16,
                                temperature=0.0, n=1)
        t = time.thread_time_ns()
        output_processor.do_tracing(None, output, state, iteration)  # P's leg
        output_processor.do_tracing(None, output, state, iteration)  # D's leg
        span_ns += time.thread_time_ns() - t
        if i % _FLUSH_EVERY == 0:
            t = time.thread_time_ns()
            provider.force_flush()
            flush_ns += time.thread_time_ns() - t
    t = time.thread_time_ns()
    provider.force_flush()
    flush_ns += time.thread_time_ns() - t
    process1, main1 = time.process_time_ns(), time.thread_time_ns()
    export_ns = (process1 - process0) - (main1 - main0) + flush_ns
    return span_ns / 1e3 / requests, export_ns / 1e3 / requests


def _with_trace_key(regs: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The registrations as our scheduler hands them over: the request's trace context
    under its key."""
    from connector.vocabulary import REGISTRATION_TRACE_KEY

    for reg in regs.values():
        carrier = reg.pop("trace", None)
        if carrier:
            reg[REGISTRATION_TRACE_KEY] = carrier
    return regs


def _lap(clock: _Clock, stage: str, since: int) -> int:
    now = clock.now()
    clock.ns[stage] += now - since
    return clock.now()


def _unlap(clock: _Clock, stage: str, since: int) -> int:
    now = clock.now()
    clock.ns[stage] -= now - since
    return clock.now()


def main() -> None:
    ap = argparse.ArgumentParser()
    add_arguments(ap)
    args = ap.parse_args()
    cores = os.environ.get("TELEMETRY_COST_CORES")
    if cores:
        os.sched_setaffinity(0, {int(c) for c in cores.split(",")})
    print(json.dumps(child(args.child, args.requests, args.batch)), flush=True)
    os._exit(0)  # (the bare workers have no engine for vLLM's finaliser to shut down)


if __name__ == "__main__":
    main()

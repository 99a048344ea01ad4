"""Requests through the router, and the single-engine reference they must equal.

Prompts are token ids (the tiny model has no tokenizer; chat cannot work without
one). Every request carries its own W3C `traceparent`, so the caller knows the trace
id under which router, vLLM and connector spans must appear. The reference runs the
same prompt on P alone, without KV transfer; its `cache_salt` keeps it from reusing
the P leg's cached blocks, so it is computed independently.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import random
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from connector.router import legs
from connector.router.config import PrefillTarget
from demo.engines import SERVED_MODEL
from harness.poll import wait_until

VOCAB = 256


def make_prompts(n: int, seed: int = 7, lengths: tuple[int, ...] = (40, 72, 100, 33, 130, 64)
                 ) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, VOCAB) for _ in range(lengths[i % len(lengths)])] for i in range(n)]


def new_traceparent() -> tuple[str, str]:
    trace_id, span_id = os.urandom(16).hex(), os.urandom(8).hex()
    return f"00-{trace_id}-{span_id}-01", trace_id


@dataclass
class Outcome:
    request_id: str
    prompt: list[int]
    trace_id: str
    tokens: list[int] = field(default_factory=list)
    reference: list[int] = field(default_factory=list)
    error: str = ""

    @property
    def ok(self) -> bool:
        return not self.error and bool(self.tokens) and self.tokens == self.reference


def _post(url: str, body: dict[str, Any], headers: dict[str, str], timeout_s: float = 180) -> dict[str, Any]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", **headers})
    with urllib.request.urlopen(req, timeout=timeout_s) as resp:
        return json.loads(resp.read())


def body(prompt: list[int], max_tokens: int, **extra: Any) -> dict[str, Any]:
    return {"model": SERVED_MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "detokenize": False, "return_token_ids": True, **extra}


def tokens_of(answer: dict[str, Any]) -> list[int]:
    return list(answer["choices"][0]["token_ids"])


def disaggregated(router_url: str, prompt: list[int], request_id: str, max_tokens: int,
                  timeout_s: float = 180, *, traced: bool = True) -> Outcome:
    """One completion through the router. `traced`: with a `traceparent` of our own, so
    the outcome names its trace; else none, and the router's sampler decides (what a
    benchmark of production cost sends)."""
    traceparent, trace_id = new_traceparent() if traced else ("", "")
    out = Outcome(request_id, prompt, trace_id)
    headers = {"X-Request-Id": request_id, **({"traceparent": traceparent} if traced else {})}
    try:
        answer = _post(router_url + "/v1/completions", body(prompt, max_tokens), headers,
                       timeout_s=timeout_s)
        out.tokens = tokens_of(answer)
    except Exception as exc:  # reported per request, not raised
        detail = exc.read().decode(errors="replace")[:300] if hasattr(exc, "read") else ""
        out.error = f"{type(exc).__name__}: {exc} {detail}".strip()
    return out


def _sse_tokens(lines: Iterable[bytes]) -> Iterator[list[int]]:
    """The token ids of each SSE chunk of a `stream: true` completion."""
    for raw in lines:
        line = raw.decode().strip()
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        chunk = json.loads(line[6:])
        if "error" in chunk:
            raise RuntimeError(f"stream error: {chunk['error']}")
        for choice in chunk.get("choices", []):
            yield list(choice.get("token_ids") or [])


def streamed(router_url: str, prompt: list[int], request_id: str, max_tokens: int) -> list[int]:
    """Token ids of a `stream: true` completion through the router (SSE chunks)."""
    req = urllib.request.Request(router_url + "/v1/completions",
                                 data=json.dumps(body(prompt, max_tokens, stream=True)).encode(),
                                 headers={"Content-Type": "application/json", "X-Request-Id": request_id})
    with urllib.request.urlopen(req, timeout=180) as resp:
        return [t for chunk in _sse_tokens(resp) for t in chunk]


def reference(engine_url: str, prompt: list[int], max_tokens: int, salt: str) -> list[int]:
    return tokens_of(_post(engine_url + "/v1/completions", body(prompt, max_tokens, cache_salt=salt), {}))


class InBackground:
    """One request through the router on a thread; `.outcome` and `.seconds` once joined."""

    def __init__(self, router_url: str, prompt: list[int], request_id: str, max_tokens: int,
                 timeout_s: float = 600):
        self.prompt, self.seconds = prompt, 0.0
        self.outcome: Outcome | None = None
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        args=(router_url, request_id, max_tokens, timeout_s))
        self._thread.start()

    def _run(self, url: str, request_id: str, max_tokens: int, timeout_s: float) -> None:
        started = time.monotonic()
        self.outcome = disaggregated(url, self.prompt, request_id, max_tokens, timeout_s)
        self.seconds = time.monotonic() - started

    def join(self) -> Outcome:
        self._thread.join()
        assert self.outcome is not None
        return self.outcome


def run(router_url: str, reference_url: str, prompts: list[list[int]], *, prefix: str, max_tokens: int,
        concurrency: int = 1, timeout_s: float = 180) -> list[Outcome]:
    """Send the prompts (one by one, or `concurrency` at a time), then their references."""
    ids = [f"{prefix}-{i:03d}" for i in range(len(prompts))]
    if concurrency <= 1:
        outcomes = [disaggregated(router_url, p, rid, max_tokens, timeout_s) for p, rid in zip(prompts, ids)]
    else:
        with ThreadPoolExecutor(concurrency) as pool:
            outcomes = list(pool.map(lambda a: disaggregated(router_url, a[0], a[1], max_tokens, timeout_s),
                                     zip(prompts, ids)))
    for o in outcomes:
        if not o.error:
            o.reference = reference(reference_url, o.prompt, max_tokens, salt=f"reference-{o.request_id}")
    return outcomes


# ------------------------------------------------------------ lease scenarios
class Busy:
    """A long local request keeps an engine's run slots full while the block runs
    (with `--max-num-seqs 1`, every request behind it waits in the engine's queue).

    The request is streamed: entering returns once its first token came, so it really
    runs (unless `wait=False`, for a request queued behind another). After that first
    token nothing more is read: the engine goes on generating while its API server,
    held back by the connection, stops streaming (had it streamed every token, it would
    have competed on its one core with the requests the test sends meanwhile). Leaving
    closes the connection, which makes vLLM abort what is left of the request, so tests
    end the busy spell on a condition, not on a token count sized from a speed.
    """

    def __init__(self, engine_url: str, max_tokens: int = 4000, seed: int = 5, *, wait: bool = True,
                 wait_s: float = 120.0):
        self._args = (engine_url, make_prompts(1, seed=seed)[0][:30], max_tokens)
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._running, self._ended, self._stop = threading.Event(), threading.Event(), threading.Event()
        self._wait_s = wait_s if wait else 0.0
        self._conn: http.client.HTTPConnection | None = None
        self.error = ""

    def _run(self) -> None:
        url, prompt, max_tokens = self._args
        parts = urllib.parse.urlsplit(url)
        try:
            self._conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=600)
            self._conn.request("POST", "/v1/completions", headers={"Content-Type": "application/json"},
                               body=json.dumps(body(prompt, max_tokens, ignore_eos=True, stream=True)))
            resp = self._conn.getresponse()
            if resp.status != 200:
                raise RuntimeError(f"HTTP {resp.status}: {resp.read()[:300]!r}")
            for chunk in _sse_tokens(resp):
                if chunk:
                    self._running.set()
                    break
            self._stop.wait()  # read nothing more until the block ends
        except Exception as exc:  # reported, not raised in the thread
            if not self._stop.is_set():
                self.error = f"{type(exc).__name__}: {exc}"
        finally:
            self._ended.set()

    def __enter__(self) -> Busy:
        self._thread.start()
        if self._wait_s:
            wait_until(lambda: self._running.is_set() or self._ended.is_set(),
                       f"the local request on {self._args[0]} to stream its first token", self._wait_s)
            if not self._running.is_set():
                raise RuntimeError(f"the local request on {self._args[0]} did not run: {self.error}")
        return self

    def __exit__(self, *exc: object) -> None:
        """Cut the request short, queued or running: the engine sees the client go and
        aborts it."""
        self._stop.set()
        sock = self._conn.sock if self._conn is not None else None
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        self._thread.join()


class KeepStepping:
    """Requests sent straight to an engine, one after the other, while the block runs: a
    prefill engine in production always has work, and its lease reaper runs on its
    engine steps. Each generates `STEPS` tokens, so the engine steps all the time on
    about one HTTP request a second (a request per step would keep its API server, and
    the core it shares, busy with HTTP instead)."""

    STEPS = 128

    def __init__(self, engine_url: str):
        self.url = engine_url
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.sent = 0

    def _run(self) -> None:
        while not self._stop.is_set():
            prompt = make_prompts(1, seed=1000 + self.sent)[0][:16]
            try:
                _post(self.url + "/v1/completions", body(prompt, self.STEPS, ignore_eos=True), {},
                      timeout_s=60)
            except Exception:  # the engine down or restarting: try again shortly, quietly
                self._stop.wait(0.5)
            self.sent += 1

    def __enter__(self) -> KeepStepping:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


class CpuHog:
    """A process burning one CPU for the block (a noisy neighbour on an engine's core):
    started pinned to `cpu`, stopped by pid on leaving."""

    def __init__(self, cpu: int):
        self.cpu = cpu
        self.process: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> CpuHog:
        self.process = subprocess.Popen([sys.executable, "-c", "while True: pass"],
                                        preexec_fn=lambda: os.sched_setaffinity(0, {self.cpu}))
        return self

    def __exit__(self, *exc: object) -> None:
        if self.process is not None:
            self.process.kill()
            self.process.wait(10)


class StockStylePair:
    """One request as a router that passes the client's id on as the transfer id sends
    it: both legs at once, both named `request_id`, on threads; `.join()` -> Outcome."""

    def __init__(self, prefill_url: str, decode_url: str, prefill: PrefillTarget, prompt: list[int],
                 request_id: str, max_tokens: int):
        self.outcome = Outcome(request_id, prompt, "")
        self._p = threading.Thread(target=self._prefill, args=(prefill_url, prompt, request_id),
                                   daemon=True)
        self._d = threading.Thread(target=self._decode, daemon=True,
                                   args=(decode_url, prefill, prompt, request_id, max_tokens))
        self._p.start()
        self._d.start()

    def _prefill(self, url: str, prompt: list[int], request_id: str) -> None:
        with contextlib.suppress(Exception):  # (its answer is not the client's)
            prefill_leg(url, prompt, request_id)

    def _decode(self, url: str, prefill: PrefillTarget, prompt: list[int], request_id: str,
                max_tokens: int) -> None:
        try:
            self.outcome.tokens = decode_leg(url, prefill, prompt, request_id, max_tokens)
        except Exception as exc:  # reported, not raised
            self.outcome.error = f"{type(exc).__name__}: {exc}"

    def join(self) -> Outcome:
        self._d.join()
        self._p.join(60)
        return self.outcome


def concurrently(router_url: str, prompts: list[list[int]], *, prefix: str, max_tokens: int,
                 timeout_s: float = 180, concurrency: int | None = None,
                 traced: bool = True) -> list[tuple[Outcome, float]]:
    """Every prompt once through the router, `concurrency` at a time (all at once by
    default); each outcome, in prompt order, with its latency in seconds."""
    def one(i: int) -> tuple[Outcome, float]:
        start = time.perf_counter()
        out = disaggregated(router_url, prompts[i], f"{prefix}-{i:03d}", max_tokens, timeout_s,
                            traced=traced)
        return out, time.perf_counter() - start

    pool = ThreadPoolExecutor(concurrency or len(prompts))
    try:
        results = list(pool.map(one, range(len(prompts))))
    except BaseException:  # (interrupted: what has not started never will, nor is waited for)
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    pool.shutdown()
    return results


def prefill_leg(prefill_url: str, prompt: list[int], request_id: str) -> dict[str, Any]:
    """Only the P leg of a disaggregated request, as the router sends it (P prefills and
    holds the KV under a lease for a decoder)."""
    leg = legs.prefill_body(body(prompt, 1), legs.COMPLETIONS, request_id)
    return _post(prefill_url + "/v1/completions", leg, {"X-Request-Id": request_id})


def decode_leg(decode_url: str, prefill: PrefillTarget, prompt: list[int], request_id: str,
               max_tokens: int, timeout_s: float = 180) -> list[int]:
    """Only the D leg of a disaggregated request, as the router sends it."""
    return tokens_of(_post(decode_url + "/v1/completions",
                           legs.decode_body(body(prompt, max_tokens), prefill, request_id, request_id),
                           {"X-Request-Id": request_id}, timeout_s=timeout_s))

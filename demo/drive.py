"""Requests through the router, and the single-engine reference they must equal.

Prompts are token ids (the tiny model has no tokenizer; chat cannot work without
one). Every request carries its own W3C `traceparent`, so the caller knows the trace
id under which router, vLLM and connector spans must appear. The reference runs the
same prompt on P alone, without KV transfer; its `cache_salt` keeps it from reusing
the P leg's cached blocks, so it is computed independently.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from connector.router import legs
from connector.router.config import PrefillTarget
from demo.engines import SERVED_MODEL

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
                  timeout_s: float = 180) -> Outcome:
    traceparent, trace_id = new_traceparent()
    out = Outcome(request_id, prompt, trace_id)
    try:
        answer = _post(router_url + "/v1/completions", body(prompt, max_tokens),
                       {"X-Request-Id": request_id, "traceparent": traceparent}, timeout_s=timeout_s)
        out.tokens = tokens_of(answer)
    except Exception as exc:  # reported per request, not raised
        detail = exc.read().decode(errors="replace")[:300] if hasattr(exc, "read") else ""
        out.error = f"{type(exc).__name__}: {exc} {detail}".strip()
    return out


def streamed(router_url: str, prompt: list[int], request_id: str, max_tokens: int) -> list[int]:
    """Token ids of a `stream: true` completion through the router (SSE chunks)."""
    req = urllib.request.Request(router_url + "/v1/completions",
                                 data=json.dumps(body(prompt, max_tokens, stream=True)).encode(),
                                 headers={"Content-Type": "application/json", "X-Request-Id": request_id})
    tokens: list[int] = []
    with urllib.request.urlopen(req, timeout=180) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(f"stream error: {chunk['error']}")
            for choice in chunk.get("choices", []):
                tokens += choice.get("token_ids") or []
    return tokens


def reference(engine_url: str, prompt: list[int], max_tokens: int, salt: str) -> list[int]:
    return tokens_of(_post(engine_url + "/v1/completions", body(prompt, max_tokens, cache_salt=salt), {}))


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
def local(engine_url: str, prompt: list[int], max_tokens: int, timeout_s: float = 600) -> list[int]:
    """A plain completion on one engine (no KV transfer), all `max_tokens` generated."""
    return tokens_of(_post(engine_url + "/v1/completions",
                           body(prompt, max_tokens, ignore_eos=True), {}, timeout_s=timeout_s))


class Busy:
    """A long local request keeps an engine's run slots full while the block runs
    (with `--max-num-seqs 1`, every request behind it waits in the engine's queue)."""

    def __init__(self, engine_url: str, max_tokens: int, seed: int = 5):
        self._args = (engine_url, make_prompts(1, seed=seed)[0][:30], max_tokens)
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.tokens: list[int] = []
        self.error = ""
        self.seconds = 0.0  # how long the request took

    def _run(self) -> None:
        started = time.monotonic()
        try:
            self.tokens = local(*self._args)
        except Exception as exc:  # reported, not raised in the thread
            self.error = f"{type(exc).__name__}: {exc}"
        self.seconds = time.monotonic() - started

    def __enter__(self) -> Busy:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._thread.join()


class KeepStepping:
    """Small requests sent straight to an engine, one after the other, while the block
    runs: a prefill engine in production always has work, and its lease reaper runs on
    its engine steps."""

    def __init__(self, engine_url: str):
        self.url = engine_url
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.sent = 0

    def _run(self) -> None:
        while not self._stop.is_set():
            with contextlib.suppress(Exception):
                _post(self.url + "/v1/completions", body(make_prompts(1, seed=1000 + self.sent)[0][:16], 1),
                      {}, timeout_s=60)
            self.sent += 1

    def __enter__(self) -> KeepStepping:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def concurrently(router_url: str, prompts: list[list[int]], *, prefix: str, max_tokens: int,
                 timeout_s: float = 180) -> list[tuple[Outcome, float]]:
    """All prompts through the router at once; each outcome with its latency in seconds."""
    def one(i: int) -> tuple[Outcome, float]:
        start = time.monotonic()
        out = disaggregated(router_url, prompts[i], f"{prefix}-{i:03d}", max_tokens, timeout_s)
        return out, time.monotonic() - start

    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(one, range(len(prompts))))


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

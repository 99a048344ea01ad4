"""Requests through the router, and the single-engine reference they must equal.

Prompts are token ids (the tiny model has no tokenizer; chat cannot work without
one). Every request carries its own W3C `traceparent`, so the caller knows the trace
id under which router, vLLM and connector spans must appear. The reference runs the
same prompt on P alone, without KV transfer; its `cache_salt` keeps it from reusing
the P leg's cached blocks, so it is computed independently.
"""

from __future__ import annotations

import json
import os
import random
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

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

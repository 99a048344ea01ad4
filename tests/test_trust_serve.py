"""The authenticated side channel on real `vllm serve`, P and D each on a host of its own
(network namespaces on a bridge) and a third host as the outsider.

With `side_channel_secret_file` on both engines: every e2e property holds (KV over NIXL,
traces, the KV check), the handshakes say they were authenticated; the outsider gets no
metadata, and a PUSH_REG it forges for a real request's id (with metadata handed to it,
as an agent that held it from before would have it) is refused before P matches
anything, while that request completes with the right answer; rotating the secret during
a stream of requests loses none. tests/test_e2e_serve.py runs the same outsider against
the deployment without the secret, where it gets the metadata, as vLLM does today.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from connector.glue.side_channel import SideChannelClient
from connector.trust.secret import PeerSecret
from connector.vocabulary import (
    KV_VERIFY,
    PEER_AUTH_REFUSALS,
    PUSHES,
    RECEIVE_FAILURES,
    SPAN_HANDSHAKE,
    Attr,
)
from connector.vocabulary import VLLM_EXTERNAL_PROMPT_TOKENS as EXTERNAL
from demo import drive, report
from demo.engines import VllmServer
from demo.network import unavailable_reason
from demo.stack import Stack
from harness.outsider import Outsider
from harness.poll import wait_until

pytestmark = [pytest.mark.real, pytest.mark.serve, pytest.mark.timeout(1200)]

MAX_TOKENS = 6
REFUSED = PEER_AUTH_REFUSALS.name + "_total"


def new_key(path: Path) -> None:
    """A fresh key, written as a Secret mount swaps it: a new file renamed over the old."""
    tmp = path.with_suffix(".new")
    tmp.write_text(secrets.token_hex(32) + "\n")
    os.replace(tmp, path)


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(f"needs network namespaces for P, D and the outsider: {reason}")
    work = tmp_path_factory.mktemp("trust")
    key = work / "side-channel-secret"
    new_key(key)
    stack = Stack(work, hosts=True, extra_hosts=("outsider",),
                  kv_overrides={"kv_connector_extra_config": {"side_channel_secret_file": str(key)}})
    stack.start()
    try:
        yield stack
    finally:
        stack.close()
        assert stack.leftovers() == []


def key_file(stack: Stack) -> Path:
    return stack.workdir / "side-channel-secret"


def outsider_on(stack: Stack, *args: str) -> Outsider:
    assert stack.network is not None and stack.prefill is not None
    return Outsider(stack.network["outsider"], stack.prefill.side_channel, stack.workdir / "outsider.log",
                    *args)


def refused(server: Any, channel: str, reason: str) -> float:
    return report.total(report.samples(server.metrics()), REFUSED, channel=channel, reason=reason)


def test_with_the_secret_kv_travels_over_nixl_traced_checked_and_authenticated(secured: Stack) -> None:
    assert secured.router and secured.prefill and secured.decode
    prompts = drive.make_prompts(4, seed=31)
    outcomes = drive.run(secured.router.url, secured.prefill.url, prompts, prefix="trust-seq",
                         max_tokens=MAX_TOKENS)
    for o in outcomes:
        assert not o.error and o.tokens == o.reference, (o.request_id, o.error)
    d, p = report.samples(secured.decode.metrics()), report.samples(secured.prefill.metrics())
    assert report.total(d, EXTERNAL[0], **EXTERNAL[1]) == sum(len(x) for x in prompts)
    assert report.total(d, KV_VERIFY.name + "_total", outcome="match") == len(prompts)
    assert report.total(p, PUSHES.name + "_total", outcome="completed") == len(prompts)
    assert report.total(d, REFUSED) == report.total(p, REFUSED) == 0
    # Both directions' handshakes proved the secret (and say so on their spans).
    def handshakes() -> list[dict[str, Any]]:
        found = [s for s in secured.spans() if s["name"] == SPAN_HANDSHAKE]
        return found if {s["attributes"][Attr.DIRECTION] for s in found} == {"d_to_p", "p_to_d"} else []

    spans = wait_until(handshakes, "handshake spans of both directions", 60, 0.5)
    assert all(s["attributes"][Attr.PEER_AUTHENTICATED] is True for s in spans)


def test_the_outsider_gets_no_metadata_and_its_forged_push_reg_is_refused(secured: Stack,
                                                                          tmp_path: Path) -> None:
    assert secured.router and secured.prefill and secured.decode
    with outsider_on(secured) as outsider:
        assert outsider.result["fetch"].startswith("refused: unauthenticated"), outsider.result
    # (Logged at once, at WARNING with the outsider's address; counted with P's next step.)
    wait_until(lambda: "Refused peer" in secured.prefill.log(), "P to log the refused metadata request",
               30, 0.5)
    # The metadata, as an agent that held it from before the secret would: the PUSH_REGs it
    # forges for a real request (bare, and under another secret) never reach P's match.
    host, _, port = secured.prefill.side_channel.rpartition(":")
    with SideChannelClient(host, int(port), 5000, secret=PeerSecret(key_file(secured), 300)) as channel:
        (tmp_path / "metadata").write_bytes(channel.fetch(0, 0).payload)
    (tmp_path / "wrong").write_text(secrets.token_hex(32))
    request_id = "trust-forged-0"
    with outsider_on(secured, "--metadata", str(tmp_path / "metadata"), "--request-id", f"{request_id}-000",
                  "--wrong-secret-file", str(tmp_path / "wrong")) as outsider:
        assert outsider.result["forged_sent"] == 2
        wait_until(lambda: "Refused a notification from" in secured.prefill.log(),
                   "P to drop the forged PUSH_REG before the real request comes", 60, 0.5)
        prompt = drive.make_prompts(1, seed=41)[0]
        [real] = drive.run(secured.router.url, secured.prefill.url, [prompt], prefix=request_id,
                           max_tokens=MAX_TOKENS)
    assert not real.error and real.tokens == real.reference, real.error
    d = report.samples(secured.decode.metrics())
    assert report.total(d, RECEIVE_FAILURES.name + "_total") == 0
    wait_until(lambda: refused(secured.prefill, "side_channel", "no_proof") == 2
               and refused(secured.prefill, "notification", "no_proof") >= 1
               and refused(secured.prefill, "notification", "bad_proof") >= 1,
               "P's /metrics to count the outsider's two metadata requests and both forged PUSH_REGs",
               60, 0.5,
               last=lambda: [(n, lab, v) for n, lab, v in report.samples(secured.prefill.metrics())
                             if n == REFUSED and v])


def test_rotating_the_secret_during_a_stream_of_requests_loses_none(secured: Stack) -> None:
    """One-step rotation (the file replaced by a new key) while requests flow: each
    engine reads the new key within a second, a proof it cannot check yet makes it read
    the file at once, and the old key stays accepted for side_channel_secret_previous_s."""
    assert secured.router and secured.prefill and secured.decode
    before = report.total(report.samples(secured.decode.metrics()), KV_VERIFY.name + "_total",
                          outcome="match")
    refused_before = [report.total(report.samples(e.metrics()), REFUSED) for e in (secured.prefill,
                                                                                    secured.decode)]
    prompts = drive.make_prompts(12, seed=51)
    stream = [drive.InBackground(secured.router.url, p, f"trust-rotate-{i:03d}", MAX_TOKENS)
              for i, p in enumerate(prompts[:6])]
    new_key(key_file(secured))
    stream += [drive.InBackground(secured.router.url, p, f"trust-rotate-{i + 6:03d}", MAX_TOKENS)
               for i, p in enumerate(prompts[6:])]
    outcomes = [s.join() for s in stream]
    assert [o.error for o in outcomes if o.error] == []
    d, p = report.samples(secured.decode.metrics()), report.samples(secured.prefill.metrics())
    assert report.total(d, RECEIVE_FAILURES.name + "_total") == 0
    assert report.total(d, KV_VERIFY.name + "_total", outcome="match") - before == len(prompts)
    # None refused on D; on P, none but the outsider's resent forgeries still in flight when it stopped.
    assert report.total(d, REFUSED) == refused_before[1]
    assert report.total(p, REFUSED, channel="side_channel") == 2
    # A new handshake after the rotation proves the new key.
    host, _, port = secured.prefill.side_channel.rpartition(":")
    with SideChannelClient(host, int(port), 5000, secret=PeerSecret(key_file(secured), 0)) as channel:
        assert channel.fetch(0, 0).authenticated


def test_a_stock_decoder_is_refused_cleanly_and_counted(secured: Stack) -> None:
    """Stock vLLM as the decoder, on the outsider's host, against the secured P: P sends it no
    metadata and counts it (`no_proof`); its request is recomputed on the stock decoder
    (kv_load_failure_policy recompute), so its client still gets the right answer; the
    secured pair goes on serving."""
    assert secured.network and secured.prefill and secured.router and secured.model
    before = refused(secured.prefill, "side_channel", "no_proof")
    stock = VllmServer(secured.workdir, name="stock-decode", kv_role="kv_consumer",
                       engine_id="stock-decode-0", cpu=1, model=secured.model, connector="stock",
                       host=secured.network["outsider"],
                       kv_overrides={"kv_load_failure_policy": "recompute"})
    try:
        stock.wait_healthy()
        prompt = drive.make_prompts(1, seed=61)[0]
        tokens = drive.decode_leg(stock.url, secured.prefill.target(), prompt, "trust-stock-0", MAX_TOKENS)
        assert tokens == drive.reference(secured.prefill.url, prompt, MAX_TOKENS, salt="trust-stock-ref")
        assert report.total(report.samples(stock.metrics()), EXTERNAL[0], **EXTERNAL[1]) == 0  # (recomputed)
    finally:
        stock.stop()
        assert stock.leftovers() == []
    [real] = drive.run(secured.router.url, secured.prefill.url, drive.make_prompts(1, seed=62),
                       prefix="trust-after-stock", max_tokens=MAX_TOKENS)
    assert not real.error and real.tokens == real.reference, real.error
    wait_until(lambda: refused(secured.prefill, "side_channel", "no_proof") > before,
               "P to count the stock decoder's metadata request", 60, 0.5)

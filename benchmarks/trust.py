"""What the side channel's authentication costs: per handshake and per notification.

Measured side by side in one run on loopback, medians of `--rounds` runs:
- one metadata fetch (one rank) with side_channel_secret_file (our listener, the
  challenge and response: two round trips, three HMACs each side) against vLLM's own
  listener without it (one round trip), each on a fresh REQ socket as a handshake has;
- wrapping and checking one notification (a PUSH_REG of a `--blocks`-block request, and
  a heartbeat) against leaving it bare: what P's writer thread and D's main thread pay
  per PUSH_REG with the secret.
"""

from __future__ import annotations

import argparse
import secrets
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import msgspec

from benchmarks.common import BenchRun


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rounds", type=int, default=200, help="fetches per side (default 200)")
    parser.add_argument("--blocks", type=int, default=512,
                        help="blocks named by the PUSH_REG measured (default 512: an 8k-token prompt)")


def _fetch_times(serve: Any, secret: Any, rounds: int) -> list[float]:
    from connector.glue import listener
    from connector.glue.side_channel import SideChannelClient
    from harness.ports import free_port

    port, stop, ready = free_port(), threading.Event(), threading.Event()
    payload = secrets.token_bytes(4096)  # (a rank's metadata is a few KiB)
    thread = threading.Thread(target=listener.supervise, daemon=True,
                              args=(serve, {(0, 0): payload}, ready, stop, "127.0.0.1", port))
    thread.start()
    ready.wait(10)
    times = []
    try:
        for _ in range(rounds):
            start = time.perf_counter()
            with SideChannelClient("127.0.0.1", port, 5000, secret=secret) as channel:
                assert channel.fetch(0, 0).payload == payload
            times.append(time.perf_counter() - start)
    finally:
        stop.set()
        thread.join(10)
    return times


def _notif_times(secret: Any, message: bytes, rounds: int) -> tuple[list[float], list[float]]:
    from connector.trust.proofs import unwrap_notif, wrap_notif

    wrap, check = [], []
    for _ in range(rounds):
        start = time.perf_counter()
        wrapped = wrap_notif(secret, b"decode-0", message)
        wrap.append(time.perf_counter() - start)
        start = time.perf_counter()
        assert unwrap_notif(secret, wrapped)[0] == message
        check.append(time.perf_counter() - start)
    return wrap, check


def run(args: argparse.Namespace, bench: BenchRun) -> dict[str, Any]:
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.push_scheduler import NixlPushConnectorScheduler

    from connector.glue.auth_listener import authenticated_listener
    from connector.trust.secret import PeerSecret

    with tempfile.TemporaryDirectory() as tmp:
        key = Path(tmp) / "secret"
        key.write_text(secrets.token_hex(32) + "\n")
        secret = PeerSecret(key, 300)
        bench.say(f"{args.rounds} metadata fetches each, vLLM's listener and ours with the secret, "
                  "in alternating batches")
        stock, authed = [], []
        for _ in range(5):  # (alternating batches: a noisy neighbour hits both)
            stock += _fetch_times(NixlPushConnectorScheduler._nixl_handshake_listener, None, args.rounds // 5)
            authed += _fetch_times(authenticated_listener(secret), secret, args.rounds // 5)
        push_reg = b"PUSH_REG:" + msgspec.msgpack.encode({
            "request_id": "cmpl-0123456789abcdef-0", "decode_engine_id": "decode-0",
            "decode_host": "10.0.0.2", "decode_port": 5600, "decode_tp_size": 1,
            "local_block_ids": [list(range(args.blocks))]})
        heartbeat = b"HB:" + b",".join(f"cmpl-{i:016x}-0".encode() for i in range(8))
        notifs = {name: _notif_times(secret, msg, 2000) for name, msg in
                  (("push_reg", push_reg), ("heartbeat", heartbeat))}
    med = statistics.median
    result = {
        "fetch_ms": {"vllm_listener": med(stock) * 1e3, "authenticated": med(authed) * 1e3},
        "fetch_added_ms": (med(authed) - med(stock)) * 1e3,
        "notifications_us": {name: {"bytes": len(push_reg if name == "push_reg" else heartbeat),
                                    "wrap": med(w) * 1e6, "check": med(c) * 1e6}
                             for name, (w, c) in notifs.items()},
    }
    bench.say(f"metadata fetch (one rank, a fresh socket), median: vLLM's listener "
              f"{result['fetch_ms']['vllm_listener']:.3f} ms, with the secret "
              f"{result['fetch_ms']['authenticated']:.3f} ms (+{result['fetch_added_ms']:.3f} ms)")
    for name, row in result["notifications_us"].items():
        bench.say(f"{name} ({row['bytes']} bytes): wrap {row['wrap']:.1f} us, check {row['check']:.1f} us")
    return result

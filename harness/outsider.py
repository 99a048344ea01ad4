"""A process outside the deployment that tries what the trust boundary must stop.

Run on a host of its own (a network namespace on the demo's bridge):
`python -m harness.outsider --side-channel HOST:PORT [--metadata FILE --request-id ID
[--wrong-secret-file F]]`. It prints one line, `OUTSIDER-RESULT <json>`, and then waits for its stdin to close
(so what it sent is still in flight while the test looks at the engine):
- `fetch`: it asks the engine's side channel for rank (0, 0)'s metadata exactly as
  vLLM's handshake does (`(GET_META_MSG, 0, 0)`): `"got N bytes"` or `"refused: ..."`;
- with `--metadata` (metadata the test hands it, as an agent that held it before the
  secret was set would have it): it loads the engine's NIXL agent and sends it a forged
  PUSH_REG for request `--request-id`, naming its own blocks, bare and, with
  `--wrong-secret-file`, wrapped with a MAC under another secret, again every half second
  until its stdin closes.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import select
import subprocess
import sys
from pathlib import Path
from typing import Any

import msgspec

RESULT_PREFIX = "OUTSIDER-RESULT "


def _fetch(host: str, port: int) -> str:
    from connector.glue.side_channel import SideChannelClient
    from connector.telemetry.record import HandshakeError

    try:
        with SideChannelClient(host, port, 5000) as channel:
            return f"got {len(channel.fetch(0, 0).payload)} bytes"
    except HandshakeError as exc:
        return f"refused: {exc.error_type.value}: {exc}"


def _forge(metadata: bytes, request_id: str, wrong_secret: str | None) -> tuple[Any, str, list[bytes]]:
    from nixl._api import nixl_agent, nixl_agent_config
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import (
        NixlAgentMetadata,
        NixlHandshakePayload,
    )

    from connector.trust.proofs import wrap_notif
    from connector.trust.secret import PeerSecret

    payload = msgspec.msgpack.Decoder(NixlHandshakePayload).decode(metadata)
    meta = msgspec.msgpack.Decoder(NixlAgentMetadata).decode(payload.agent_metadata_bytes)
    agent = nixl_agent(f"outsider-{secrets.token_hex(4)}", nixl_agent_config(backends=["UCX"]))
    remote = agent.add_remote_agent(meta.agent_metadata)
    # (Connected first: a notification sent while UCX still wires the endpoint up can be
    # cancelled, and then nothing reaches the engine to refuse.)
    agent.make_connection(remote)
    forged = b"PUSH_REG:" + msgspec.msgpack.encode({
        "request_id": request_id, "decode_engine_id": "outsider", "decode_host": "outsider",
        "decode_port": 1, "decode_tp_size": 1, "local_block_ids": [[0, 1, 2, 3]]})
    messages = [forged]
    if wrong_secret:
        messages.append(wrap_notif(PeerSecret(wrong_secret, 0), b"decode-0", forged))
    forged_notifs = (agent, remote, messages)
    _send(forged_notifs)
    return forged_notifs


def _send(forged: tuple[Any, str, list[bytes]]) -> None:
    agent, remote, messages = forged
    for message in messages:
        agent.send_notif(remote, notif_msg=message)


def _keep_sending(forged: tuple[Any, str, list[bytes]]) -> None:
    """As an attacker would, send the forged notifications again every half second until
    stdin closes (a send UCX cancels while it wires the endpoint up reaches nobody)."""
    while not select.select([sys.stdin], [], [], 0.5)[0]:
        _send(forged)


class Outsider:
    """This tool run on `host` (demo.network.Host) against `side_channel`, its result read;
    stopped (by pid) on exit. Its stderr goes to `log`."""

    def __init__(self, host: Any, side_channel: str, log: Path, *args: str):
        repo = Path(__file__).resolve().parents[1]
        env = {**os.environ, "PYTHONPATH": str(repo), "UCX_TLS": "tcp", "HF_HUB_OFFLINE": "1"}
        self.log = open(log, "ab")  # noqa: SIM115 (closed in __exit__)
        argv = [sys.executable, "-m", "harness.outsider", "--side-channel", side_channel, *args]
        self.proc = subprocess.Popen(host.command(argv), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.log, env=env, cwd=repo)
        line = b""
        while self.proc.stdout and not line.startswith(RESULT_PREFIX.encode()):
            line = self.proc.stdout.readline()
            if not line:
                self.__exit__()
                raise RuntimeError(f"the outsider gave no result (exit {self.proc.poll()}); see {log}")
        self.result: dict[str, Any] = json.loads(line[len(RESULT_PREFIX):])

    def __enter__(self) -> Outsider:
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            if self.proc.stdin and not self.proc.stdin.closed:
                self.proc.stdin.close()
            self.proc.wait(30)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait(10)
            self.log.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m harness.outsider", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--side-channel", required=True, help="HOST:PORT of the engine's side channel")
    parser.add_argument("--metadata", help="a file with the engine's rank-0 handshake payload")
    parser.add_argument("--request-id", default="forged")
    parser.add_argument("--wrong-secret-file")
    args = parser.parse_args(argv)
    host, _, port = args.side_channel.rpartition(":")
    out: dict[str, object] = {"fetch": _fetch(host, int(port))}
    forged = None
    if args.metadata:
        with open(args.metadata, "rb") as f:
            forged = _forge(f.read(), args.request_id, args.wrong_secret_file)
        out["forged_sent"] = len(forged[2])
    print(RESULT_PREFIX + json.dumps(out), flush=True)  # (NIXL logs to stdout too)
    if forged is not None:
        _keep_sending(forged)
    sys.stdin.read()  # (until the test closes it: what was sent stays in flight meanwhile)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

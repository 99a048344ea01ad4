"""Where the router sends its legs: P URLs with their side-channel coordinates, D URLs.

D must know P's engine id and side-channel address (it handshakes with P and sends
PUSH_REG there), so each prefill target carries them. Given on the command line as
`URL,engine_id=ID,side_channel=HOST:PORT[,tp_size=N][,pp_size=N]`, or in a JSON file
`{"prefill": [{"url": ..., "engine_id": ..., "side_channel": "HOST:PORT"}], "decode": [URL, ...]}`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit


class ConfigError(ValueError):
    pass


def _check_url(url: str) -> str:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ConfigError(f"not an http(s) URL: {url!r}")
    return url.rstrip("/")


def _host_port(value: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ConfigError(f"side_channel must be HOST:PORT, got {value!r}")
    return host.strip("[]"), int(port)


@dataclass(frozen=True)
class PrefillTarget:
    """One P engine: its HTTP URL and the NIXL side channel D handshakes with."""

    url: str
    engine_id: str
    side_channel_host: str
    side_channel_port: int
    tp_size: int = 1
    pp_size: int = 1

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> PrefillTarget:
        missing = [k for k in ("url", "engine_id", "side_channel") if not d.get(k)]
        if missing:
            raise ConfigError(f"prefill target {d!r} lacks {', '.join(missing)}")
        unknown = set(d) - {"url", "engine_id", "side_channel", "tp_size", "pp_size"}
        if unknown:
            raise ConfigError(f"prefill target: unknown keys {sorted(unknown)}")
        host, port = _host_port(str(d["side_channel"]))
        try:
            tp, pp = int(d.get("tp_size", 1)), int(d.get("pp_size", 1))
        except ValueError as exc:
            raise ConfigError(f"prefill target: tp_size/pp_size must be integers ({d!r})") from exc
        return cls(_check_url(str(d["url"])), str(d["engine_id"]), host, port, tp, pp)

    @classmethod
    def parse(cls, spec: str) -> PrefillTarget:
        """`URL,engine_id=ID,side_channel=HOST:PORT[,tp_size=N][,pp_size=N]`."""
        url, *pairs = [p.strip() for p in spec.split(",")]
        d: dict[str, Any] = {"url": url}
        for pair in pairs:
            key, sep, value = pair.partition("=")
            if not sep:
                raise ConfigError(f"expected key=value in --prefill {spec!r}, got {pair!r}")
            d[key.strip()] = value.strip()
        return cls.from_dict(d)

    def remote_params(self) -> dict[str, Any]:
        """The part of D's kv_transfer_params that points at this P."""
        return {"remote_engine_id": self.engine_id, "remote_host": self.side_channel_host,
                "remote_port": self.side_channel_port, "tp_size": self.tp_size, "pp_size": self.pp_size}


@dataclass(frozen=True)
class RouterConfig:
    prefill: tuple[PrefillTarget, ...]
    decode: tuple[str, ...]
    connect_timeout_s: float = 5.0
    request_timeout_s: float = 600.0
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.prefill:
            raise ConfigError("at least one prefill target is needed")
        if not self.decode:
            raise ConfigError("at least one decode URL is needed")

    @classmethod
    def from_args(cls, prefill: list[str], decode: list[str], config_file: Path | None = None,
                  **timeouts: float) -> RouterConfig:
        p = [PrefillTarget.parse(s) for s in prefill]
        d = [_check_url(u) for u in decode]
        if config_file is not None:
            try:
                data = json.loads(Path(config_file).read_text())
            except (OSError, json.JSONDecodeError) as exc:
                raise ConfigError(f"cannot read router config {config_file}: {exc}") from exc
            p += [PrefillTarget.from_dict(x) for x in data.get("prefill", [])]
            d += [_check_url(u) for u in data.get("decode", [])]
        return cls(tuple(p), tuple(d), **timeouts)

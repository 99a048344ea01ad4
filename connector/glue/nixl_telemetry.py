"""NIXL's own Prometheus exporter, checked before NIXL reads it.

NIXL reads `NIXL_TELEMETRY_*` from the environment when vLLM builds a worker's agent,
and a bad value (a typo in the exporter's name, `prometheus_mp` without its directory,
a port that is not a number, a bucket list out of order) makes the agent's constructor
raise "Failed to create telemetry exporter: <name>", which names neither the variable
nor the value. The connector checks the same values first, in every process that builds
it, and stops the engine with the variable and the fix named. It also warns about the
two set-ups that start but export less than the user thinks: the default port (9090,
Prometheus's own) and the one-process exporter under TP > 1 (one rank wins the port,
the others export nothing).
"""

from __future__ import annotations

import os
import site
from collections.abc import Mapping
from dataclasses import dataclass, field
from itertools import pairwise
from pathlib import Path

ENABLE = "NIXL_TELEMETRY_ENABLE"
EXPORTER = "NIXL_TELEMETRY_EXPORTER"
PORT = "NIXL_TELEMETRY_PROMETHEUS_PORT"
LOCAL = "NIXL_TELEMETRY_PROMETHEUS_LOCAL"
MULTIPROC_DIR = "NIXL_TELEMETRY_MULTIPROC_DIR"
BUCKETS = "NIXL_TELEMETRY_HISTOGRAM_BUCKETS_US"
PLUGIN_DIR = "NIXL_PLUGIN_DIR"

PROMETHEUS = "prometheus"
PROMETHEUS_MP = "prometheus_mp"
NIXL_DEFAULT_PORT = 9090  # NIXL's default: Prometheus's own port
MP_MAX_BUCKETS = 32  # prometheus_mp keeps its bounds in a fixed-layout store
# NIXL's spelling of booleans (case-insensitive).
_TRUE = frozenset({"y", "yes", "on", "1", "true", "enable"})
_FALSE = frozenset({"n", "no", "off", "0", "false", "disable"})


class NixlTelemetryEnvError(ValueError):
    """A NIXL_TELEMETRY_* value NIXL would refuse inside its agent's constructor."""


@dataclass(frozen=True)
class NixlTelemetryEnv:
    """What the environment asks of NIXL's exporter, and the warnings for the log."""

    enabled: bool
    exporter: str | None = None
    port: int | None = None
    warnings: tuple[str, ...] = field(default=())


def _flag(env: Mapping[str, str], name: str) -> bool:
    raw = env.get(name, "").strip().lower()
    if raw in _TRUE:
        return True
    if raw in _FALSE or raw == "":
        return False
    raise NixlTelemetryEnvError(
        f"{name}={env[name]!r} is not a NIXL boolean: use one of y, yes, on, 1, true, enable "
        "(or n, no, off, 0, false, disable)")


def _plugin_dirs(env: Mapping[str, str]) -> list[Path]:
    """Where NIXL looks for `libtelemetry_exporter_<name>.so`: NIXL_PLUGIN_DIR, else the
    plugin folders the NIXL wheels install beside themselves."""
    if env.get(PLUGIN_DIR):
        return [Path(env[PLUGIN_DIR])]
    found: list[Path] = []
    for root in {*site.getsitepackages(), site.getusersitepackages()}:
        base = Path(root)
        if base.is_dir():
            found += [p for p in base.glob(".nixl*.mesonpy.libs/plugins") if p.is_dir()]
            found += [p for p in base.glob("nixl*.libs/nixl") if p.is_dir()]
    return found


def _check_exporter(env: Mapping[str, str], exporter: str) -> None:
    dirs = _plugin_dirs(env)
    library = f"libtelemetry_exporter_{exporter}.so"
    if dirs and not any((d / library).is_file() for d in dirs):
        known = sorted({p.name[len("libtelemetry_exporter_"):-3] for d in dirs
                        for p in d.glob("libtelemetry_exporter_*.so")})
        raise NixlTelemetryEnvError(
            f"{EXPORTER}={exporter!r}: NIXL has no such exporter ({library} is not in "
            f"{', '.join(map(str, dirs))}); installed: {', '.join(known) or 'none'}")


def _check_port(env: Mapping[str, str]) -> int:
    raw = env.get(PORT, "").strip()
    if not raw:
        return NIXL_DEFAULT_PORT
    if not raw.isdigit() or not 0 < int(raw) < 65536:
        raise NixlTelemetryEnvError(f"{PORT}={raw!r} is not a TCP port (1-65535)")
    return int(raw)


def _check_buckets(env: Mapping[str, str], exporter: str) -> None:
    raw = env.get(BUCKETS, "").strip()
    if not raw:
        return
    try:
        bounds = [float(b) for b in raw.split(",")]
    except ValueError:
        bounds = []
    if not bounds or any(b <= 0 for b in bounds) or any(a >= b for a, b in pairwise(bounds)):
        raise NixlTelemetryEnvError(
            f"{BUCKETS}={raw!r}: NIXL wants comma-separated, strictly increasing, positive "
            "microsecond bounds (e.g. 10,100,1000)")
    if exporter == PROMETHEUS_MP and len(bounds) > MP_MAX_BUCKETS:
        raise NixlTelemetryEnvError(
            f"{BUCKETS} has {len(bounds)} bounds; the {PROMETHEUS_MP} exporter keeps at most "
            f"{MP_MAX_BUCKETS}")


def _check_multiproc_dir(env: Mapping[str, str]) -> None:
    raw = env.get(MULTIPROC_DIR, "").strip()
    if not raw:
        raise NixlTelemetryEnvError(
            f"{EXPORTER}={PROMETHEUS_MP} needs {MULTIPROC_DIR}: one local directory shared by "
            "every rank of this engine (e.g. an emptyDir volume), private to it")
    path = Path(raw)
    if path.exists() and not path.is_dir():
        raise NixlTelemetryEnvError(f"{MULTIPROC_DIR}={raw!r} is not a directory")
    if not path.exists():
        try:
            path.mkdir(mode=0o700, parents=True, exist_ok=True)  # (NIXL would, with the umask)
        except OSError as exc:
            raise NixlTelemetryEnvError(f"{MULTIPROC_DIR}={raw!r} cannot be created: {exc}") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise NixlTelemetryEnvError(f"{MULTIPROC_DIR}={raw!r} is not writable by this process")


def check_nixl_telemetry_env(env: Mapping[str, str], world_size: int = 1) -> NixlTelemetryEnv:
    """Raise NixlTelemetryEnvError for what NIXL's constructor would refuse; return what
    the exporter will do, with warnings for what starts but exports less than meant."""
    if not _flag(env, ENABLE):
        return NixlTelemetryEnv(enabled=False)
    exporter = env.get(EXPORTER, "").strip()
    if not exporter:  # NIXL's own default sink (not a Prometheus endpoint): nothing to check
        return NixlTelemetryEnv(enabled=True)
    _check_exporter(env, exporter)
    if exporter not in (PROMETHEUS, PROMETHEUS_MP):
        return NixlTelemetryEnv(enabled=True, exporter=exporter)
    port = _check_port(env)
    _flag(env, LOCAL)
    _check_buckets(env, exporter)
    if exporter == PROMETHEUS_MP:
        _check_multiproc_dir(env)
    warnings = []
    if port == NIXL_DEFAULT_PORT:
        warnings.append(f"NIXL's exporter listens on {port} ({PORT} unset or {port}), Prometheus's "
                        f"own port: give it a port of its own")
    if exporter == PROMETHEUS and world_size > 1:
        warnings.append(f"{EXPORTER}={PROMETHEUS} with {world_size} workers: one rank binds "
                        f"port {port} and the others export nothing; {PROMETHEUS_MP} with "
                        f"{MULTIPROC_DIR} exports every rank")
    return NixlTelemetryEnv(enabled=True, exporter=exporter, port=port, warnings=tuple(warnings))

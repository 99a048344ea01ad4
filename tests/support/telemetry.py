"""Test-side resets of the connector's process-wide telemetry state."""

from __future__ import annotations

from connector.telemetry import errors


def reset_telemetry_errors() -> None:
    """Forget counted telemetry faults and which reasons were already logged, so a test
    sees its own faults only (and the first of each reason at WARNING again)."""
    errors.drain()
    errors._warned.clear()

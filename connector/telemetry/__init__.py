"""Telemetry emission: handshake records, worker stats, Prometheus and OTel spans."""

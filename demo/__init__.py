"""`make demo`: the real deployment on this machine, observed.

Real `vllm serve` P and D engines with the fork, the project's router, a local OTLP
receiver (or the user's), and a real Prometheus with the shipped rules; requests
checked against a single-engine reference; a report read from those systems.
"""

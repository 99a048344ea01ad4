"""Dashboards, Prometheus rules and their checks, generated from `connector.vocabulary`.

`python -m dashboards.generate` writes every artefact; `--check` verifies them.
"""

"""Test support shipped with the package (in-memory span capture, metric registries)."""

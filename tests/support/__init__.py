"""Helpers shared by the tests (never shipped: the wheel holds `connector/` only)."""

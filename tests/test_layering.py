"""Layering, read from the source: the connector imports none of the tools around it, and
the dashboards none of the demo or the harness (the names both share live in
`connector/vocabulary.py`). Every import counts, at module level or inside a function."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

# package -> the top-level packages none of its modules may import
FORBIDDEN = {
    "connector": ("dashboards", "demo", "harness", "benchmarks", "tests"),
    "dashboards": ("demo", "harness"),
}
# The imports of the harness that dashboards/ still has, each exactly (module -> imported names):
# the dashboard tools that run real processes take the one poll-with-deadline helper and the
# port picker from the harness (`harness/poll.py`, `harness/ports.py`, which import nothing of
# the project), and the preview drives a harness run. They go once those two helpers move
# below both packages; nothing may be added here.
KNOWN = {
    "dashboards/promrun.py": {"harness.poll", "harness.ports"},
    "dashboards/preview.py": {"harness", "harness.poll"},
}


def imported(source: str) -> set[str]:
    """Every absolute module a source imports (`import a.b`, `from a.b import c`: "a.b")."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.add(node.module)
    return out


def violations(package: str) -> dict[str, list[str]]:
    """Module path -> the forbidden imports it has (the known ones excepted)."""
    out: dict[str, list[str]] = {}
    for path in sorted((REPO / package).rglob("*.py")):
        rel = path.relative_to(REPO).as_posix()
        bad = sorted(m for m in imported(path.read_text()) - KNOWN.get(rel, set())
                     if m.split(".")[0] in FORBIDDEN[package])
        if bad:
            out[rel] = bad
    return out


@pytest.mark.parametrize("package", FORBIDDEN)
def test_package_imports_none_of_the_layers_above_it(package: str) -> None:
    assert violations(package) == {}


def test_the_known_exceptions_are_still_there() -> None:
    """An exception that is gone is taken off the list (so it cannot come back unseen)."""
    for rel, names in KNOWN.items():
        assert names <= imported((REPO / rel).read_text()), rel


@pytest.mark.parametrize(("source", "found"), [
    ("import demo.report", {"demo.report"}),
    ("from demo import report", {"demo"}),
    ("def f():\n    from harness.poll import wait_until\n", {"harness.poll"}),
    ("from . import panels", set()),
])
def test_imports_are_read_wherever_they_are(source: str, found: set[str]) -> None:
    assert imported(source) == found


@pytest.mark.parametrize("below", ["connector/settings.py", "connector/vocabulary.py", "connector/integrity",
                                   "connector/trust",
                                   "connector/state", "connector/telemetry"])
def test_what_sits_below_the_vllm_glue_imports_none_of_it(below: str) -> None:
    """Settings, the vocabulary, the KV check's parts, the state owners and the telemetry
    are what the glue (connector/glue: vLLM's subclasses) is built on: no arrow back up."""
    root = REPO / below
    paths = [root] if root.is_file() else sorted(root.rglob("*.py"))
    bad = {p.relative_to(REPO).as_posix(): sorted(m for m in imported(p.read_text())
                                                 if m == "connector.glue" or m.startswith("connector.glue."))
           for p in paths}
    assert {k: v for k, v in bad.items() if v} == {}

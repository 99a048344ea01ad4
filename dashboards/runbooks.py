"""The runbooks (docs/runbooks.md): each alert's link to its section, and the check that
every alert has one and that a section names only what exists.

A section is `## <alert name>`; its link is `<base>#<anchor>` with the heading's anchor
as GitHub and most Markdown renderers make it (the name lowercased). The base is a
setting of the generator (`--runbook-base-url`), by default the repository-relative path.

What a section may name, checked (`python -m dashboards.generate --check`):
- queries in backticks (anything with a bracket): every metric, label and label value
  as for a panel (`check.check_expr`), recording rules of ours allowed;
- a metric alone in backticks (`vllm:...`, `nixl_router_...`): a series the vocabulary
  defines, or a recording rule of ours (`instance:...`);
- `panel "Title"` (and `"Title" and "Other"` after it) and `row "Title"`: a panel or row
  of the generated dashboard.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from connector import vocabulary as V

REPO = Path(__file__).resolve().parent.parent
RUNBOOKS_FILE = REPO / "docs" / "runbooks.md"
DEFAULT_BASE_URL = "docs/runbooks.md"

_SECTION = re.compile(r"^## (\S+)\s*$", re.MULTILINE)
_CODE = re.compile(r"`([^`]+)`")
_SERIES = re.compile(r"(?:vllm:|nixl_router_|instance:)[A-Za-z0-9_:]+")
_PANELS = re.compile(r"\b[Pp]anels? \"([^\"]+)\"(?: and \"([^\"]+)\")?")
_ROWS = re.compile(r"\b[Rr]ow \"([^\"]+)\"")


def anchor(alert: str) -> str:
    return alert.lower()


def link(alert: str, base_url: str = DEFAULT_BASE_URL) -> str:
    return f"{base_url}#{anchor(alert)}"


def sections(text: str) -> dict[str, str]:
    """Heading -> body of each `## ` section."""
    heads = list(_SECTION.finditer(text))
    return {m.group(1): text[m.end():heads[i + 1].start() if i + 1 < len(heads) else len(text)]
            for i, m in enumerate(heads)}


def _titles(dashboard: dict[str, Any]) -> tuple[set[str], set[str]]:
    """(panel titles, row titles) of a Grafana dashboard."""
    panels, rows = set(), set()

    def walk(items: list[dict[str, Any]]) -> None:
        for item in items:
            if item.get("type") == "row":
                rows.add(item["title"])
                walk(item.get("panels", []))
            else:
                panels.add(item["title"])

    walk(dashboard.get("panels", []))
    return panels, rows


def check_runbooks(rules: dict[str, Any], dashboard: dict[str, Any], text: str,
                   base_url: str = DEFAULT_BASE_URL) -> list[str]:
    from dashboards.check import check_expr
    from dashboards.queries import series_index

    every = [rule for group in rules.get("groups", []) for rule in group.get("rules", [])]
    alerts = {rule["alert"]: rule for rule in every if rule.get("alert")}
    recorded = frozenset(rule["record"] for rule in every if rule.get("record"))
    found = sections(text)
    errors = [f"alert {name}: no runbook section '## {name}' in {RUNBOOKS_FILE.name}"
              for name in alerts if name not in found]
    errors += [f"alert {name}: runbook_url is {rule.get('annotations', {}).get('runbook_url')!r}, "
               f"not {link(name, base_url)!r}" for name, rule in alerts.items()
               if rule.get("annotations", {}).get("runbook_url") != link(name, base_url)]
    errors += [f"runbook section {name!r} is no alert of the rules" for name in found if name not in alerts]
    panels, rows = _titles(dashboard)
    known = series_index().keys() | recorded | {V.OBSERVED_DEGRADED.name}  # (the guard's gauge)
    for name, body in found.items():
        where = f"runbook {name}"
        flat = " ".join(body.split())
        for code in _CODE.findall(flat):
            if any(c in code for c in "({["):
                errors += check_expr(code, where, allow_variables=False, recorded=recorded)
            elif _SERIES.fullmatch(code) and code not in known:
                errors.append(f"{where}: {code!r} is no metric of the vocabulary nor a recording rule")
        for match in _PANELS.finditer(flat):
            errors += [f"{where}: no panel titled {t!r}" for t in match.groups() if t and t not in panels]
        errors += [f"{where}: no row titled {t!r}" for t in _ROWS.findall(flat) if t not in rows]
    return errors

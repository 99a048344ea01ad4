"""The settings and figures the docs state are the code's.

- Every `kv_connector_extra_config` key the fork reads is in connector/glue/settings.py
  (no key read anywhere else), and the README's configuration table lists each one with
  the default the code has.
- The hold bound and the WRITE timeout that README.md and docs/reliability.md state are
  the ones the defaults give.
"""

from __future__ import annotations

import re
from pathlib import Path

from connector import settings

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()
RELIABILITY = (REPO / "docs" / "reliability.md").read_text()


def _readme_extra_config_rows() -> dict[str, str]:
    rows = {}
    for line in README.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[0] == "extra config" and cells[1].startswith("`"):
            rows[cells[1].strip("`")] = cells[2]
    return rows


def _as_written(setting: settings.Setting) -> str:
    if setting.derived:
        return setting.derived
    if isinstance(setting.default, bool):
        return str(setting.default).lower()
    if isinstance(setting.default, str):
        return f"`{setting.default}`"
    return str(setting.default)


def test_the_readme_lists_every_setting_with_its_default():
    rows = _readme_extra_config_rows()
    assert set(rows) == {s.key for s in settings.SETTINGS}
    assert {k: v for k, v in rows.items()} == {s.key: _as_written(s) for s in settings.SETTINGS}


def test_no_extra_config_key_is_read_outside_the_settings_module():
    """A key read with a literal default anywhere else would escape the table above."""
    pattern = re.compile(r"""\b(?:extra|get|get_from_extra_config)\(\s*["']([a-z_]+)["']""")
    keys = {s.key for s in settings.SETTINGS}
    strays = {}
    for path in (REPO / "connector" / "glue").glob("*.py"):
        if path.name == "settings.py":
            continue
        found = set(pattern.findall(path.read_text())) & (keys | {"decoder_kv_blocks_ttl"})
        if found:
            strays[path.name] = sorted(found)
    assert strays == {}


def test_the_hold_and_the_write_timeout_stated_are_the_defaults():
    hold = settings.default_hold_bound_s()
    lease, write, margin = (settings.KV_LEASE_DURATION.default, settings.PUSH_WRITE_TIMEOUT_S.default,
                            settings.PUSH_LEASE_MARGIN_S.default)
    assert f"{lease} +\n{write} + 2 x {margin} = {hold:g} s with the defaults" in RELIABILITY
    assert f"`push_write_timeout_s` ({write} s)" in RELIABILITY
    assert re.search(rf"after it last asked for the KV, {hold:g} s with\s+the defaults", README)
    assert f"(`kv_lease_duration` {lease} s," in RELIABILITY

"""The runbooks (docs/runbooks.md): a section and a `runbook_url` per alert, and nothing in a
section that does not exist; `make check-dashboards` runs the same check (dashboards/runbooks.py)."""

from __future__ import annotations

import copy

from dashboards import panels, rules, runbooks
from dashboards.generate import main as generate

TEXT = runbooks.RUNBOOKS_FILE.read_text()


def _check(rule_groups: dict | None = None, text: str = TEXT,
           base: str = runbooks.DEFAULT_BASE_URL) -> list[str]:
    built = rule_groups or rules.build_rules(rules.RuleSettings(base))
    return runbooks.check_runbooks(built, panels.build_dashboard(), text, base)


def _alerts(rule_groups: dict) -> list[dict]:
    return [r for g in rule_groups["groups"] for r in g["rules"] if r.get("alert")]


def test_every_alert_has_a_section_and_a_link_to_it() -> None:
    built = rules.build_rules()
    assert _check(built) == []
    names = [a["alert"] for a in _alerts(built)]
    assert set(runbooks.sections(TEXT)) == set(names) and len(names) >= 18
    assert all(a["annotations"]["runbook_url"] == f"docs/runbooks.md#{a['alert'].lower()}"
               for a in _alerts(built))


def test_the_base_url_is_a_setting_of_the_generator(tmp_path) -> None:
    base = "https://runbooks.example/nixl-push.md"
    built = rules.build_rules(rules.RuleSettings(base))
    assert {a["annotations"]["runbook_url"] for a in _alerts(built)} == \
        {f"{base}#{a['alert'].lower()}" for a in _alerts(built)}
    assert _check(built, base=base) == []
    assert generate(["--check"]) == 0  # (the checked-in rules carry the default)


def test_a_missing_section_or_link_fails_the_check() -> None:
    sections = runbooks.sections(TEXT)
    without = TEXT.replace("## NixlPeerRestarted\n" + sections["NixlPeerRestarted"], "")
    assert _check(text=without) == ["alert NixlPeerRestarted: no runbook section '## NixlPeerRestarted' in "
                                    "runbooks.md"]
    unlinked = copy.deepcopy(rules.build_rules())
    next(a for a in _alerts(unlinked) if a["alert"] == "NixlHandshakeStuck")["annotations"].pop("runbook_url")
    assert _check(unlinked) == ["alert NixlHandshakeStuck: runbook_url is None, not "
                                "'docs/runbooks.md#nixlhandshakestuck'"]
    stray = TEXT + "\n## NixlNoSuchAlert\n\nNothing.\n"
    assert _check(text=stray) == ["runbook section 'NixlNoSuchAlert' is no alert of the rules"]


def test_a_section_naming_what_does_not_exist_fails_the_check() -> None:
    section = runbooks.sections(TEXT)["NixlHandshakeStuck"]
    bad = section + ('Also `vllm:nixl_no_such_metric_total`, panel "No such panel", row "No such row", and\n'
                     '`sum by (instance) (rate(vllm:nixl_pushes_total{outcome="exploded"}[5m]))`.\n')
    errors = _check(text=TEXT.replace(section, bad))
    assert len(errors) == 4, errors
    assert any("vllm:nixl_no_such_metric_total" in e for e in errors)
    assert any("no panel titled 'No such panel'" in e for e in errors)
    assert any("no row titled 'No such row'" in e for e in errors)
    assert any("'exploded' is not a value the vocabulary allows" in e for e in errors)

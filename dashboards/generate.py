"""Dashboards as code: the Grafana dashboard, Prometheus rules, their Kubernetes objects
and docs/telemetry.md, all rendered from `connector.vocabulary`.

    python -m dashboards.generate          # (re)write every generated file
    python -m dashboards.generate --check  # fail if a file is stale or a query is wrong

`--check` fails when a checked-in file (Grafana, Perses, rules, Kubernetes objects, the doc)
differs from what is generated, when the Perses dashboards fail our Perses schema or lose a
row, panel or query of the Grafana one, when a panel or
rule selects a metric, label or label value the vocabulary does not define, when a
metric of the vocabulary is on no panel, when a panel lacks a unit or a description
naming its metrics, when a rate does not use `$__rate_interval` or a range panel uses
`increase()`, when a telemetry-error reason has no text for docs/telemetry.md, and when
an alert has no section in docs/runbooks.md or no `runbook_url` to it, or a section
names a metric, label value, panel or row that does not exist (runbooks.py).
Which module does what: panels.py (dashboard), perses.py (the same for Perses),
perses_schema.py (our transcription of Perses' schema), rules.py (rules), k8s.py (YAML and the Kubernetes
objects), telemetry_doc.py (the doc), check.py (the checks).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from dashboards import check, k8s, panels, perses, rules, runbooks, slo, telemetry_doc
from dashboards.queries import all_specs

ROOT = Path(__file__).resolve().parent


def render_all(settings: rules.RuleSettings = rules.DEFAULT_SETTINGS) -> dict[str, str]:
    """Relative path under dashboards/ -> file text, for every generated file there."""
    dashboard_json = json.dumps(panels.build_dashboard(), indent=2) + "\n"
    rule_groups = rules.build_rules(settings)
    return {
        panels.DASHBOARD_FILE: dashboard_json,
        rules.RULES_FILE: k8s.HEADER + k8s.to_yaml(rule_groups),
        k8s.CONFIGMAP_FILE: k8s.render_configmap(panels.DASHBOARD_FILE, dashboard_json),
        k8s.PROMETHEUS_RULE_FILE: k8s.render_prometheus_rule(rule_groups),
        **perses.render(),
    }


def _outputs(root: Path, doc: Path, settings: rules.RuleSettings) -> dict[Path, str]:
    out = {root / rel: text for rel, text in render_all(settings).items()}
    out[doc] = telemetry_doc.render()
    return out


def generated_errors(settings: rules.RuleSettings = rules.DEFAULT_SETTINGS) -> list[str]:
    """Problems of what the generator renders (checked before anything is written),
    the runbooks included (a section per alert, naming only what exists)."""
    dashboard = panels.build_dashboard()
    rule_groups = rules.build_rules(settings)
    return (check.check_dashboard(dashboard) + check.check_conventions(dashboard)
            + check.check_perses(dashboard, [perses.build_dashboard(dashboard),
                                             perses.build_operator_resource(dashboard)])
            + check.check_rules(rule_groups) + telemetry_doc.missing_texts()
            + runbooks.check_runbooks(rule_groups, dashboard, runbooks.RUNBOOKS_FILE.read_text(),
                                      settings.runbook_base_url)
            + slo.OBJECTIVES.errors())


def check_all(root: Path, doc: Path, settings: rules.RuleSettings = rules.DEFAULT_SETTINGS) -> list[str]:
    """Every problem `--check` reports: the generated artefacts' own checks first, then
    the files on disk (stale, missing, or hand-edited with unknown names)."""
    return generated_errors(settings) or (
        check.check_files(root, render_all(settings))
        + check.stale(f"{doc.name} ({doc})", doc, telemetry_doc.render()))


def write_files(root: Path, doc: Path = telemetry_doc.DOC_FILE,
                settings: rules.RuleSettings = rules.DEFAULT_SETTINGS) -> list[Path]:
    """Write what changed; returns the paths written."""
    written = []
    for path, text in _outputs(root, doc, settings).items():
        path.parent.mkdir(parents=True, exist_ok=True)
        if not path.exists() or path.read_text() != text:
            path.write_text(text)
            written.append(path)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dashboards.generate", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true",
                        help="verify instead of writing; non-zero exit on any problem")
    parser.add_argument("--root", type=Path, default=ROOT,
                        help="directory holding grafana/, rules/ and k8s/ (default: this package)")
    parser.add_argument("--doc", type=Path, default=telemetry_doc.DOC_FILE,
                        help="path of the telemetry reference (default: docs/telemetry.md)")
    parser.add_argument("--runbook-base-url", default=runbooks.DEFAULT_BASE_URL,
                        help="where docs/runbooks.md is served: each alert's runbook_url is this plus "
                             f"#<alert> (default: {runbooks.DEFAULT_BASE_URL}, relative to the repository)")
    args = parser.parse_args(argv)
    base = rules.RuleSettings(args.runbook_base_url)
    errors = check_all(args.root, args.doc, base) if args.check else generated_errors(base)
    if errors:
        print(f"dashboards check FAILED ({len(errors)} problem(s)):", file=sys.stderr)
        for error in errors:
            print(f"- {error}", file=sys.stderr)
        return 1
    if args.check:
        print(f"dashboards check OK: {', '.join(render_all())} and {args.doc.name} up to date; every "
              f"query uses vocabulary names and all {len(all_specs())} metrics are on a panel")
        return 0
    for path in write_files(args.root, args.doc, base):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

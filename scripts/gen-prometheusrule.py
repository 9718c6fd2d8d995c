#!/usr/bin/env python3
"""Regenerates rules/stanch-prometheusrule.yaml from rules/stanch.rules.yml (needs PyYAML).

The plain rule file is the source; the Prometheus Operator manifest carries the same
groups. `cargo test` fails when the two differ.
"""
import pathlib

import yaml

root = pathlib.Path(__file__).resolve().parent.parent
rules = yaml.safe_load((root / "rules" / "stanch.rules.yml").read_text())
manifest = {
    "apiVersion": "monitoring.coreos.com/v1",
    "kind": "PrometheusRule",
    "metadata": {
        "name": "stanch",
        "labels": {"app.kubernetes.io/name": "stanch", "app.kubernetes.io/component": "rules"},
    },
    "spec": rules,
}
header = (
    "# The same groups as rules/stanch.rules.yml, for the Prometheus Operator. A test keeps\n"
    "# the two identical; edit rules/stanch.rules.yml and regenerate with\n"
    "# scripts/gen-prometheusrule.py.\n"
)
out = root / "rules" / "stanch-prometheusrule.yaml"
out.write_text(header + yaml.safe_dump(manifest, sort_keys=False, allow_unicode=True, width=200))
print(f"wrote {out}")

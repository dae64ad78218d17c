"""The HPA's signal exists: the series the prometheus-adapter rule reads is on a real
Triton's metrics port, for the streaming decoder. Uses the suite's shared server (the
`triton` fixture), so under `make test` it costs no extra start-up; skipped with the
other served tests where tritonserver is not installed."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

REPO_ROOT = Path(__file__).resolve().parents[2]
K8S = REPO_ROOT / "deploy" / "kubernetes"


def test_the_adapter_rule_series_is_exported_for_the_streaming_decoder(triton):
    hpa = next(d for d in yaml.safe_load_all((K8S / "base" / "triton-hpa.yaml").read_text()) if d)
    metric = hpa["spec"]["metrics"][0]["pods"]["metric"]["name"]
    rules = yaml.safe_load((K8S / "prometheus-adapter" / "values.yaml").read_text())["rules"]["custom"]
    rule = next(r for r in rules if r["name"]["as"] == metric)
    series = re.match(r"(\w+)\{", rule["seriesQuery"]).group(1)
    model = re.search(r'model="([^"]+)"', rule["seriesQuery"]).group(1)
    exported = re.findall(rf"^{series}\{{([^}}]*)\}} \S+$", triton.metrics(), re.M)
    models = {dict(re.findall(r'(\w+)="([^"]*)"', labels)).get("model") for labels in exported}
    assert model in models, f"{series} for model {model} is not on the metrics port (found it for {sorted(models)})"

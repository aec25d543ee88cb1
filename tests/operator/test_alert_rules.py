"""The chart's alerts under ``promtool test rules`` (helm/pagoda/tests/alerts.test.yaml): the rules
as the chart renders them, with its default thresholds."""

from __future__ import annotations

import pathlib
import shutil
import subprocess

import helm_python
import pytest
import yaml
from op_schema import CHART

TESTS = CHART / "tests" / "alerts.test.yaml"
PROMTOOL = shutil.which("promtool")


def rendered_rules() -> dict:
    chart = helm_python.Chart.load(str(CHART))
    values = {"metrics": {"prometheusRule": {"enabled": True}}}
    out = chart.render(values, name="pagoda", namespace="pagoda-system")
    (rule,) = [
        d
        for path, text in out.items()
        if path.endswith(".yaml")
        for d in yaml.safe_load_all(text)
        if d and d["kind"] == "PrometheusRule"
    ]
    return {"groups": rule["spec"]["groups"]}


def test_every_alert_has_a_promtool_test() -> None:
    alerts = {r["alert"] for g in rendered_rules()["groups"] for r in g["rules"] if "alert" in r}
    tested = {
        t["alertname"]
        for case in yaml.safe_load(TESTS.read_text())["tests"]
        for t in case.get("alert_rule_test", [])
    }
    assert alerts == tested


@pytest.mark.skipif(
    PROMTOOL is None, reason="promtool is not installed (Debian's prometheus package ships it)"
)
def test_promtool_passes_the_alert_tests(tmp_path: pathlib.Path) -> None:
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump(rendered_rules(), sort_keys=False))
    shutil.copy(TESTS, tmp_path / TESTS.name)
    check = subprocess.run(
        [PROMTOOL, "check", "rules", "rules.yaml"], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert check.returncode == 0, check.stdout + check.stderr
    run = subprocess.run(
        [PROMTOOL, "test", "rules", TESTS.name], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stdout + run.stderr

"""``pagoda bench integrity --soak`` with small numbers: every injected fault is detected, nothing
else is flagged, no bystander fails and every page comes back; with the check off, the soak says so."""

from __future__ import annotations

import json

from pagoda.node_agent.cli.main import main

from .shape import check_environment, check_png

SOAK = ["bench", "integrity", "--soak", "--dtype", "float32", "--decode-kv", "int8", "--threads", "1"]


def test_soak_accounts_for_every_fault_and_page(no_reload, tmp_path) -> None:
    out = tmp_path / "soak.json"
    assert main([*SOAK, "--requests", "300", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    check_environment(res, "integrity", threads=1)
    assert res["bench"] == "integrity-soak" and res["requests"] == 300
    assert "tiny random weights" in res["model"] and res["model_sizes"]["num_layers"] == 2
    injected = res["faults_injected"]
    assert injected > 100 and set(res["faults_by_kind"]) == {"stale_mapping", "flip_tag"}
    assert set(res["faults_by_site"]) == {"prefill", "decode", "migration"}
    assert res["detected"] == injected and res["missed"] == 0 and res["detection_pct"] == 100.0
    assert res["false_positives"] == 0 and res["pages_checked"] > injected
    assert res["victims_failed_closed"] == injected and res["victims_wrong_outcome"] == 0
    assert res["bystanders"] == 300 - injected and res["bystander_failures"] == 0
    assert res["leaked_pages"] == 0
    for pool in res["pools"]:
        assert pool["free_at_end"] == pool["free_at_start"] == pool["pages"]
    # the churn the soak claims: preemption, prefix reuse, migration and handoffs all happened
    assert res["preemptions"] > 0 and res["prefix_hit_tokens"] > 0
    assert res["migrations"] > 0 and res["handoffs"] > 0
    assert res["integrity_counters"]["requests_aborted"] == injected
    check_png(out)


def test_soak_fails_when_the_check_is_off(no_reload, tmp_path) -> None:
    out = tmp_path / "off.json"
    assert main([*SOAK, "--integrity", "off", "--requests", "60", "--json", str(out)]) == 1
    res = json.loads(out.read_text())
    assert res["faults_injected"] > 0 and res["detected"] == 0
    assert res["missed"] == res["faults_injected"] and res["victims_wrong_outcome"] > 0

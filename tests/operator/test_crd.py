"""The CRD schema: defaults, rejections, CEL rules (evaluated with celpy), printer columns."""

from __future__ import annotations

import pathlib

import jsonschema
import kubernetes_validate
import pytest
import yaml
from op_schema import CHART, CRD_PATH, ROOT, admit, example, load_crd, md_schema

from pagoda.operator import spec as spec_mod

EXAMPLES = sorted((CHART / "examples").glob("*.yaml"))


def test_crd_is_a_valid_customresourcedefinition(crd: dict) -> None:
    kubernetes_validate.validate(crd, "1.33", strict=True)
    version = crd["spec"]["versions"][0]
    assert crd["spec"]["names"]["shortNames"] == ["md"]
    assert version["subresources"] == {"status": {}}


def test_chart_installs_the_same_crd() -> None:
    assert (CHART / "crds" / "modeldeployment.yaml").read_bytes() == CRD_PATH.read_bytes()


def test_defaults_match_the_operator_defaults() -> None:
    stored = admit(example())
    parsed = spec_mod.parse(stored["spec"])
    assert parsed == spec_mod.parse({"model": {"source": "builtin://smollm2-135m"}})
    # auto: the engine picks per source (stored for a pre-quantized checkpoint, else fp8 / int4)
    assert stored["spec"]["prefill"]["weightFormat"] == stored["spec"]["decode"]["weightFormat"] == "auto"
    assert parsed.prefill.weight_format == parsed.decode.weight_format == "auto"
    assert (
        stored["spec"]["decode"]["kvCacheFormat"] == "int8"
        and stored["spec"]["integrity"]["mode"] == "enforce"
    )
    # running the model directory's code is opt-in
    assert stored["spec"]["model"]["trustRemoteCode"] is False and parsed.trust_remote_code is False


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_examples_are_accepted(path: pathlib.Path) -> None:
    for doc in yaml.safe_load_all(path.read_text()):
        admit(doc)


def test_there_are_examples() -> None:
    assert len(EXAMPLES) >= 2


@pytest.mark.parametrize(
    ("spec", "why"),
    [
        ({"decode": {"weightFormat": "int3"}}, "'int3' is not one of"),
        ({"prefill": {"kvCacheFormat": "fp16"}}, "'fp16' is not one of"),
        ({"decode": {"replicas": -1}}, "-1 is less than the minimum"),
        ({"prefill": {"kvMemoryFraction": 1.5}}, "greater than the maximum"),
        ({"integrity": {"mode": "strict"}}, "'strict' is not one of"),
        ({"model": {"source": "s3://bucket/model"}}, "does not match"),
        ({"model": {}}, "'source' is a required property"),
        ({"auth": {"apiKeysSecret": {"key": "api-keys"}}}, "'name' is a required property"),
        ({"auth": {"apiKeysSecret": {"name": "Keys_Upper"}}}, "does not match"),
        ({"auth": {"apiKeysSecret": {"name": "k", "key": "a/b"}}}, "does not match"),
        ({"routing": {"trustTenantHeader": "yes"}}, "is not of type 'boolean'"),
        (
            {"model": {"source": "builtin://smollm2-135m", "trustRemoteCode": "yes"}},
            "is not of type 'boolean'",
        ),
        ({"networkPolicy": {"enabled": "no"}}, "is not of type 'boolean'"),
        ({"networkPolicy": {"metricsFrom": {"podSelector": {}}}}, "is not of type 'array'"),
        (
            {
                "networkPolicy": {
                    "metricsFrom": [{"podSelector": {"matchExpressions": [{"key": "a", "operator": "Is"}]}}]
                }
            },
            "'Is' is not one of",
        ),
        (
            {"networkPolicy": {"metricsFrom": [{"ipBlock": {"except": ["10.0.0.0/8"]}}]}},
            "'cidr' is a required",
        ),
    ],
)
def test_schema_rejects_bad_specs(spec: dict, why: str) -> None:
    body = example()
    body["spec"].update(spec)
    with pytest.raises(jsonschema.ValidationError, match=why):
        admit(body)


@pytest.mark.parametrize(
    ("spec", "why"),
    [
        ({"decode": {"tensorParallel": 4, "gpus": 2}}, "gpus is per pod"),
        ({"prefill": {"tensorParallel": 2, "gpus": 1}}, "gpus is per pod"),
        ({"decode": {"tensorParallel": 1, "gpus": 2}}, "gpus is per pod"),  # idle GPUs
        ({"decode": {"tensorParallel": 8, "nodesPerReplica": 2, "gpus": 8}}, "gpus is per pod"),
        ({"decode": {"tensorParallel": 2, "nodesPerReplica": 4}}, "nodesPerReplica must not exceed"),
        ({"prefill": {"tensorParallel": 6, "nodesPerReplica": 4}}, "must be a multiple of nodesPerReplica"),
        ({"prefill": {"kvCacheFormat": "fp8_e4m3"}, "decode": {"kvCacheFormat": "bf16"}}, "cannot hand off"),
        ({"prefill": {"kvCacheFormat": "fp8_e4m3"}, "decode": {"kvCacheFormat": "int8"}}, "cannot hand off"),
        ({"prefill": {"kvCacheFormat": "int8"}, "decode": {"kvCacheFormat": "bf16"}}, "cannot hand off"),
        ({"prefill": {"replicas": 0}}, "needs both pools"),
        (
            {
                "prefill": {"replicas": 0},
                "decode": {"autoscaling": {"maxReplicas": 3, "targets": {"itlSeconds": 1}}},
            },
            "needs both pools",
        ),
        (
            {"decode": {"autoscaling": {"minReplicas": 4, "maxReplicas": 3, "targets": {"itlSeconds": 1}}}},
            "must not exceed maxReplicas",
        ),
        ({"networkPolicy": {"metricsFrom": [{}]}}, "either ipBlock alone"),
        (
            {"networkPolicy": {"metricsFrom": [{"ipBlock": {"cidr": "10.0.0.0/8"}, "podSelector": {}}]}},
            "either ipBlock alone",
        ),
    ],
)
def test_cel_rules_reject_cross_field_mistakes(spec: dict, why: str) -> None:
    body = example()
    body["spec"].update(spec)
    with pytest.raises(jsonschema.ValidationError, match=why):
        admit(body)


@pytest.mark.parametrize(
    "spec",
    [
        {"decode": {"tensorParallel": 2, "gpus": 2}},
        {"decode": {"tensorParallel": 2}},  # gpus derived: 2 per pod
        {"decode": {"tensorParallel": 2, "gpus": 0}},  # CPU trials ignore the GPU count
        {"decode": {"tensorParallel": 8, "nodesPerReplica": 2, "gpus": 4}},
        {"decode": {"tensorParallel": 8, "nodesPerReplica": 8}},  # one rank per host
        {"decode": {"tensorParallel": 4, "nodesPerReplica": 2, "gpus": 0}},  # gloo across CPU hosts
        {  # an autoscaled LeaderWorkerSet pool: the HPA scales whole groups
            "decode": {
                "tensorParallel": 4,
                "nodesPerReplica": 2,
                "autoscaling": {"maxReplicas": 4, "targets": {"waitingRequests": 8}},
            }
        },
        {"prefill": {"tensorParallel": 2}, "decode": {"tensorParallel": 4}},  # the KV handoff re-shards
        {"prefill": {"kvCacheFormat": "fp8_e4m3"}, "decode": {"kvCacheFormat": "fp8_e4m3"}},
        {"prefill": {"kvCacheFormat": "int8"}, "decode": {"kvCacheFormat": "int8"}},
        {"decode": {"kvCacheFormat": "fp8_e4m3"}},  # bf16 prefill pages hand off to any decode format
        {"prefill": {"replicas": 0}, "decode": {"replicas": 0}},  # paused
        {  # an autoscaled pool's replicas field is not what counts
            "prefill": {"replicas": 0, "autoscaling": {"maxReplicas": 2, "targets": {"waitingRequests": 4}}},
            "decode": {"autoscaling": {"maxReplicas": 8, "targets": {"kvCacheUsage": 0.8}}},
        },
        {"networkPolicy": {"metricsFrom": [{"namespaceSelector": {}}]}},  # every pod of every namespace
        {
            "networkPolicy": {
                "metricsFrom": [
                    {"namespaceSelector": {"matchLabels": {"team": "obs"}}, "podSelector": {}},
                    {"ipBlock": {"cidr": "10.0.0.0/8", "except": ["10.1.0.0/16"]}},
                ]
            }
        },
    ],
)
def test_cel_rules_accept_sensible_specs(spec: dict) -> None:
    body = example()
    body["spec"].update(spec)
    admit(body)


def test_every_cel_rule_is_evaluated_somewhere(crd: dict) -> None:
    """Guard against a rule that is never parsed: each must compile and run on the defaults."""
    from op_schema import cel_errors

    schema = md_schema(crd)
    rules = str(schema).count("'rule':")
    assert rules == 27
    assert cel_errors(schema, admit(example())) == []
    gated = {"rollout": {"qualityGate": {"probeSet": "my-probes", "probeInterval": 300}}}
    assert cel_errors(schema, admit(example(**gated))) == []  # the quality gate's rules ran
    auto = {"autoscaling": {"maxReplicas": 2, "targets": {"ttftSeconds": 2}}}
    assert cel_errors(schema, admit(example(decode=auto, prefill=auto))) == []  # autoscaling rules ran
    peers = {"networkPolicy": {"metricsFrom": [{"podSelector": {}}]}}
    assert cel_errors(schema, admit(example(**peers))) == []  # the peer rule ran and passed


def test_gpus_are_derived_per_pod_unless_given() -> None:
    """Absent gpus: one per rank each pod runs; 0 keeps a CPU pool; the defaults stay one GPU."""
    parse = spec_mod.parse
    assert parse(admit(example())["spec"]).decode.gpus == 1
    single = parse(admit(example(decode={"tensorParallel": 4}))["spec"]).decode
    assert (single.gpus, single.nodes_per_replica, single.multi_node) == (4, 1, False)
    multi = parse(admit(example(decode={"tensorParallel": 8, "nodesPerReplica": 2}))["spec"]).decode
    assert (multi.gpus, multi.ranks_per_pod, multi.multi_node) == (4, 4, True)
    assert parse(admit(example(decode={"tensorParallel": 2, "gpus": 0}))["spec"]).decode.gpus == 0


def test_credential_and_network_defaults() -> None:
    spec = admit(example(auth={"apiKeysSecret": {"name": "team-keys"}}))["spec"]
    assert spec["auth"] == {"apiKeysSecret": {"name": "team-keys", "key": "api-keys"}}
    assert spec["routing"]["trustTenantHeader"] is False
    assert spec["networkPolicy"] == {"enabled": True}
    parsed = spec_mod.parse(spec)
    assert parsed.auth.api_keys_secret == spec_mod.SecretRef("team-keys", "api-keys")
    assert parsed.network_policy == spec_mod.NetworkPolicy(enabled=True, metrics_from=())
    assert spec_mod.parse(admit(example())["spec"]).auth.api_keys_secret is None


def test_printer_columns_are_defined_and_documented(crd: dict) -> None:
    columns = crd["spec"]["versions"][0]["additionalPrinterColumns"]
    names = [c["name"] for c in columns]
    assert names == ["Ready", "Prefill", "Decode", "Decode formats", "Mismatch rate", "Tokens/s", "Age"]
    docs = (ROOT / "docs" / "operator.md").read_text()  # the CRD reference lives there
    for column in columns:
        assert f"`{column['name']}`" in docs and f"`{column['jsonPath']}`" in docs


def _weight_format_schemas(path: pathlib.Path) -> dict[str, dict]:
    crd = yaml.safe_load(path.read_text())
    props = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
    return {pool: props[pool]["properties"]["weightFormat"] for pool in ("prefill", "decode")}


def test_weight_formats_default_to_auto_in_both_crd_copies() -> None:
    from pagoda.vocabulary import PHASE_DEFAULTS, WEIGHT_FORMAT_CHOICES

    ours, chart = (
        _weight_format_schemas(CRD_PATH),
        _weight_format_schemas(CHART / "crds" / "modeldeployment.yaml"),
    )
    assert ours == chart
    for pool, schema in ours.items():
        assert schema["enum"] == list(WEIGHT_FORMAT_CHOICES) and schema["default"] == "auto"
        # the description says what auto becomes: stored, else the phase default
        text = schema["description"]
        assert "auto (the default)" in text and "stored for a checkpoint released pre-quantized" in text
        assert f"else {PHASE_DEFAULTS[pool]['weights']} " in text


@pytest.mark.parametrize("fmt", ["stored", "auto"])
def test_stored_and_auto_weight_formats_are_accepted_in_both_pools(fmt: str) -> None:
    body = example()
    body["spec"]["prefill"] = {**body["spec"].get("prefill", {}), "weightFormat": fmt}
    body["spec"]["decode"] = {**body["spec"].get("decode", {}), "weightFormat": fmt}
    stored = admit(body)
    assert stored["spec"]["prefill"]["weightFormat"] == stored["spec"]["decode"]["weightFormat"] == fmt


def test_an_object_written_under_the_old_defaults_keeps_its_formats() -> None:
    """CRD defaults fill absent fields when an object is written (and read): one written under the
    fp8 / int4 defaults holds those values, so the auto default changes none of its pods."""
    from pagoda.operator import children

    old = load_crd()
    for pool, fmt in (("prefill", "fp8"), ("decode", "int4")):
        md_schema(old)["properties"]["spec"]["properties"][pool]["properties"]["weightFormat"]["default"] = (
            fmt
        )
    written = admit(example(), old)  # persisted by the API server before the upgrade
    read = admit(written)  # the same object under the new CRD
    assert (read["spec"]["prefill"]["weightFormat"], read["spec"]["decode"]["weightFormat"]) == (
        "fp8",
        "int4",
    )
    before, after = spec_mod.parse(written["spec"]), spec_mod.parse(read["spec"])
    assert children.formats_generation(after) == children.formats_generation(before)
    assert children.agent_args(after, "decode") == children.agent_args(before, "decode")
    fresh = spec_mod.parse(admit(example())["spec"])  # a new object gets auto: another generation
    assert children.formats_generation(fresh) != children.formats_generation(before)

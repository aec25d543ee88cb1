"""Pod Security "restricted" for every pod the operator renders and the chart's operator pod; the
PodSpec overlay; the startup budget; the agents' admission policy evaluated with cel-python."""

from __future__ import annotations

import copy

import celpy
import helm_python
import kubernetes_validate
import pytest
import yaml
from op_schema import CHART, admit, example
from pss import violations

from pagoda.operator import children
from pagoda.operator.config import Config
from pagoda.operator.spec import parse

META = {"name": "m", "namespace": "ns", "uid": "u-1"}
SPECS = [
    {},
    {"prefill": {"gpus": 0}, "decode": {"gpus": 0}},
    {"model": {"source": "pvc://models/llama"}, "auth": {"apiKeysSecret": {"name": "keys"}}},
    {"decode": {"podTemplate": {"spec": {"securityContext": {"runAsUser": 1001, "fsGroup": 2000}}}}},
]


def build(cfg: Config | None = None, **spec: object) -> dict:
    return children.build(META, parse(admit(example("m", **spec))["spec"]), cfg or Config())


def pod(objs: dict, role: str) -> dict:
    return objs[f"Deployment/m-{role}"]["spec"]["template"]


@pytest.mark.parametrize("spec", SPECS)
def test_every_rendered_pod_is_restricted(spec: dict) -> None:
    objs = build(**spec)
    for role in ("prefill", "decode", "router"):
        template = pod(objs, role)["spec"]
        assert violations(template) == [], role
        assert "runAsUser" not in template["securityContext"] or spec  # no fixed uid unless set


def test_the_chart_operator_pod_is_restricted() -> None:
    chart = helm_python.Chart.load(str(CHART))
    docs = [
        d
        for path, text in chart.render({}, name="pagoda", namespace="ns").items()
        if path.endswith(".yaml")
        for d in yaml.safe_load_all(text)
        if d
    ]
    dep = next(d for d in docs if d["kind"] == "Deployment")
    assert violations(dep["spec"]["template"]["spec"]) == []
    assert "runAsUser" not in dep["spec"]["template"]["spec"]["securityContext"]  # OpenShift assigns one


@pytest.mark.parametrize(
    ("change", "rule"),
    [
        (lambda s: s.update(hostNetwork=True), "hostNetwork"),
        (lambda s: s["volumes"].append({"name": "h", "hostPath": {"path": "/"}}), "hostPath"),
        (lambda s: s["containers"][0]["securityContext"].update(privileged=True), "privileged"),
        (
            lambda s: s["containers"][0]["securityContext"].pop("allowPrivilegeEscalation"),
            "allowPrivilegeEscalation",
        ),
        (lambda s: s["containers"][0]["securityContext"].update(capabilities={"drop": []}), "drop ALL"),
        (
            lambda s: s["containers"][0]["securityContext"].update(
                capabilities={"drop": ["ALL"], "add": ["SYS_ADMIN"]}
            ),
            "add",
        ),
        (lambda s: s["securityContext"].pop("seccompProfile"), "seccompProfile"),
        (lambda s: s["securityContext"].update(seccompProfile={"type": "Unconfined"}), "seccompProfile"),
        (lambda s: s["securityContext"].pop("runAsNonRoot"), "runAsNonRoot"),
        (lambda s: s["securityContext"].update(runAsUser=0), "runAsUser is 0"),
        (lambda s: s["containers"][0]["ports"][0].update(hostPort=80), "hostPort"),
    ],
)
def test_the_checker_catches_each_rule(change, rule: str) -> None:
    spec = copy.deepcopy(pod(build(), "router")["spec"])
    spec.setdefault("volumes", [])
    change(spec)
    assert any(rule in v for v in violations(spec)), violations(spec)


def test_the_overlay_merges_into_the_pod_template() -> None:
    overlay = {
        "metadata": {"labels": {"team": "ml", "pagoda.dev/pool": "hijack"}, "annotations": {"a": "b"}},
        "spec": {
            "priorityClassName": "llm-serving",
            "tolerations": [{"key": "spot", "operator": "Exists"}],
            "imagePullSecrets": [{"name": "registry"}],
            "volumes": [{"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "8Gi"}}],
            "containers": [
                {
                    "name": "agent",
                    "env": [
                        {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}}
                    ],
                    "envFrom": [{"secretRef": {"name": "extra"}}],
                    "volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"}],
                }
            ],
            "securityContext": {"runAsUser": 1001, "fsGroup": 2000},
        },
    }
    objs = build(model={"source": "pvc://models/x"}, decode={"gpus": 0, "podTemplate": overlay})
    template = pod(objs, "decode")
    spec = template["spec"]
    assert template["metadata"]["labels"]["team"] == "ml"
    assert template["metadata"]["labels"]["pagoda.dev/pool"] == "decode"  # selector labels stay ours
    assert (
        template["metadata"]["annotations"]["a"] == "b"
        and "pagoda.dev/handoff" in template["metadata"]["annotations"]
    )
    assert spec["priorityClassName"] == "llm-serving" and spec["imagePullSecrets"] == [{"name": "registry"}]
    assert spec["tolerations"] == [
        {"key": "spot", "operator": "Exists"}
    ]  # lists other than named ones replace
    assert [v["name"] for v in spec["volumes"]] == ["model", "dshm"]
    (agent,) = spec["containers"]
    env = {e["name"] for e in agent["env"]}
    assert {"HF_TOKEN", "PAGODA_MD_NAME", "PAGODA_INTERNAL_TOKEN"} <= env  # merged by name
    assert agent["envFrom"] == [{"secretRef": {"name": "extra"}}]
    assert [m["mountPath"] for m in agent["volumeMounts"]] == ["/mnt/models", "/dev/shm"]
    assert agent["args"][:3] == ["serve", "--role", "decode"]
    assert spec["securityContext"] == {
        "runAsNonRoot": True,
        "seccompProfile": {"type": "RuntimeDefault"},
        "runAsUser": 1001,
        "fsGroup": 2000,
    }
    assert violations(spec) == []
    kubernetes_validate.validate(objs["Deployment/m-decode"], "1.33", strict=True)
    assert "priorityClassName" not in pod(objs, "prefill")["spec"]  # per pool


def test_an_overlay_can_break_restricted_and_the_checker_says_so() -> None:
    objs = build(decode={"podTemplate": {"spec": {"hostNetwork": True}}})
    assert violations(pod(objs, "decode")["spec"]) == ["hostNetwork is true"]


def test_the_startup_budget_is_configurable() -> None:
    objs = build(decode={"startupSeconds": 3600})
    probe = pod(objs, "decode")["spec"]["containers"][0]["startupProbe"]
    assert probe["periodSeconds"] * probe["failureThreshold"] == 3600
    default = pod(objs, "prefill")["spec"]["containers"][0]["startupProbe"]
    assert default["periodSeconds"] * default["failureThreshold"] == 900


# --- the agents' ValidatingAdmissionPolicy, evaluated as the API server would -----------------

_env = celpy.Environment()


def _policy() -> dict:
    chart = helm_python.Chart.load(str(CHART))
    docs = [
        d
        for path, text in chart.render({}, name="pagoda", namespace="ns").items()
        if path.endswith(".yaml")
        for d in yaml.safe_load_all(text)
        if d
    ]
    return next(d for d in docs if d["kind"] == "ValidatingAdmissionPolicy")


def _admitted(policy: dict, user: str, token_pod: str | None, old: dict, new: dict) -> bool:
    extra = {"authentication.kubernetes.io/pod-name": [token_pod]} if token_pod else {}
    activation = {
        "request": celpy.json_to_cel({"userInfo": {"username": user, "extra": extra}, "namespace": "ns"}),
        "object": celpy.json_to_cel(new),
        "oldObject": celpy.json_to_cel(old),
    }

    def holds(expr: str) -> bool:
        return bool(_env.program(_env.compile(expr)).evaluate(activation))

    if not all(holds(c["expression"]) for c in policy["spec"]["matchConditions"]):
        return True  # the policy does not apply
    return all(holds(v["expression"]) for v in policy["spec"]["validations"])


AGENT = "system:serviceaccount:ns:m-pagoda-agent"


def live_pod(name: str) -> dict:
    return {
        "metadata": {"name": name, "labels": {"pagoda.dev/pool": "decode"}, "annotations": {"other": "x"}},
        "spec": {"containers": [{"name": "agent", "image": "pagoda/node-agent:0.1.0"}]},
    }


def with_report(obj: dict, text: str = '{"pool":"decode"}') -> dict:
    new = copy.deepcopy(obj)
    new["metadata"]["annotations"]["pagoda.dev/agent-report"] = text
    return new


def test_an_agent_may_write_only_its_own_pods_report() -> None:
    policy = _policy()
    mine, theirs = live_pod("m-decode-1"), live_pod("web-1")
    assert _admitted(policy, AGENT, "m-decode-1", mine, with_report(mine))
    assert _admitted(policy, AGENT, "m-decode-1", with_report(mine), with_report(mine, "{}"))
    assert not _admitted(policy, AGENT, "m-decode-1", theirs, with_report(theirs))  # another pod
    assert not _admitted(policy, AGENT, None, mine, with_report(mine))  # a token not bound to a pod
    evil = with_report(mine)
    evil["spec"]["containers"][0]["image"] = "evil:1"
    assert not _admitted(policy, AGENT, "m-decode-1", mine, evil)
    relabel = with_report(mine)
    relabel["metadata"]["labels"]["pagoda.dev/pool"] = "router"
    assert not _admitted(policy, AGENT, "m-decode-1", mine, relabel)
    other = with_report(mine)
    other["metadata"]["annotations"]["other"] = "y"
    assert not _admitted(policy, AGENT, "m-decode-1", mine, other)
    dropped = with_report(mine)
    del dropped["metadata"]["annotations"]["other"]
    assert not _admitted(policy, AGENT, "m-decode-1", mine, dropped)
    # Anyone else is not concerned by this policy.
    assert _admitted(policy, "system:serviceaccount:ns:deployer", None, theirs, evil)


def test_watch_namespaces_renders_roles_not_a_cluster_role() -> None:
    chart = helm_python.Chart.load(str(CHART))
    values = {"operator": {"watchNamespaces": ["team-a", "team-b"]}}
    docs = [
        d
        for path, text in chart.render(values, name="pagoda", namespace="ns").items()
        if path.endswith(".yaml")
        for d in yaml.safe_load_all(text)
        if d
    ]
    roles = [
        (d["kind"], d["metadata"]["name"], d["metadata"].get("namespace"))
        for d in docs
        if "Role" in d["kind"]
    ]
    assert ("Role", "pagoda-operator", "team-a") in roles and (
        "RoleBinding",
        "pagoda-operator",
        "team-b",
    ) in roles
    assert ("ClusterRole", "pagoda-operator", None) not in roles
    cluster_roles = {name for kind, name, _ in roles if kind == "ClusterRole"}
    assert cluster_roles == {  # the CRD is cluster-scoped; the aggregated roles are for users
        "pagoda-agent",
        "pagoda-operator-crd",
        "pagoda-modeldeployments-edit",
        "pagoda-modeldeployments-view",
    }
    role = next(d for d in docs if d["kind"] == "Role")
    assert {r for rule in role["rules"] for r in rule["resources"]} >= {
        "modeldeployments",
        "deployments",
        "leaderworkersets",
        "pods",
    }
    assert "namespaces" not in str(role["rules"])
    for doc in docs:
        kubernetes_validate.validate(doc, "1.33", strict=True)

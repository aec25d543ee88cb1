"""Uninstall: a ModelDeployment deletes without the operator (no finalizer), and the CRD the
operator applies at start only ever moves forward."""

from __future__ import annotations

import asyncio
import copy

from fake_kube import FakeKube
from op_cluster import MD_PATH, Cluster
from op_schema import admit, example

from pagoda.operator import crd as crd_mod
from pagoda.operator.schema import load_crd

NS = "default"
MD = MD_PATH.format(ns=NS) + "/smollm"
CPU = {"prefill": {"gpus": 0}, "decode": {"gpus": 0}}
CRD_AT = crd_mod.CRD_PATH.format(name="modeldeployments.pagoda.dev")
LEGACY_FINALIZER = "pagoda.dev/operator"


def create_md(cluster: Cluster, finalizers: list[str] | None = None) -> dict:
    stored = admit(example(**CPU))
    stored["metadata"].update(uid="uid-1", generation=1, resourceVersion="1")
    if finalizers:
        stored["metadata"]["finalizers"] = finalizers
    return cluster.create(MD_PATH.format(ns=NS), stored)


def router_dep(cluster: Cluster) -> dict | None:
    return cluster.get(f"/apis/apps/v1/namespaces/{NS}/deployments/smollm-router")


def test_a_modeldeployment_deletes_with_no_operator_running(cluster: Cluster) -> None:
    create_md(cluster)
    cluster.wait_for(lambda: router_dep(cluster), what="children")
    md = cluster.get(MD)
    assert not md["metadata"].get("finalizers"), "the operator must not block deletion"
    owners = router_dep(cluster)["metadata"]["ownerReferences"]
    assert [o["uid"] for o in owners] == [md["metadata"]["uid"]]  # the garbage collector's link
    cluster.stop_operator()
    cluster.delete(MD)
    cluster.wait_for(lambda: cluster.get(MD) is None, timeout=5, what="deleted without the operator")


def test_an_older_operators_finalizer_is_removed(cluster: Cluster) -> None:
    """Objects marked by an operator that still added a finalizer lose it on the first pass."""
    create_md(cluster, finalizers=[LEGACY_FINALIZER])
    cluster.wait_for(lambda: router_dep(cluster), what="children")
    cluster.wait_for(lambda: not cluster.get(MD)["metadata"].get("finalizers"), what="finalizer dropped")
    cluster.stop_operator()
    cluster.delete(MD)
    cluster.wait_for(lambda: cluster.get(MD) is None, timeout=5, what="deleted without the operator")


def with_revision(crd: dict, value: str | None) -> dict:
    out = copy.deepcopy(crd)
    annotations = out["metadata"].setdefault("annotations", {})
    if value is None:
        annotations.pop(crd_mod.REVISION_ANNOTATION, None)
    else:
        annotations[crd_mod.REVISION_ANNOTATION] = value
    return out


def test_the_shipped_crd_carries_a_revision() -> None:
    assert isinstance(crd_mod.revision(load_crd()), int)


def test_the_crd_is_applied_when_absent_older_or_equal() -> None:
    ours = load_crd()
    rev = crd_mod.revision(ours)
    assert rev is not None
    for stored in (None, with_revision(ours, None), with_revision(ours, str(rev - 1)), ours):
        kube = FakeKube()
        if stored is not None:
            kube.paths[CRD_AT] = stored
        assert asyncio.run(crd_mod.install(kube)) is None  # type: ignore[arg-type]
        assert [w[0] for w in kube.writes] == ["apply"]
        assert crd_mod.revision(kube.paths[CRD_AT]) == rev


def test_a_newer_stored_crd_is_never_downgraded(caplog) -> None:
    ours = load_crd()
    rev = crd_mod.revision(ours)
    assert rev is not None
    newer = with_revision(ours, str(rev + 1))
    newer["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]["x"] = {
        "type": "string"
    }
    kube = FakeKube()
    kube.paths[CRD_AT] = newer
    with caplog.at_level("WARNING", logger="pagoda.operator"):
        why = asyncio.run(crd_mod.install(kube))  # type: ignore[arg-type]
    assert why == (
        f"the cluster's CRD modeldeployments.pagoda.dev is at revision {rev + 1}, newer than this "
        f"operator's {rev}: not downgraded"
    )
    assert kube.writes == [] and kube.paths[CRD_AT] == newer  # the newer field is kept
    assert why in caplog.text
    # An operator whose CRD has no revision at all (older than revisions) never overwrites one.
    kube = FakeKube()
    kube.paths[CRD_AT] = ours
    assert "not downgraded" in (asyncio.run(crd_mod.install(kube, with_revision(ours, None))) or "")  # type: ignore[arg-type]
    assert kube.writes == []

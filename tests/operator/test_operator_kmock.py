"""The real kopf operator against the kmock emulator."""

from __future__ import annotations

from op_cluster import DEP_PATH, MD_PATH, Cluster
from op_schema import admit, example

NS = "default"


def create_md(cluster: Cluster, body: dict) -> dict:
    stored = admit(body)
    stored["metadata"].update(uid="uid-1", generation=1, creationTimestamp="2026-11-29T12:00:00Z")
    return cluster.create(MD_PATH.format(ns=NS), stored)


def test_smoke(cluster: Cluster) -> None:
    create_md(cluster, example(prefill={"gpus": 0}, decode={"gpus": 0}))
    dep = cluster.wait_for(
        lambda: cluster.get(DEP_PATH.format(ns=NS) + "/smollm-decode"), what="decode deployment"
    )
    assert dep["spec"]["replicas"] == 1

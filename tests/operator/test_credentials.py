"""The credential checks of a pass, against a fake API: create-once, races, problems named."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from pagoda.operator import credentials
from pagoda.operator.kube import ApiError
from pagoda.operator.spec import SecretRef

META = {"name": "m", "namespace": "ns", "uid": "u-1"}
Obj = dict[str, Any]


class FakeKube:
    """Secrets by name; ``race`` makes the first create fail with 409 after someone else created it."""

    def __init__(self, secrets: dict[str, Obj] | None = None, race: Obj | None = None) -> None:
        self.secrets = dict(secrets or {})
        self.race = race
        self.calls: list[tuple[str, str]] = []

    async def get(self, kind: str, namespace: str, name: str) -> Obj | None:
        self.calls.append(("get", name))
        return self.secrets.get(name)

    async def create(self, obj: Obj) -> Obj:
        name = obj["metadata"]["name"]
        self.calls.append(("create", name))
        if self.race is not None:
            self.secrets[name], self.race = self.race, None
            raise ApiError(409, "AlreadyExists")
        self.secrets[name] = {**obj, "metadata": {**obj["metadata"], "uid": "new"}}
        return self.secrets[name]


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def test_internal_secret_is_created_when_missing_and_only_read_after() -> None:
    kube = FakeKube()
    live, action = run(credentials.ensure_internal(kube, META))  # type: ignore[arg-type]
    assert action == "created" and live["metadata"]["uid"] == "new"
    again, action = run(credentials.ensure_internal(kube, META))  # type: ignore[arg-type]
    assert action == "unchanged" and again["data"] == live["data"]
    assert kube.calls == [("get", "m-internal"), ("create", "m-internal"), ("get", "m-internal")]


def test_a_create_race_uses_the_secret_that_won() -> None:
    winner = {"metadata": {"name": "m-internal", "uid": "other"}, "data": {"internal-token": "eA=="}}
    kube = FakeKube(race=winner)
    live, action = run(credentials.ensure_internal(kube, META))  # type: ignore[arg-type]
    assert live is winner and action == "unchanged"


def test_an_internal_secret_without_its_keys_is_a_problem() -> None:
    good = credentials.internal_secret(META)
    assert credentials.internal_problem(good) is None
    broken = {**good, "data": {"internal-token": good["data"]["internal-token"]}}
    problem = credentials.internal_problem(broken)
    assert problem is not None and problem.reason == "InternalSecretInvalid"
    assert "m-internal lacks the key(s) tenant-secret" in problem.message
    assert good["data"]["internal-token"] not in problem.message


@pytest.mark.parametrize(
    ("secrets", "expect"),
    [
        ({}, "Secret ns/keys named by spec.auth.apiKeysSecret does not exist"),
        ({"keys": {"data": {"other": "eA=="}}}, "Secret ns/keys has no key 'api-keys'"),
        ({"keys": {"data": {"api-keys": "eA=="}}}, None),
    ],
)
def test_api_keys_secret_problems_name_the_secret(secrets: dict, expect: str | None) -> None:
    kube = FakeKube(secrets)
    problem = run(credentials.api_keys_problem(kube, "ns", SecretRef("keys")))  # type: ignore[arg-type]
    if expect is None:
        assert problem is None
    else:
        assert problem is not None and problem.reason == "ApiKeysSecretMissing"
        assert expect in problem.message and "eA==" not in problem.message


def test_no_api_keys_secret_configured_reads_nothing() -> None:
    kube = FakeKube()
    assert run(credentials.api_keys_problem(kube, "ns", None)) is None  # type: ignore[arg-type]
    assert kube.calls == []

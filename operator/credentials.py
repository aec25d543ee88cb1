"""The agents' credentials: the generated ``<md>-internal`` Secret and the user's API keys Secret.

The internal Secret holds random values, so it is not part of the pure ``children.build`` output:
it is created once, when it does not exist, and never patched (a reconcile pass must not see its
random data as drift, nor rotate it). The user's Secret is only looked at: does it exist, does it
hold the key. No Secret value is ever logged, copied or put into a status.
"""

from __future__ import annotations

import base64
import secrets
from typing import Any

from . import children
from .formats import Problem
from .kube import ApiError, Kube
from .spec import SecretRef

Obj = dict[str, Any]

TOKEN_BYTES = 32  # entropy of each generated value (encoded url-safe base64: 43 characters)
KEYS = (children.INTERNAL_TOKEN_KEY, children.TENANT_SECRET_KEY)


def internal_name(md_name: str) -> str:
    return children.child_name(md_name, children.INTERNAL)


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def internal_secret(meta: Obj) -> Obj:
    """A new ``<md>-internal`` Secret with fresh random values, owned and labelled like every child."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {
            "name": internal_name(meta["name"]),
            "namespace": meta["namespace"],
            "labels": children.labels(meta["name"], children.INTERNAL),
            "ownerReferences": [children.owner_reference(meta)],
        },
        "type": "Opaque",
        "data": {key: _b64(secrets.token_urlsafe(TOKEN_BYTES)) for key in KEYS},
    }


async def ensure_internal(kube: Kube, meta: Obj) -> tuple[Obj, str]:
    """The live internal Secret, created when missing; returns it and "created" or "unchanged".

    An existing Secret is used as it is, whoever created it: a pass never writes to it.
    """
    ns, name = meta["namespace"], internal_name(meta["name"])
    live = await kube.get("Secret", ns, name)
    if live is not None:
        return live, "unchanged"
    try:
        return await kube.create(internal_secret(meta)), "created"
    except ApiError as err:
        if err.status != 409:  # 409: created meanwhile (another pass); use that one
            raise
    live = await kube.get("Secret", ns, name)
    if live is None:
        raise ApiError(409, f"Secret {ns}/{name} exists and cannot be read")
    return live, "unchanged"


def internal_problem(secret: Obj) -> Problem | None:
    """Why the internal Secret cannot serve the pods (a key missing or empty), or None."""
    data = secret.get("data") or {}
    missing = [key for key in KEYS if not data.get(key)]
    if not missing:
        return None
    name = secret.get("metadata", {}).get("name", "")
    return Problem(
        "InternalSecretInvalid",
        f"Secret {name} lacks the key(s) {', '.join(missing)}, so agent pods cannot start; "
        "delete it and the operator creates a new one",
    )


async def api_keys_problem(kube: Kube, namespace: str, ref: SecretRef | None) -> Problem | None:
    """Why the router cannot read its API keys (the Secret or its key is missing), or None."""
    if ref is None:
        return None
    secret = await kube.get("Secret", namespace, ref.name)
    if secret is None:
        return Problem(
            "ApiKeysSecretMissing",
            f"Secret {namespace}/{ref.name} named by spec.auth.apiKeysSecret does not exist; "
            "the router pods cannot start until it is created",
        )
    if ref.key not in (secret.get("data") or {}):
        return Problem(
            "ApiKeysSecretMissing",
            f"Secret {namespace}/{ref.name} has no key {ref.key!r} (spec.auth.apiKeysSecret.key); "
            "the router pods cannot start until it is added",
        )
    return None

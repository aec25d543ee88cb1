"""The real kopf operator against the kmock Kubernetes emulator, in a background thread.

Tests talk to the emulator over HTTP (as kubectl would), so every write goes through the
same watch streams the operator listens to.
"""

from __future__ import annotations

import asyncio
import json
import pathlib
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import kmock
import kopf

from pagoda.operator.config import Config
from pagoda.operator.handlers import Memo, register

Obj = dict[str, Any]

VERBS = {"list", "watch", "get", "create", "patch", "update", "delete"}
RESOURCES: dict[str, dict[str, Any]] = {
    "v1/namespaces": {"kind": "Namespace", "namespaced": False},
    "v1/pods": {"kind": "Pod", "namespaced": True},
    "v1/services": {"kind": "Service", "namespaced": True},
    "v1/configmaps": {"kind": "ConfigMap", "namespaced": True},
    "v1/secrets": {"kind": "Secret", "namespaced": True},
    "v1/serviceaccounts": {"kind": "ServiceAccount", "namespaced": True},
    "v1/events": {"kind": "Event", "namespaced": True},
    "coordination.k8s.io/v1/leases": {"kind": "Lease", "namespaced": True},
    "apps/v1/deployments": {"kind": "Deployment", "namespaced": True, "subresources": {"status"}},
    "rbac.authorization.k8s.io/v1/roles": {"kind": "Role", "namespaced": True},
    "rbac.authorization.k8s.io/v1/rolebindings": {"kind": "RoleBinding", "namespaced": True},
    "networking.k8s.io/v1/networkpolicies": {"kind": "NetworkPolicy", "namespaced": True},
    "policy/v1/poddisruptionbudgets": {"kind": "PodDisruptionBudget", "namespaced": True},
    "autoscaling/v2/horizontalpodautoscalers": {"kind": "HorizontalPodAutoscaler", "namespaced": True},
    # The LeaderWorkerSet CRD (kubernetes-sigs/lws); a test removes it to play a cluster without it.
    "leaderworkerset.x-k8s.io/v1/leaderworkersets": {
        "kind": "LeaderWorkerSet",
        "namespaced": True,
        "subresources": {"status", "scale"},
    },
    # The Gateway API's HTTPRoute and the inference extension's InferencePool (spec.router.gateway).
    "gateway.networking.k8s.io/v1/httproutes": {"kind": "HTTPRoute", "namespaced": True},
    "inference.networking.k8s.io/v1/inferencepools": {"kind": "InferencePool", "namespaced": True},
    "pagoda.dev/v1alpha1/modeldeployments": {
        "kind": "ModelDeployment",
        "singular": "modeldeployment",
        "namespaced": True,
        "shortnames": {"md"},
        "subresources": {"status"},
    },
}


VERB_OF_ACTION = {"LIST": "list", "WATCH": "watch", "FETCH": "get", "CREATE": "create", "DELETE": "delete"}


@dataclass(frozen=True)
class Call:
    """One API request as RBAC sees it: verb, API group, resource[/subresource], namespace, name."""

    verb: str
    group: str
    resource: str
    namespace: str | None
    name: str | None

    @classmethod
    def of(cls, request: Any) -> Call:
        action = request.action.value if request.action is not None else ""
        if action == "UPDATE":
            verb = "patch" if str(request.method.value).upper() == "PATCH" else "update"
        else:
            verb = VERB_OF_ACTION.get(action, action.lower())
        plural = request.resource.plural + (f"/{request.subresource}" if request.subresource else "")
        return cls(verb, request.resource.group or "", plural, request.namespace, request.name)


class Emulator(kmock.KubernetesEmulator):
    """kmock plus what an API server does on create: a name from generateName (kopf's Events use
    it) and a uid (the operator stamps the internal Secret's uid into the pod templates)."""

    _serial: int = 0

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        self.calls: list[Call] = []

    async def _handle(self, request: Any) -> Any:
        if getattr(request.resource, "plural", None) and request.headers.get("Authorization"):
            self.calls.append(Call.of(request))  # the operator's requests (the tests send no token)
        data = request.data if request.action == kmock.action.CREATE else None
        meta = data.get("metadata") if isinstance(data, dict) else None
        if isinstance(meta, dict):
            Emulator._serial += 1
            if meta.get("generateName") and not meta.get("name"):
                meta["name"] = f"{meta['generateName']}{Emulator._serial:05d}"
            meta.setdefault("uid", f"uid-{Emulator._serial:05d}")
        return await super()._handle(request)


class Cluster:
    """A kmock API server plus a running operator; HTTP helpers for the test thread."""

    def __init__(self, cfg: Config, kubeconfig: pathlib.Path, without: tuple[str, ...] = ()) -> None:
        self.cfg = cfg
        self.without = without  # keys of RESOURCES the emulated cluster does not serve
        self.kubeconfig = kubeconfig
        self.url = ""
        self._started = threading.Event()
        self._ready = threading.Event()
        self._stop = threading.Event()  # stops the operator
        self._shutdown = threading.Event()  # then the emulator
        self._operator_done = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="kopf-kmock", daemon=True)

    def start(self, timeout: float = 30) -> None:
        self._thread.start()
        if not self._ready.wait(timeout):
            raise RuntimeError(f"operator did not get ready: {self._error!r}")

    def stop(self) -> None:
        self._stop.set()
        self._shutdown.set()
        self._thread.join(timeout=20)

    def stop_operator(self, timeout: float = 20) -> None:
        """Stop the operator and keep the API emulator serving (a cluster after uninstall)."""
        self._stop.set()
        if not self._operator_done.wait(timeout):
            raise RuntimeError("the operator did not stop")

    def _run(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as err:  # surfaced by start()/assertions
            self._error = err
            self._ready.set()

    async def _main(self) -> None:
        async with Emulator() as emulator, kmock.Server(emulator) as server:
            for key, info in RESOURCES.items():
                if key not in self.without:
                    emulator.resources[key] = kmock.ResourceInfo(verbs=VERBS, **info)
            self.emulator = emulator
            self.url = str(server.url).rstrip("/")
            self.kubeconfig.write_text(
                json.dumps(
                    {
                        "apiVersion": "v1",
                        "kind": "Config",
                        "clusters": [{"name": "kmock", "cluster": {"server": self.url}}],
                        "users": [{"name": "test", "user": {"token": "test"}}],
                        "contexts": [{"name": "kmock", "context": {"cluster": "kmock", "user": "test"}}],
                        "current-context": "kmock",
                    }
                )
            )
            self._started.set()
            settings = kopf.OperatorSettings()
            settings.queueing.exit_timeout = 0.2
            settings.queueing.idle_timeout = 0.5
            settings.background.instant_exit_timeout = 0.05
            settings.persistence.consistency_timeout = 0.5  # kmock keeps resourceVersion as created
            await kopf.operator(
                registry=register(kopf.OperatorRegistry(), self.cfg),
                settings=settings,
                memo=Memo(cfg=self.cfg),
                standalone=True,
                clusterwide=True,
                stop_flag=self._stop,
                ready_flag=self._ready,
            )
            self._operator_done.set()
            while not self._shutdown.is_set():
                await asyncio.sleep(0.05)

    # --- a tiny synchronous API client for the test thread -------------------------------

    def request(
        self, method: str, path: str, body: Any = None, content_type: str = "application/json"
    ) -> Any:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.url + path, data=data, method=method)
        if data is not None:
            req.add_header("Content-Type", content_type)
        try:
            with urllib.request.urlopen(req, timeout=10) as resp:
                text = resp.read()
        except urllib.error.HTTPError as err:
            if err.code == 404 and method == "GET":
                return None
            raise
        return json.loads(text) if text else None

    def get(self, path: str) -> Obj | None:
        return self.request("GET", path)

    def create(self, path: str, obj: Obj) -> Obj:
        return self.request("POST", path, obj)

    def patch(self, path: str, patch: Obj) -> Obj:
        return self.request("PATCH", path, patch, "application/merge-patch+json")

    def delete(self, path: str) -> Any:
        return self.request("DELETE", path)

    def wait_for(self, check: Callable[[], Any], timeout: float = 15, what: str = "condition") -> Any:
        """Poll until ``check()`` returns a truthy value; fail with the last value otherwise."""
        deadline = time.monotonic() + timeout
        last: Any = None
        while time.monotonic() < deadline:
            if self._error is not None:
                raise RuntimeError(f"operator thread died: {self._error!r}")
            try:
                last = check()
            except (KeyError, TypeError, IndexError) as err:
                last = err
            else:
                if last:
                    return last
            time.sleep(0.1)
        raise AssertionError(f"timed out waiting for {what}; last: {last!r}")


MD_PATH = "/apis/pagoda.dev/v1alpha1/namespaces/{ns}/modeldeployments"
DEP_PATH = "/apis/apps/v1/namespaces/{ns}/deployments"
SVC_PATH = "/api/v1/namespaces/{ns}/services"
CM_PATH = "/api/v1/namespaces/{ns}/configmaps"
SECRET_PATH = "/api/v1/namespaces/{ns}/secrets"
NETPOL_PATH = "/apis/networking.k8s.io/v1/namespaces/{ns}/networkpolicies"
POD_PATH = "/api/v1/namespaces/{ns}/pods"
EVENT_PATH = "/api/v1/namespaces/{ns}/events"
PDB_PATH = "/apis/policy/v1/namespaces/{ns}/poddisruptionbudgets"
HPA_PATH = "/apis/autoscaling/v2/namespaces/{ns}/horizontalpodautoscalers"
LWS_PATH = "/apis/leaderworkerset.x-k8s.io/v1/namespaces/{ns}/leaderworkersets"
LWS_RESOURCE = "leaderworkerset.x-k8s.io/v1/leaderworkersets"

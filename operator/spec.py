"""The ModelDeployment spec as typed values, with the CRD's defaults filled in."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pagoda.vocabulary import PHASE_DEFAULTS, PHASES

GROUP = "pagoda.dev"
VERSION = "v1alpha1"
PLURAL = "modeldeployments"
KIND = "ModelDeployment"
API_VERSION = f"{GROUP}/{VERSION}"

POOLS = PHASES  # one engine pool per phase


@dataclass(frozen=True)
class Pool:
    """One engine pool (prefill or decode)."""

    replicas: int = 1
    weight_format: str = "fp8"
    kv_cache_format: str = "bf16"
    tensor_parallel: int = 1
    gpus: int = 1
    max_concurrency: int = 64
    kv_memory_fraction: float = 0.9
    resources: dict[str, Any] = field(default_factory=dict)
    node_selector: dict[str, str] = field(default_factory=dict)
    tolerations: list[dict[str, Any]] = field(default_factory=list)
    affinity: dict[str, Any] = field(default_factory=dict)

    @property
    def uses_fp8(self) -> bool:
        """True when either format of this pool is an FP8 one."""
        return self.weight_format == "fp8" or self.kv_cache_format == "fp8_e4m3"


POOL_DEFAULTS = {
    pool: {"weight_format": d["weights"], "kv_cache_format": d["kv"]} for pool, d in PHASE_DEFAULTS.items()
}


@dataclass(frozen=True)
class Integrity:
    mode: str = "enforce"
    mismatch_rate_threshold: float = 0.0001
    window_seconds: int = 300


@dataclass(frozen=True)
class Routing:
    session_affinity: bool = True
    prefix_caching: bool = True
    tenant_header: str = "X-Pagoda-Tenant"
    trust_tenant_header: bool = False


@dataclass(frozen=True)
class SecretRef:
    """A key of a user-provided Secret in the ModelDeployment's namespace."""

    name: str
    key: str = "api-keys"


@dataclass(frozen=True)
class Auth:
    """Credentials of the public API: the router reads its API keys from ``api_keys_secret``."""

    api_keys_secret: SecretRef | None = None


@dataclass(frozen=True)
class NetworkPolicy:
    """Ingress fences around the pools; ``metrics_from`` peers may scrape the pools' http port."""

    enabled: bool = True
    metrics_from: tuple[dict[str, Any], ...] = ()


@dataclass(frozen=True)
class Router:
    replicas: int = 1
    service_type: str = "ClusterIP"
    port: int = 8000


@dataclass(frozen=True)
class Spec:
    """A whole ModelDeployment spec."""

    source: str
    architecture: str | None = None
    image: str = "pagoda/node-agent:0.1.0"
    image_pull_policy: str = "IfNotPresent"
    prefill: Pool = field(default_factory=lambda: Pool(**POOL_DEFAULTS["prefill"]))
    decode: Pool = field(default_factory=lambda: Pool(**POOL_DEFAULTS["decode"]))
    integrity: Integrity = field(default_factory=Integrity)
    routing: Routing = field(default_factory=Routing)
    router: Router = field(default_factory=Router)
    auth: Auth = field(default_factory=Auth)
    network_policy: NetworkPolicy = field(default_factory=NetworkPolicy)

    def pool(self, name: str) -> Pool:
        """The prefill or decode pool by name."""
        return self.prefill if name == "prefill" else self.decode

    @property
    def handoff(self) -> str:
        """The KV handoff between the pools, e.g. ``bf16->fp8_e4m3``."""
        return f"{self.prefill.kv_cache_format}->{self.decode.kv_cache_format}"


def _pool(raw: dict[str, Any] | None, name: str) -> Pool:
    raw = raw or {}
    d = Pool(**POOL_DEFAULTS[name])
    return Pool(
        replicas=int(raw.get("replicas", d.replicas)),
        weight_format=str(raw.get("weightFormat", d.weight_format)),
        kv_cache_format=str(raw.get("kvCacheFormat", d.kv_cache_format)),
        tensor_parallel=int(raw.get("tensorParallel", d.tensor_parallel)),
        gpus=int(raw.get("gpus", d.gpus)),
        max_concurrency=int(raw.get("maxConcurrency", d.max_concurrency)),
        kv_memory_fraction=float(raw.get("kvMemoryFraction", d.kv_memory_fraction)),
        resources=dict(raw.get("resources") or {}),
        node_selector=dict(raw.get("nodeSelector") or {}),
        tolerations=list(raw.get("tolerations") or []),
        affinity=dict(raw.get("affinity") or {}),
    )


def _auth(raw: dict[str, Any] | None) -> Auth:
    ref = (raw or {}).get("apiKeysSecret") or {}
    if not ref.get("name"):
        return Auth()
    return Auth(SecretRef(name=str(ref["name"]), key=str(ref.get("key") or SecretRef.key)))


def _network_policy(raw: dict[str, Any] | None) -> NetworkPolicy:
    raw = raw or {}
    return NetworkPolicy(
        enabled=bool(raw.get("enabled", NetworkPolicy.enabled)),
        metrics_from=tuple(dict(p) for p in raw.get("metricsFrom") or []),
    )


def parse(raw: dict[str, Any]) -> Spec:
    """Read a spec dict (as stored in the cluster) into a Spec with defaults applied."""
    model = raw.get("model") or {}
    integ = raw.get("integrity") or {}
    routing = raw.get("routing") or {}
    router = raw.get("router") or {}
    di, dr, dt = Integrity(), Routing(), Router()
    return Spec(
        source=str(model.get("source", "")),
        architecture=model.get("architecture") or None,
        image=str(raw.get("image", Spec.image)),
        image_pull_policy=str(raw.get("imagePullPolicy", Spec.image_pull_policy)),
        prefill=_pool(raw.get("prefill"), "prefill"),
        decode=_pool(raw.get("decode"), "decode"),
        integrity=Integrity(
            mode=str(integ.get("mode", di.mode)),
            mismatch_rate_threshold=float(integ.get("mismatchRateThreshold", di.mismatch_rate_threshold)),
            window_seconds=int(integ.get("windowSeconds", di.window_seconds)),
        ),
        routing=Routing(
            session_affinity=bool(routing.get("sessionAffinity", dr.session_affinity)),
            prefix_caching=bool(routing.get("prefixCaching", dr.prefix_caching)),
            tenant_header=str(routing.get("tenantHeader", dr.tenant_header)),
            trust_tenant_header=bool(routing.get("trustTenantHeader", dr.trust_tenant_header)),
        ),
        router=Router(
            replicas=int(router.get("replicas", dt.replicas)),
            service_type=str(router.get("serviceType", dt.service_type)),
            port=int(router.get("port", dt.port)),
        ),
        auth=_auth(raw.get("auth")),
        network_policy=_network_policy(raw.get("networkPolicy")),
    )

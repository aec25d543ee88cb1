"""The ModelDeployment spec as typed values, with the CRD's defaults filled in."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pagoda.vocabulary import PHASE_DEFAULTS, PHASES, SOURCE_DEFAULT

GROUP = "pagoda.dev"
VERSION = "v1alpha1"
PLURAL = "modeldeployments"
KIND = "ModelDeployment"
API_VERSION = f"{GROUP}/{VERSION}"

POOLS = PHASES  # one engine pool per phase


IntOrPercent = int | str  # a count of pods or "N%"


@dataclass(frozen=True)
class Drain:
    """Graceful stop of a pod: endpoints propagate during ``pre_stop_s``, then the server drains
    in-flight requests for at most ``timeout_s`` after SIGTERM."""

    timeout_s: int = 30
    pre_stop_s: int = 5

    @property
    def grace_s(self) -> int:
        """terminationGracePeriodSeconds: preStop, then the drain, then 10 s to exit."""
        return self.pre_stop_s + self.timeout_s + 10


@dataclass(frozen=True)
class RollingUpdate:
    max_surge: IntOrPercent = 1
    max_unavailable: IntOrPercent = 0


@dataclass(frozen=True)
class DisruptionBudget:
    """PodDisruptionBudget of a pool: at most ``max_unavailable`` pods evicted at once."""

    enabled: bool = True
    max_unavailable: IntOrPercent = 1


@dataclass(frozen=True)
class Targets:
    """Per-pod autoscaling targets on the metrics the agents export (None: not a target)."""

    waiting_requests: float | None = None  # pagoda_waiting_sequences, average per pod
    kv_cache_usage: float | None = None  # kv used / capacity tokens, 0-1
    ttft_seconds: float | None = None  # p90 time to first token
    itl_seconds: float | None = None  # p90 inter-token latency

    def items(self) -> list[tuple[str, float]]:
        """The set targets as (name, value), in a fixed order."""
        names = ("waiting_requests", "kv_cache_usage", "ttft_seconds", "itl_seconds")
        return [(n, float(getattr(self, n))) for n in names if getattr(self, n) is not None]


@dataclass(frozen=True)
class Autoscaling:
    """An autoscaled pool: the HPA (or KEDA) owns the replicas between the bounds."""

    min_replicas: int = 1
    max_replicas: int = 1
    targets: Targets = field(default_factory=Targets)


@dataclass(frozen=True)
class Pool:
    """One engine pool (prefill or decode)."""

    replicas: int = 1
    weight_format: str = SOURCE_DEFAULT  # auto: the engine picks per source (CRD description)
    kv_cache_format: str = "bf16"
    tensor_parallel: int = 1
    gpus: int = 1  # per pod: 0 is a CPU pool, else the pod's ranks (tensor_parallel / nodes_per_replica)
    nodes_per_replica: int = 1
    max_concurrency: int = 64
    max_queue_time_s: float | None = None  # None: no queue deadline on this pool's workers
    kv_memory_fraction: float = 0.9
    resources: dict[str, Any] = field(default_factory=dict)
    node_selector: dict[str, str] = field(default_factory=dict)
    tolerations: list[dict[str, Any]] = field(default_factory=list)
    affinity: dict[str, Any] = field(default_factory=dict)
    autoscaling: Autoscaling | None = None
    drain: Drain = field(default_factory=Drain)
    rolling_update: RollingUpdate = field(default_factory=RollingUpdate)
    disruption_budget: DisruptionBudget = field(default_factory=DisruptionBudget)
    startup_s: int = 900
    pod_template: dict[str, Any] = field(default_factory=dict)
    # What ``auto`` weights resolve to on a source not released quantized (PHASE_DEFAULTS); on a
    # pre-quantized one they resolve to ``stored``. Fixed per pool, not read from the spec.
    auto_weight_format: str = PHASE_DEFAULTS["prefill"]["weights"]

    @property
    def multi_node(self) -> bool:
        """True when one replica spans several pods (a LeaderWorkerSet group)."""
        return self.nodes_per_replica > 1

    @property
    def ranks_per_pod(self) -> int:
        """Tensor-parallel ranks each pod of a replica runs (a whole number when the spec is valid)."""
        return max(1, self.tensor_parallel // max(1, self.nodes_per_replica))

    @property
    def uses_fp8(self) -> bool:
        """True when either format of this pool is (or may be) an FP8 one: ``auto`` weights count as
        what they resolve to on a dense source (fp8 for prefill), the operator not reading the source."""
        weights = self.auto_weight_format if self.weight_format == SOURCE_DEFAULT else self.weight_format
        return weights == "fp8" or self.kv_cache_format == "fp8_e4m3"


POOL_DEFAULTS = {
    pool: {"weight_format": SOURCE_DEFAULT, "kv_cache_format": d["kv"], "auto_weight_format": d["weights"]}
    for pool, d in PHASE_DEFAULTS.items()
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
class Gateway:
    """``spec.router.gateway``: a Gateway API inference extension front (InferencePool + HTTPRoute)."""

    parent_refs: tuple[dict[str, Any], ...] = ()
    hostnames: tuple[str, ...] = ()
    endpoint_picker: str = ""  # the endpoint picker's Service
    endpoint_picker_port: int = 9002
    failure_mode: str = "FailClose"


@dataclass(frozen=True)
class Router:
    replicas: int = 1
    service_type: str = "ClusterIP"
    port: int = 8000
    drain: Drain = field(default_factory=Drain)
    rolling_update: RollingUpdate = field(default_factory=RollingUpdate)
    disruption_budget: DisruptionBudget = field(default_factory=DisruptionBudget)
    pod_template: dict[str, Any] = field(default_factory=dict)
    gateway: Gateway | None = None


@dataclass(frozen=True)
class QualityGate:
    """``spec.rollout.qualityGate``: the probe set scored through the new pair and the serving one
    before traffic moves (opt-in: absent, or ``enabled: false``, shifts on readiness alone)."""

    enabled: bool = True
    max_kl: float = 0.02
    min_top1: float = 0.9
    min_greedy_agreement: float = 0.5
    timeout_s: int = 600
    probe_set: str | None = None  # a ConfigMap with probes.json; None: the built-in set
    probe_interval_s: int = 0  # continuous probes on the engine pods; 0: off


@dataclass(frozen=True)
class Rollout:
    """Format changes: how long a new pool pair may take to become ready before Degraded, and the
    quality gate (None: not asked for)."""

    progress_deadline_s: int = 1800
    quality_gate: QualityGate | None = None

    @property
    def gate(self) -> QualityGate | None:
        """The gate when it is on (present and enabled)."""
        g = self.quality_gate
        return g if g is not None and g.enabled else None


@dataclass(frozen=True)
class Spec:
    """A whole ModelDeployment spec."""

    source: str
    architecture: str | None = None
    trust_remote_code: bool = False  # engines may run the model directory's tokenizer code
    image: str = "pagoda/node-agent:0.1.0"
    image_pull_policy: str = "IfNotPresent"
    prefill: Pool = field(default_factory=lambda: Pool(**POOL_DEFAULTS["prefill"]))
    decode: Pool = field(default_factory=lambda: Pool(**POOL_DEFAULTS["decode"]))
    integrity: Integrity = field(default_factory=Integrity)
    routing: Routing = field(default_factory=Routing)
    router: Router = field(default_factory=Router)
    auth: Auth = field(default_factory=Auth)
    network_policy: NetworkPolicy = field(default_factory=NetworkPolicy)
    rollout: Rollout = field(default_factory=Rollout)

    def pool(self, name: str) -> Pool:
        """The prefill or decode pool by name."""
        return self.prefill if name == "prefill" else self.decode

    @property
    def handoff(self) -> str:
        """The KV handoff between the pools, e.g. ``bf16->int8``."""
        return f"{self.prefill.kv_cache_format}->{self.decode.kv_cache_format}"


def _int_or_percent(value: Any, default: IntOrPercent) -> IntOrPercent:
    if value is None:
        return default
    return value if isinstance(value, str) else int(value)


def _drain(raw: dict[str, Any] | None) -> Drain:
    raw, d = raw or {}, Drain()
    return Drain(int(raw.get("timeoutSeconds", d.timeout_s)), int(raw.get("preStopSeconds", d.pre_stop_s)))


def _rolling(raw: dict[str, Any] | None) -> RollingUpdate:
    raw, d = raw or {}, RollingUpdate()
    return RollingUpdate(
        _int_or_percent(raw.get("maxSurge"), d.max_surge),
        _int_or_percent(raw.get("maxUnavailable"), d.max_unavailable),
    )


def _budget(raw: dict[str, Any] | None) -> DisruptionBudget:
    raw, d = raw or {}, DisruptionBudget()
    return DisruptionBudget(
        bool(raw.get("enabled", d.enabled)), _int_or_percent(raw.get("maxUnavailable"), d.max_unavailable)
    )


def _autoscaling(raw: dict[str, Any] | None) -> Autoscaling | None:
    if not raw:
        return None
    t = raw.get("targets") or {}

    def num(key: str) -> float | None:
        return float(t[key]) if t.get(key) is not None else None

    low = int(raw.get("minReplicas", 1))
    return Autoscaling(
        min_replicas=low,
        max_replicas=int(raw.get("maxReplicas", low)),
        targets=Targets(num("waitingRequests"), num("kvCacheUsage"), num("ttftSeconds"), num("itlSeconds")),
    )


def _opt_float(value: Any) -> float | None:
    return None if value is None else float(value)


def _pool(raw: dict[str, Any] | None, name: str) -> Pool:
    raw = raw or {}
    d = Pool(**POOL_DEFAULTS[name])
    tensor_parallel = int(raw.get("tensorParallel", d.tensor_parallel))
    nodes = int(raw.get("nodesPerReplica", d.nodes_per_replica))
    # gpus absent: a GPU pool whose pods request one GPU per rank they run
    derived = tensor_parallel // nodes if nodes > 0 and tensor_parallel % nodes == 0 else tensor_parallel
    return Pool(
        replicas=int(raw.get("replicas", d.replicas)),
        weight_format=str(raw.get("weightFormat", d.weight_format)),
        kv_cache_format=str(raw.get("kvCacheFormat", d.kv_cache_format)),
        tensor_parallel=tensor_parallel,
        gpus=int(raw["gpus"]) if raw.get("gpus") is not None else derived,
        nodes_per_replica=nodes,
        max_concurrency=int(raw.get("maxConcurrency", d.max_concurrency)),
        max_queue_time_s=_opt_float(raw.get("maxQueueTimeSeconds")),
        kv_memory_fraction=float(raw.get("kvMemoryFraction", d.kv_memory_fraction)),
        resources=dict(raw.get("resources") or {}),
        node_selector=dict(raw.get("nodeSelector") or {}),
        tolerations=list(raw.get("tolerations") or []),
        affinity=dict(raw.get("affinity") or {}),
        autoscaling=_autoscaling(raw.get("autoscaling")),
        drain=_drain(raw.get("drain")),
        rolling_update=_rolling(raw.get("rollingUpdate")),
        disruption_budget=_budget(raw.get("disruptionBudget")),
        startup_s=int(raw.get("startupSeconds", d.startup_s)),
        pod_template=dict(raw.get("podTemplate") or {}),
        auto_weight_format=d.auto_weight_format,
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


def _gateway(raw: dict[str, Any] | None) -> Gateway | None:
    if not raw:
        return None
    picker = raw.get("endpointPicker") or {}
    return Gateway(
        parent_refs=tuple(dict(r) for r in raw.get("parentRefs") or []),
        hostnames=tuple(str(h) for h in raw.get("hostnames") or []),
        endpoint_picker=str(picker.get("name", "")),
        endpoint_picker_port=int(picker.get("port", Gateway.endpoint_picker_port)),
        failure_mode=str(picker.get("failureMode", Gateway.failure_mode)),
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
        trust_remote_code=bool(model.get("trustRemoteCode", False)),
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
            drain=_drain(router.get("drain")),
            rolling_update=_rolling(router.get("rollingUpdate")),
            disruption_budget=_budget(router.get("disruptionBudget")),
            pod_template=dict(router.get("podTemplate") or {}),
            gateway=_gateway(router.get("gateway")),
        ),
        auth=_auth(raw.get("auth")),
        network_policy=_network_policy(raw.get("networkPolicy")),
        rollout=_rollout(raw.get("rollout")),
    )


def _rollout(raw: Any) -> Rollout:
    raw = raw if isinstance(raw, dict) else {}
    gate = raw.get("qualityGate")
    qg = None
    if isinstance(gate, dict):
        d = QualityGate()
        qg = QualityGate(
            enabled=bool(gate.get("enabled", d.enabled)),
            max_kl=float(gate.get("maxKL", d.max_kl)),
            min_top1=float(gate.get("minTop1", d.min_top1)),
            min_greedy_agreement=float(gate.get("minGreedyAgreement", d.min_greedy_agreement)),
            timeout_s=int(gate.get("timeout", d.timeout_s)),
            probe_set=str(gate["probeSet"]) if gate.get("probeSet") else None,
            probe_interval_s=int(gate.get("probeInterval", d.probe_interval_s)),
        )
    return Rollout(int(raw.get("progressDeadlineSeconds", Rollout.progress_deadline_s)), qg)

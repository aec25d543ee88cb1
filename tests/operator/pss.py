"""A checker of the Pod Security Standards "restricted" profile (which includes "baseline"), as
the Pod Security admission controller applies it to a pod spec (Kubernetes 1.33 rules)."""

from __future__ import annotations

from typing import Any

Obj = dict[str, Any]

ALLOWED_VOLUMES = {
    "configMap",
    "csi",
    "downwardAPI",
    "emptyDir",
    "ephemeral",
    "persistentVolumeClaim",
    "projected",
    "secret",
}
SAFE_SYSCTLS = {
    "kernel.shm_rmid_forced",
    "net.ipv4.ip_local_port_range",
    "net.ipv4.ip_unprivileged_port_start",
    "net.ipv4.tcp_syncookies",
    "net.ipv4.ping_group_range",
    "net.ipv4.ip_local_reserved_ports",
    "net.ipv4.tcp_keepalive_time",
    "net.ipv4.tcp_fin_timeout",
    "net.ipv4.tcp_keepalive_intvl",
    "net.ipv4.tcp_keepalive_probes",
}
SELINUX_TYPES = {None, "", "container_t", "container_init_t", "container_kvm_t", "container_engine_t"}


def _containers(spec: Obj) -> list[Obj]:
    return [
        *(spec.get("initContainers") or []),
        *(spec.get("containers") or []),
        *(spec.get("ephemeralContainers") or []),
    ]


def violations(spec: Obj) -> list[str]:
    """Every rule of "restricted" the pod spec breaks (empty: it is admitted)."""
    out: list[str] = []
    pod_sc = spec.get("securityContext") or {}
    for key in ("hostNetwork", "hostPID", "hostIPC"):
        if spec.get(key):
            out.append(f"{key} is true")
    for vol in spec.get("volumes") or []:
        kinds = set(vol) - {"name"}
        if not kinds <= ALLOWED_VOLUMES:
            out.append(f"volume {vol.get('name')} uses {sorted(kinds - ALLOWED_VOLUMES)}")
    for sysctl in pod_sc.get("sysctls") or []:
        if sysctl.get("name") not in SAFE_SYSCTLS:
            out.append(f"sysctl {sysctl.get('name')} is not safe")
    if pod_sc.get("runAsUser") == 0:
        out.append("pod runAsUser is 0")
    if (pod_sc.get("windowsOptions") or {}).get("hostProcess"):
        out.append("pod hostProcess is true")
    pod_seccomp = (pod_sc.get("seccompProfile") or {}).get("type")
    if pod_seccomp not in (None, "RuntimeDefault", "Localhost"):
        out.append(f"pod seccompProfile {pod_seccomp}")
    for se in [pod_sc.get("seLinuxOptions") or {}]:
        if se.get("type") not in SELINUX_TYPES or se.get("user") or se.get("role"):
            out.append("pod seLinuxOptions not allowed")
    for c in _containers(spec):
        name = c.get("name")
        sc = c.get("securityContext") or {}
        if sc.get("privileged"):
            out.append(f"{name}: privileged")
        if sc.get("allowPrivilegeEscalation") is not False:
            out.append(f"{name}: allowPrivilegeEscalation is not false")
        caps = sc.get("capabilities") or {}
        if "ALL" not in (caps.get("drop") or []):
            out.append(f"{name}: capabilities do not drop ALL")
        if set(caps.get("add") or []) - {"NET_BIND_SERVICE"}:
            out.append(f"{name}: capabilities add {sorted(set(caps['add']) - {'NET_BIND_SERVICE'})}")
        non_root = sc.get("runAsNonRoot", pod_sc.get("runAsNonRoot"))
        if non_root is not True:
            out.append(f"{name}: runAsNonRoot is not true")
        if sc.get("runAsUser") == 0:
            out.append(f"{name}: runAsUser is 0")
        seccomp = (sc.get("seccompProfile") or {}).get("type") or pod_seccomp
        if seccomp not in ("RuntimeDefault", "Localhost"):
            out.append(f"{name}: seccompProfile is {seccomp or 'unset'}")
        if sc.get("procMount") not in (None, "Default"):
            out.append(f"{name}: procMount {sc['procMount']}")
        se = sc.get("seLinuxOptions") or {}
        if se.get("type") not in SELINUX_TYPES or se.get("user") or se.get("role"):
            out.append(f"{name}: seLinuxOptions not allowed")
        if (sc.get("windowsOptions") or {}).get("hostProcess"):
            out.append(f"{name}: hostProcess")
        for port in c.get("ports") or []:
            if port.get("hostPort"):
                out.append(f"{name}: hostPort {port['hostPort']}")
        apparmor = (sc.get("appArmorProfile") or {}).get("type")
        if apparmor not in (None, "RuntimeDefault", "Localhost"):
            out.append(f"{name}: appArmorProfile {apparmor}")
    return out

"""Every pod the chart renders passes Pod Security "restricted" (the Kubernetes Pod Security
Standards, baseline and restricted rules, as the admission controller applies them), and the
project's own rules on top: a read-only root filesystem and CPU and memory limits on every
container, init containers and the `helm test` pod included. No cluster is needed: the rendered
objects are checked field by field, for default, GPU, operator and distributed values."""

from __future__ import annotations

import copy

import pytest

from tests.unit.deploy.test_deploy_k8s import (
    OPERATOR_VALUES,
    helm_template,
    kubectl_kustomize,
)

# The volume types "restricted" allows.
ALLOWED_VOLUMES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim",
                   "projected", "secret"}
# Sysctls baseline allows.
SAFE_SYSCTLS = {
    "kernel.shm_rmid_forced", "net.ipv4.ip_local_port_range", "net.ipv4.ip_unprivileged_port_start",
    "net.ipv4.tcp_syncookies", "net.ipv4.ping_group_range", "net.ipv4.ip_local_reserved_ports",
    "net.ipv4.tcp_keepalive_time", "net.ipv4.tcp_fin_timeout", "net.ipv4.tcp_keepalive_intvl",
    "net.ipv4.tcp_keepalive_probes",
}
SELINUX_TYPES = {None, "", "container_t", "container_init_t", "container_kvm_t", "container_engine_t"}
DISTRIBUTED = {"trainer": {"distributed": {"enabled": True, "dataClaim": "shared", "nnodes": 2,
                                           "nprocPerNode": 8}}}
VALUES: dict[str, tuple[tuple[str, ...], dict]] = {
    "default": ((), {}),
    "values_gpu": (("values-gpu.yaml",), {}),  # not the bare word: conftest skips "gpu" without CUDA
    "operator": ((), OPERATOR_VALUES),
    "distributed": ((), DISTRIBUTED),
}


def pod_specs(docs: list[dict]) -> list[tuple[str, dict]]:
    """(kind/name, pod spec) of every object that makes pods."""
    found = []
    for doc in docs:
        kind, spec = doc["kind"], doc.get("spec", {})
        if kind == "Pod":
            pod = spec
        elif kind in ("Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "Job"):
            pod = spec["template"]["spec"]
        elif kind == "CronJob":
            pod = spec["jobTemplate"]["spec"]["template"]["spec"]
        else:
            continue
        found.append((f"{kind}/{doc['metadata']['name']}", pod))
    return found


def restricted_violations(pod: dict) -> list[str]:
    """What the restricted profile (and this project's rules) refuse in one pod spec."""
    bad: list[str] = []
    pod_ctx = pod.get("securityContext", {})
    for flag in ("hostNetwork", "hostPID", "hostIPC", "hostUsers"):
        if pod.get(flag) is (flag != "hostUsers"):
            bad.append(f"pod {flag}")
    for volume in pod.get("volumes", []):
        kind = next(k for k in volume if k != "name")
        if kind not in ALLOWED_VOLUMES:
            bad.append(f"volume {volume['name']}: {kind}")
    for sysctl in pod_ctx.get("sysctls", []):
        if sysctl["name"] not in SAFE_SYSCTLS:
            bad.append(f"sysctl {sysctl['name']}")
    pod_seccomp = pod_ctx.get("seccompProfile", {}).get("type")
    if pod_seccomp == "Unconfined":
        bad.append("pod seccomp Unconfined")
    if pod_ctx.get("runAsUser") == 0:
        bad.append("pod runAsUser 0")
    if pod_ctx.get("seLinuxOptions", {}).get("type") not in SELINUX_TYPES:
        bad.append("pod SELinux type")
    containers = [*pod.get("initContainers", []), *pod["containers"], *pod.get("ephemeralContainers", [])]
    for c in containers:
        name, ctx = c["name"], c.get("securityContext", {})
        if ctx.get("privileged"):
            bad.append(f"{name}: privileged")
        if ctx.get("allowPrivilegeEscalation") is not False:
            bad.append(f"{name}: allowPrivilegeEscalation not false")
        caps = ctx.get("capabilities", {})
        if "ALL" not in caps.get("drop", []):
            bad.append(f"{name}: capabilities not dropping ALL")
        if set(caps.get("add", [])) - {"NET_BIND_SERVICE"}:
            bad.append(f"{name}: adds capabilities {caps['add']}")
        if ctx.get("runAsNonRoot", pod_ctx.get("runAsNonRoot")) is not True:
            bad.append(f"{name}: runAsNonRoot not true")
        if ctx.get("runAsUser") == 0:
            bad.append(f"{name}: runAsUser 0")
        seccomp = ctx.get("seccompProfile", {}).get("type", pod_seccomp)
        if seccomp not in ("RuntimeDefault", "Localhost"):
            bad.append(f"{name}: seccompProfile {seccomp}")
        if ctx.get("seLinuxOptions", {}).get("type") not in SELINUX_TYPES:
            bad.append(f"{name}: SELinux type")
        if ctx.get("procMount", "Default") != "Default":
            bad.append(f"{name}: procMount")
        apparmor = ctx.get("appArmorProfile", {}).get("type", "RuntimeDefault")
        if apparmor not in ("RuntimeDefault", "Localhost"):
            bad.append(f"{name}: AppArmor")
        for port in c.get("ports", []):
            if port.get("hostPort"):
                bad.append(f"{name}: hostPort {port['hostPort']}")
        # The project's rules on top of the profile.
        if ctx.get("readOnlyRootFilesystem") is not True:
            bad.append(f"{name}: root filesystem writable")
        limits = c.get("resources", {}).get("limits", {})
        for resource in ("cpu", "memory"):
            if resource not in limits:
                bad.append(f"{name}: no {resource} limit")
    return bad


@pytest.mark.parametrize("case", VALUES)
def test_every_chart_pod_passes_the_restricted_profile(case: str) -> None:
    files, overrides = VALUES[case]
    pods = pod_specs(helm_template(*files, overrides=copy.deepcopy(overrides), hooks=True))
    assert any(where.startswith("Pod/") for where, _ in pods), "the helm test pod was not rendered"
    if case == "distributed":
        assert any(where.startswith("StatefulSet/") for where, _ in pods)
    found = {where: v for where, pod in pods if (v := restricted_violations(pod))}
    assert not found, found


@pytest.mark.parametrize("overlay", ["cpu", "gpu"], ids=["overlay_cpu", "overlay_gpu"])
def test_every_kustomize_pod_passes_the_restricted_profile(overlay: str) -> None:
    pods = pod_specs(kubectl_kustomize(overlay))
    found = {where: v for where, pod in pods if (v := restricted_violations(pod))}
    assert not found, found


def test_the_check_refuses_what_the_profile_refuses() -> None:
    [(_, good)] = [p for p in pod_specs(helm_template()) if p[0].endswith("-registry")]
    assert restricted_violations(good) == []
    for breaks, expected in [
        (lambda p: (p["securityContext"].pop("seccompProfile"),
                    p["containers"][0]["securityContext"].pop("seccompProfile")), "seccompProfile None"),
        (lambda p: p["containers"][0]["securityContext"].update(allowPrivilegeEscalation=True),
         "allowPrivilegeEscalation"),
        (lambda p: p["containers"][0]["securityContext"].update(capabilities={"add": ["SYS_ADMIN"]}),
         "capabilities"),
        (lambda p: p["containers"][0]["securityContext"].pop("readOnlyRootFilesystem"), "writable"),
        (lambda p: p["initContainers"][0]["resources"]["limits"].pop("cpu"), "no cpu limit"),
        (lambda p: p["volumes"].append({"name": "h", "hostPath": {"path": "/"}}), "hostPath"),
        (lambda p: p.update(hostNetwork=True), "hostNetwork"),
        (lambda p: (p["securityContext"].pop("runAsNonRoot"),
                    p["containers"][0]["securityContext"].pop("runAsNonRoot")), "runAsNonRoot"),
    ]:
        pod = copy.deepcopy(good)
        breaks(pod)
        assert any(expected in v for v in restricted_violations(pod)), expected

"""containers/kubernetes renders with kustomize and every object validates against the
Kubernetes API schemas kubernetes-validate bundles; the DaemonSet has what egress needs
on a node, and its policies are egress policies (issue 15, item 4)."""

from __future__ import annotations

import shutil
import subprocess
from typing import Any

import kubernetes_validate
import pytest
import yaml

from egress import __version__
from egress.policy import parse_policy
from tests.support import ROOT

BASE = ROOT / "containers" / "kubernetes"
K8S_VERSION = "1.32"  # the kubectl here; the schemas of that API version


@pytest.fixture(scope="module")
def rendered() -> list[dict[str, Any]]:
    kubectl = shutil.which("kubectl")
    assert kubectl is not None, "kubectl is needed to render containers/kubernetes (kustomize)"
    done = subprocess.run([kubectl, "kustomize", str(BASE)], capture_output=True, text=True,
                          timeout=60)  # fmt: skip
    assert done.returncode == 0, done.stderr
    return [d for d in yaml.safe_load_all(done.stdout) if d]


def by_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


def test_every_object_validates_against_the_api_schemas(rendered: list[dict[str, Any]]) -> None:
    kinds = sorted(d["kind"] for d in rendered)
    assert kinds == ["ConfigMap", "ConfigMap", "DaemonSet", "Namespace", "PodMonitor",
                     "Service", "ServiceAccount"], kinds  # fmt: skip
    for doc in rendered:
        if doc["apiVersion"].startswith("monitoring.coreos.com/"):
            continue  # a CRD's: no bundled schema (checked below)
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
        if doc["kind"] != "Namespace":
            assert doc["metadata"]["namespace"] == "egress-system", doc["metadata"]


def test_a_broken_manifest_fails_validation() -> None:
    """The validator does catch mistakes (so the test above can fail)."""
    bad = {"apiVersion": "apps/v1", "kind": "DaemonSet", "metadata": {"name": "x"},
           "spec": {"selector": {}, "template": {"spec": {"hostPID": "yes",
                                                           "containers": []}}}}  # fmt: skip
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, K8S_VERSION, strict=True)


def test_the_daemonset_has_what_egress_needs_on_a_node(rendered: list[dict[str, Any]]) -> None:
    [ds] = by_kind(rendered, "DaemonSet")
    pod = ds["spec"]["template"]["spec"]
    assert pod["hostNetwork"] and pod["hostPID"]
    assert [c["name"] for c in pod["containers"]] == ["egressd", "observer"]
    assert [c["name"] for c in pod["initContainers"]] == ["install-cni"]
    images = {c["image"] for c in pod["containers"] + pod["initContainers"]}
    assert images == {f"localhost/egress:{__version__}"}
    egressd, observer = pod["containers"]
    assert egressd["command"][:1] == ["egressd"] and observer["command"][:2] == [
        "egressd", "observer"]  # fmt: skip
    assert "--log-journal" in egressd["command"]
    assert "--metrics-address=$(HOST_IP):9469" in egressd["command"]
    [env] = [e for e in egressd["env"] if e["name"] == "HOST_IP"]
    assert env["valueFrom"]["fieldRef"]["fieldPath"] == "status.hostIP"
    for c in pod["containers"]:
        assert c["securityContext"]["privileged"]
        mounts = {m["mountPath"] for m in c["volumeMounts"]}
        assert {"/run/egress", "/var/lib/egress", "/run/netns", "/sys/fs/cgroup"} <= mounts
    hostpaths = {v["hostPath"]["path"] for v in pod["volumes"] if "hostPath" in v}
    assert {"/opt/cni/bin", "/etc/cni/net.d", "/run/netns", "/sys/fs/cgroup",
            "/run/egress", "/var/lib/egress"} <= hostpaths  # fmt: skip
    install = pod["initContainers"][0]["command"]
    assert install[0] == "egress-cni-install"
    assert not pod.get("automountServiceAccountToken", True)


def test_the_policies_are_valid_and_the_mapping_names_them(
    rendered: list[dict[str, Any]],
) -> None:
    maps = {d["metadata"]["name"].rsplit("-", 1)[0]: d for d in by_kind(rendered, "ConfigMap")}
    policies = maps["egress-policies"]["data"]
    for name, text in policies.items():
        policy, _ = parse_policy(text, f"configmap:{name}")
        assert f"{policy.name}.yaml" == name  # the file name is the policy's name
    [ds] = by_kind(rendered, "DaemonSet")
    install = ds["spec"]["template"]["spec"]["initContainers"][0]["command"]
    defaults = [a.split("=", 1)[1] for a in install if a.startswith("--default-policy=")]
    assert defaults or "--unmatched=pass" in install  # else every other pod fails to start
    mapping = yaml.safe_load(maps["egress-mapping"]["data"]["mapping.yaml"])
    for name in [*defaults, *(e["policy"] for e in mapping)]:
        assert f"{name}.yaml" in policies, name


def test_service_and_podmonitor_select_the_daemonsets_pods(
    rendered: list[dict[str, Any]],
) -> None:
    [ds] = by_kind(rendered, "DaemonSet")
    labels = ds["spec"]["template"]["metadata"]["labels"]
    [svc] = by_kind(rendered, "Service")
    [mon] = by_kind(rendered, "PodMonitor")
    assert svc["spec"]["selector"].items() <= labels.items()
    assert mon["spec"]["selector"]["matchLabels"].items() <= labels.items()
    ports = {p["name"] for c in ds["spec"]["template"]["spec"]["containers"]
             for p in c.get("ports", [])}  # fmt: skip
    assert svc["spec"]["ports"][0]["targetPort"] in ports
    assert mon["spec"]["podMetricsEndpoints"][0]["port"] in ports


def test_its_policies_are_the_projects_own() -> None:
    """kustomize reads files only below the base: copies, kept equal to policies/."""
    for path in (BASE / "policies").glob("*.yaml"):
        assert path.read_text() == (ROOT / "policies" / path.name).read_text(), path.name


SIDECAR = BASE / "examples" / "sidecar"


def test_the_sidecar_example_validates_and_holds_its_workload() -> None:
    """containers/kubernetes/examples/sidecar: a pod with `egressd sidecar` and the
    observer beside a workload with no capability (tests/privileged/test_sidecar_pod.py
    runs the same arrangement: a shared PID namespace, a cgroup per container)."""
    done = subprocess.run(["kubectl", "kustomize", str(SIDECAR)], capture_output=True,
                          text=True, timeout=60)  # fmt: skip
    assert done.returncode == 0, done.stderr
    docs = [d for d in yaml.safe_load_all(done.stdout) if d]
    for doc in docs:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    [pod] = by_kind(docs, "Pod")
    [config] = by_kind(docs, "ConfigMap")
    spec = pod["spec"]
    assert spec["shareProcessNamespace"] and not spec.get("hostPID") and not spec.get("hostNetwork")
    assert spec["dnsPolicy"] == "None" and spec["dnsConfig"]["nameservers"] == ["127.0.0.53"]
    sidecar, observer = spec["initContainers"]
    [agent] = spec["containers"]
    for native in (sidecar, observer):  # running before the agent starts, and all along
        assert native["restartPolicy"] == "Always" and native["startupProbe"]["exec"]
    assert "--ready-file=/run/egress-pod/sidecar.ready" in sidecar["command"]
    assert sidecar["startupProbe"]["exec"]["command"] == [
        "test",
        "-e",
        "/run/egress-pod/sidecar.ready",
    ]
    assert sidecar["command"][:2] == ["egressd", "sidecar"]
    assert observer["command"][:2] == ["egressctl", "observe"]
    for egress in (sidecar, observer):
        assert egress["securityContext"]["privileged"]
        assert "--peers=/run/egress-pod/peers" in egress["command"]
        assert "--state-dir=/var/lib/egress" in egress["command"]
        assert not any(a.startswith("--cgroup") for a in egress["command"])
    sc = agent["securityContext"]
    assert sc["capabilities"] == {"drop": ["ALL"]} and sc["runAsNonRoot"]
    assert sc["seccompProfile"] == {"type": "RuntimeDefault"}  # no unshare(2)
    assert not sc["allowPrivilegeEscalation"] and not sc.get("privileged")
    assert "volumeMounts" not in agent  # neither the peers nor the journal
    [volume] = [v for v in spec["volumes"] if "configMap" in v]
    assert volume["configMap"]["name"] == config["metadata"]["name"]  # kustomize's hash
    [(name, text)] = config["data"].items()
    policy, _ = parse_policy(text, f"configmap:{name}")
    assert f"--policy=/etc/egress/policy/{name}" in sidecar["command"]
    assert text == (ROOT / "policies" / name).read_text() and policy.name == "llm-api-only"

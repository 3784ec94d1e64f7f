"""egress-cni-install, the DaemonSet's init container: the plugin, the policies and the
chained conflist on a node, each written whole, idempotent, and removable."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from egress.cli import cni_install

CALICO = {
    "name": "k8s-pod-network", "cniVersion": "0.3.1",
    "plugins": [{"type": "calico", "ipam": {"type": "calico-ipam"}},
                {"type": "portmap", "capabilities": {"portMappings": True}}],
}  # fmt: skip


def install(tmp: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "egress.cli.cni_install", "--cni-bin-dir", str(tmp / "bin"),
            "--cni-conf-dir", str(tmp / "net.d"), "--host-policy-dir", str(tmp / "policies"),
            *extra]  # fmt: skip
    return subprocess.run(argv, capture_output=True, text=True, timeout=60)


@pytest.fixture
def node(tmp_path: Path) -> Path:
    for d in ("bin", "net.d", "src"):
        (tmp_path / d).mkdir()
    (tmp_path / "net.d" / "10-calico.conflist").write_text(json.dumps(CALICO))
    (tmp_path / "net.d" / "99-other.conf").write_text('{"type": "bridge", "name": "x"}')
    (tmp_path / "src" / "agents.yaml").write_text("kind: Policy\n")
    (tmp_path / "mapping.yaml").write_text("- {namespace: agents, policy: agents}\n")
    return tmp_path


def test_it_installs_the_plugin_policies_and_the_chained_entry(node: Path) -> None:
    for _ in range(2):  # and again: the same result
        done = install(node, "--policies", str(node / "src"), "--default-policy", "agents",
                       "--mapping", str(node / "mapping.yaml"))  # fmt: skip
        assert done.returncode == 0, done.stderr
    conf = json.loads((node / "net.d" / "10-calico.conflist").read_text())
    assert [p["type"] for p in conf["plugins"]] == ["calico", "portmap", "egress-cni"]
    entry = conf["plugins"][-1]
    assert entry["policy"] == "agents" and entry["mapping"] == [
        {"namespace": "agents", "policy": "agents"}
    ]
    assert entry["policyDir"] == str(node / "policies")
    assert entry["capabilities"] == {"io.kubernetes.cri.pod-annotations": True}
    assert (node / "policies" / "agents.yaml").read_text() == "kind: Policy\n"
    plugin = node / "bin" / "egress-cni"
    assert os.access(plugin, os.X_OK)
    assert json.loads((node / "net.d" / "99-other.conf").read_text())["type"] == "bridge"
    # The installed file runs on its own (python3, no egress package): VERSION.
    done = subprocess.run([str(plugin)], input='{"cniVersion": "1.1.0"}', text=True,
                          env={"CNI_COMMAND": "VERSION", "PATH": "/usr/bin:/bin"},
                          capture_output=True, cwd="/", timeout=30)  # fmt: skip
    assert json.loads(done.stdout)["supportedVersions"][-1] == "1.1.0", done.stderr
    assert not [p for p in (node / "net.d").iterdir() if p.name.startswith(".")]  # no temp
    done = install(node, "--remove")
    assert done.returncode == 0, done.stderr
    assert json.loads((node / "net.d" / "10-calico.conflist").read_text()) == CALICO


def test_a_lone_conf_becomes_a_conflist_ending_in_egress(tmp_path: Path) -> None:
    (tmp_path / "net.d").mkdir()
    (tmp_path / "net.d" / "10-bridge.conf").write_text(
        '{"cniVersion": "1.0.0", "name": "br", "type": "bridge", "bridge": "cni0"}'
    )
    done = install(tmp_path, "--default-policy", "p")
    assert done.returncode == 0, done.stderr
    assert not (tmp_path / "net.d" / "10-bridge.conf").exists()
    conf = json.loads((tmp_path / "net.d" / "10-bridge.conflist").read_text())
    assert conf["name"] == "br" and [p["type"] for p in conf["plugins"]] == ["bridge", "egress-cni"]
    assert conf["plugins"][0] == {"type": "bridge", "bridge": "cni0"}


def test_no_network_yet_or_no_policy_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "net.d").mkdir()
    done = install(tmp_path, "--default-policy", "p")
    assert done.returncode == 1 and "no CNI network configuration yet" in done.stderr
    (tmp_path / "net.d" / "10-calico.conflist").write_text(json.dumps(CALICO))
    done = install(tmp_path)
    assert done.returncode == 1 and "--default-policy, --mapping" in done.stderr
    assert json.loads((tmp_path / "net.d" / "10-calico.conflist").read_text()) == CALICO


def test_chained_replaces_an_earlier_entry() -> None:
    conf = {**CALICO, "plugins": [*CALICO["plugins"], {"type": "egress-cni", "policy": "old"}]}
    out = cni_install.chained(conf, {"type": "egress-cni", "policy": "new"})
    assert [p.get("policy") for p in out["plugins"]] == [None, None, "new"]

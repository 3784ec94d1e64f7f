"""Debian's podman, kept to the test: its own storage, configuration and CNI networks in
a temporary directory, run inside a "container host" netns the test made.

Nothing of it touches the machine's podman: storage (vfs), runroot, containers.conf and
the CNI config dir are the test's, and the CNI bridge podman makes lives in the host
netns ``PodHost`` made, whose only way out is a veth to the lab's uplink (no route off
the machine). podman runs there through ``nsenter --net`` (``ip netns exec`` would mount
a fresh /sys, without the cgroup filesystems runc needs).

The image is busybox-static imported from a tarball: no registry is reachable, and
busybox has sh, wget and nslookup.

This machine's quirks, set in containers.conf: crun refuses hybrid cgroups (runc), the
hard RLIMIT_NOFILE/NPROC are below podman's defaults, and there is no systemd (cgroupfs).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from egress.sandbox import uplink as uplink_mod
from tests.support import ROOT
from tests.support.netns import unique

IMAGE = "localhost/egress-test-busybox:1"
# Not wget -T: Debian 12's busybox-static crashes on it (SIGSEGV); use timeout.
APPLETS = ("sh", "wget", "nslookup", "sleep", "cat", "echo", "ls", "ps", "true", "timeout")
CONTAINERS_CONF = """
[containers]
default_ulimits = ["nofile=1024:1024", "nproc=4096:4096"]
[network]
network_backend = "cni"
cni_plugin_dirs = ["{plugins}", "/usr/lib/cni"]
network_config_dir = "{networks}"
[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "file"
events_logfile_path = "{dir}/events.log"
tmp_dir = "{dir}/tmp"
volume_path = "{dir}/volumes"
"""
STORAGE_CONF = """
[storage]
driver = "vfs"
runroot = "{dir}/runroot"
graphroot = "{dir}/graphroot"
"""


def available() -> str | None:
    """None, or why podman cannot run here."""
    for tool in ("podman", "runc", "nsenter"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (make setup installs it)"
    if not os.path.exists("/usr/lib/cni/bridge") or shutil.which("busybox") is None:
        return "containernetworking-plugins or busybox-static is not installed"
    return None


class Podman:
    def __init__(self, directory: Path, host_netns: str) -> None:
        self.dir = directory
        self.host_netns = host_netns
        self.networks = directory / "networks"
        self.plugins = directory / "plugins"
        self.hooks = directory / "hooks.d"
        for d in (self.networks, self.plugins, self.hooks, directory / "tmp"):
            d.mkdir(parents=True, exist_ok=True)
        # The plugin the runtime execs by its type name, from CNI_PATH.
        os.symlink(ROOT / ".venv" / "bin" / "egress-cni", self.plugins / "egress-cni")
        fill = {"dir": directory, "plugins": self.plugins, "networks": self.networks}
        (directory / "containers.conf").write_text(CONTAINERS_CONF.format(**fill))
        (directory / "storage.conf").write_text(STORAGE_CONF.format(**fill))
        self.env = {
            **os.environ,
            "CONTAINERS_CONF": str(directory / "containers.conf"),
            "CONTAINERS_STORAGE_CONF": str(directory / "storage.conf"),
        }

    def argv(self, *args: str) -> list[str]:
        return ["nsenter", f"--net=/run/netns/{self.host_netns}", "podman",
                "--hooks-dir", str(self.hooks), *args]  # fmt: skip

    def run(
        self, *args: str, check: bool = True, timeout: float = 120
    ) -> subprocess.CompletedProcess[str]:
        done = subprocess.run(self.argv(*args), env=self.env, capture_output=True, text=True,
                              timeout=timeout)  # fmt: skip
        if check and done.returncode != 0:
            raise AssertionError(f"podman {' '.join(args)}: {done.returncode}\n{done.stderr}")
        return done

    def network(self, name: str, subnet: str, chained: dict[str, Any] | None) -> None:
        """A CNI network as podman's own CNI backend writes one, with ``chained`` (an
        egress-cni entry) after bridge and host-local."""
        import json

        plugins: list[dict[str, Any]] = [
            {"type": "bridge", "bridge": f"cni-{name}"[:15], "isGateway": True, "ipMasq": True,
             "hairpinMode": True,
             "ipam": {"type": "host-local", "routes": [{"dst": "0.0.0.0/0"}],
                      "ranges": [[{"subnet": subnet}]]}},
        ]  # fmt: skip
        if chained is not None:
            plugins.append(chained)
        conf = {"cniVersion": "1.0.0", "name": name, "plugins": plugins}
        (self.networks / f"{name}.conflist").write_text(json.dumps(conf, indent=1))

    def import_image(self) -> None:
        root = self.dir / "rootfs"
        (root / "bin").mkdir(parents=True)
        (root / "etc").mkdir()
        (root / "tmp").mkdir()
        busybox = shutil.which("busybox")
        assert busybox is not None
        shutil.copy(busybox, root / "bin" / "busybox")
        for applet in APPLETS:
            os.symlink("busybox", root / "bin" / applet)
        (root / "etc" / "passwd").write_text(
            "root:x:0:0::/:/bin/sh\nnobody:x:65534:65534::/:/bin/sh\n"
        )
        tar = self.dir / "rootfs.tar"
        subprocess.run(["tar", "-C", str(root), "-cf", str(tar), "."], check=True)
        self.run("import", "--quiet", str(tar), IMAGE)

    def pid(self, container: str) -> int:
        return int(self.run("inspect", "-f", "{{.State.Pid}}", container).stdout.strip())


@contextmanager
def container_host(uplink: str) -> Iterator[str]:
    """A netns standing in for the container host: a veth to the lab's uplink (which
    forwards and masquerades eg-* links), 10.214.0.2/30, default route through it."""
    name = unique("pod")
    host_if = f"eg-p{os.getpid() % 100000}"[:15]
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        subprocess.run(["ip", "-n", uplink, "link", "add", host_if, "type", "veth", "peer",
                        "name", "eth0", "netns", name], check=True)  # fmt: skip
        for argv in (
            ["ip", "-n", uplink, "addr", "add", "10.214.0.1/30", "dev", host_if],
            ["ip", "-n", uplink, "link", "set", host_if, "up"],
            ["ip", "-n", name, "addr", "add", "10.214.0.2/30", "dev", "eth0"],
            ["ip", "-n", name, "link", "set", "eth0", "up"],
            ["ip", "-n", name, "link", "set", "lo", "up"],
            ["ip", "-n", name, "route", "add", "default", "via", "10.214.0.1"],
        ):
            subprocess.run(argv, check=True)
        uplink_mod.attach(uplink, host_if)
        yield name
    finally:
        subprocess.run(["ip", "-n", uplink, "link", "del", host_if], capture_output=True)
        subprocess.run(["ip", "netns", "del", name], check=False)
        uplink_mod.detach(uplink, "no-claim")  # as the last sandbox on it would


@contextmanager
def podman(uplink: str) -> Iterator[Podman]:
    """A Podman of the test's own, its image imported; every container, network and
    file of it removed afterwards."""
    directory = Path(tempfile.mkdtemp(prefix="egress-podman-"))
    try:
        with container_host(uplink) as host:
            p = Podman(directory, host)
            try:
                p.import_image()
                yield p
            finally:
                p.run("rm", "--all", "--force", "--time", "0", check=False)
                p.run("system", "reset", "--force", check=False, timeout=120)
    finally:
        shutil.rmtree(directory, ignore_errors=True)

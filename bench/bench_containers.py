"""What egress adds to starting a container: podman, the same image, with and without it.

Against a throwaway lab, with Debian's podman kept to a temporary directory
(tests/support/podman.py: CNI backend, runc), in the same run:

- ``podman run -d`` to "running", N times each on a plain bridge network and on one
  whose conflist chains egress-cni (which has egressd attach to the container's netns
  before podman starts it); the medians and their difference;
- egress-cni ADD alone, driven as the runtime drives it, N times: from exec to its
  result, when the rules are in place and the resolver serves (egressd's attach
  returns only then).

Prints figures; asserts nothing. Needs root.

    .venv/bin/python bench/bench_containers.py [-n 20]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.support.egressd import egressd  # noqa: E402
from tests.support.labs import running_lab  # noqa: E402
from tests.support.netns import unique  # noqa: E402
from tests.support.podman import IMAGE, Podman, available, podman  # noqa: E402

POLICY = """
apiVersion: egress/v1
kind: Policy
metadata: {name: bench}
spec:
  dns:
    upstreams: ["198.51.100.53"]
    allow: [allowed.lab.test]
"""


def start_times(pod: Podman, network: str, n: int) -> list[float]:
    out = []
    for i in range(n):
        name = f"egb-{network}-{i}"
        t = time.perf_counter()
        pod.run("run", "-d", "--name", name, "--network", network, IMAGE, "sleep", "300")
        out.append((time.perf_counter() - t) * 1000)
        pod.run("rm", "--force", "--time", "0", name)
    return out


def add_times(socket_path: str, policies: Path, uplink: str, n: int) -> list[float]:
    conf = {"cniVersion": "1.0.0", "name": "egbench", "type": "egress-cni", "policy": "bench",
            "policyDir": str(policies), "socket": socket_path, "uplinkNetns": uplink,
            "prevResult": {"cniVersion": "1.0.0", "interfaces": [], "ips": []}}  # fmt: skip
    plugin = [sys.executable, str(ROOT / "egress" / "cli" / "cni.py")]
    out = []
    for i in range(n):
        ns = unique("egb")
        subprocess.run(["ip", "netns", "add", ns], check=True)
        env = {"PATH": os.environ["PATH"], "CNI_CONTAINERID": f"bench{i}", "CNI_IFNAME": "eth0",
               "CNI_NETNS": f"/run/netns/{ns}", "CNI_PATH": "/usr/lib/cni"}  # fmt: skip
        try:
            t = time.perf_counter()
            done = subprocess.run(plugin, input=json.dumps(conf), text=True, capture_output=True,
                                  env={**env, "CNI_COMMAND": "ADD"}, timeout=120)  # fmt: skip
            out.append((time.perf_counter() - t) * 1000)
            if done.returncode != 0:
                raise SystemExit(f"ADD failed: {done.stdout} {done.stderr}")
            subprocess.run(plugin, input=json.dumps(conf), text=True, capture_output=True,
                           env={**env, "CNI_COMMAND": "DEL"}, timeout=120)  # fmt: skip
        finally:
            subprocess.run(["ip", "netns", "del", ns], check=False)
    return out


def show(label: str, ms: list[float]) -> float:
    med = statistics.median(ms)
    print(f"  {label:<34} median {med:7.1f}  min {min(ms):7.1f}  max {max(ms):7.1f}")
    return med


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-n", type=int, default=20, help="starts per network (default 20)")
    args = p.parse_args()
    why = available()
    if why is not None:
        raise SystemExit(why)
    with tempfile.TemporaryDirectory(prefix="egress-bench-containers-") as tmp:
        policies = Path(tmp)
        (policies / "bench.yaml").write_text(POLICY)
        with (
            running_lab(prefix="egbc") as lab,
            egressd() as daemon,
            podman(lab.uplink_netns) as pod,
        ):
            chained = {"type": "egress-cni", "policy": "bench", "policyDir": str(policies),
                       "socket": daemon.socket, "uplinkNetns": lab.uplink_netns}  # fmt: skip
            pod.network("plain", "10.89.8.0/24", None)
            pod.network("egress", "10.89.9.0/24", chained)
            start_times(pod, "plain", 2)  # warm: image layers, CNI binaries, page cache
            print(f"podman run -d to running, same image, {args.n} each (ms):")
            plain = show("bridge + host-local", start_times(pod, "plain", args.n))
            guarded = show("bridge + host-local + egress-cni", start_times(pod, "egress", args.n))
            print(f"  added by egress (medians)           {guarded - plain:7.1f}"
                  f"  ({guarded / plain:.2f}x)")  # fmt: skip
            print(f"egress-cni ADD, exec to rules in place and resolver serving, {args.n} (ms):")
            show("ADD", add_times(daemon.socket, policies, lab.uplink_netns, args.n))


if __name__ == "__main__":
    main()

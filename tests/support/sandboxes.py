"""Run `egressctl run` for real against a lab, with the probe as the workload.

Every run writes a report; ``leftovers`` lists anything of a sandbox that is still on the
machine, so tests can assert that nothing is, and ``cleanup`` removes it (for tests that
kill egress on purpose).
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from egress.kernel import netns
from egress.kernel.cgroup import find_mounts
from egress.sandbox.lifecycle import teardown_claim
from egress.store import claims
from tests.support import ROOT, SYSTEM_PYTHON

EGRESSCTL = [sys.executable, "-m", "egress.cli.main"]
PROBE = Path(__file__).with_name("probe.py")


def run_in(d: Path) -> list[str]:
    """`egressctl run` with ``d`` as the workload's working directory: the only part of
    the host's tree, besides the system's, that the workload sees."""
    return [*EGRESSCTL, "run", "--workdir", str(d)]


@dataclass
class Outcome:
    rc: int
    steps: list[dict[str, Any]]
    report: dict[str, Any]
    stderr: str
    workdir: Path = field(repr=False)

    def step(self, i: int) -> dict[str, Any]:
        return self.steps[i]

    def violations(self, cls: str | None = None) -> list[dict[str, Any]]:
        return [v for v in self.report.get("violations", []) if cls is None or v["class"] == cls]


@contextmanager
def workdir() -> Iterator[Path]:
    """A directory the unprivileged workload can read (pytest's tmp_path is 0700)."""
    path = Path(tempfile.mkdtemp(prefix="egress-test-"))
    try:
        path.chmod(0o755)
        shutil.copy(PROBE, path / "probe.py")
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


_POLICIES: list[Path] = []


def policy_file(directory: Path, text: str, name: str = "policy.yaml") -> Path:
    """The operator's copy of a policy, never inside a workload's working directory
    (egressctl refuses a policy the workload could rewrite). ``directory`` (the test's
    own) only keeps the names of different tests apart."""
    if not _POLICIES:
        _POLICIES.append(Path(tempfile.mkdtemp(prefix="egress-test-policies-")))
        _POLICIES[0].chmod(0o755)
        atexit.register(shutil.rmtree, _POLICIES[0], True)
    path = _POLICIES[0] / f"{directory.name}-{name}"
    path.write_text(text)
    return path


def run_probe(
    policy: str,
    steps: list[dict[str, Any]],
    uplink: str | None,
    extra: list[str] | None = None,
    timeout: float = 120,
) -> Outcome:
    with workdir() as d:
        report = d / "report.json"
        argv = [
            *EGRESSCTL,
            "run",
            "--workdir",
            str(d),
            "--policy",
            str(policy_file(d, policy)),
            "--report",
            str(report),
        ]
        if uplink:
            argv += ["--uplink-netns", uplink]
        argv += [*(extra or []), "--", SYSTEM_PYTHON, str(d / "probe.py"), json.dumps(steps)]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env())
        results = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
        data = json.loads(report.read_text()) if report.exists() else {}
        return Outcome(done.returncode, results, data, done.stderr, d)


def env() -> dict[str, str]:
    # The workload inherits this; SUDO_USER would change the default user.
    out = {k: v for k, v in os.environ.items() if k != "SUDO_USER"}
    out["PYTHONPATH"] = str(ROOT)
    return out


def leftovers(sandbox_id: str, uplink: str | None) -> list[str]:
    """Everything of sandbox ``sandbox_id`` still on the machine."""
    found = []
    if netns.netns_exists(f"egress-{sandbox_id}"):
        found.append(f"netns egress-{sandbox_id}")
    if netns.link_exists(f"eg-{sandbox_id}", uplink):
        found.append(f"veth eg-{sandbox_id}")
    in_uplink = ["ip", "netns", "exec", uplink] if uplink else []
    tables = subprocess.run(
        [*in_uplink, "nft", "list", "tables"], capture_output=True, text=True
    ).stdout
    others = [c for c in claims.load_all() if c.id != sandbox_id and c.uplink_netns == uplink]
    if "egress_uplink" in tables and not others:  # the last sandbox takes the table along
        found.append("nft table egress_uplink")
    mounts = find_mounts()
    for root in (mounts.v2, mounts.freezer, mounts.cpu):
        if root and os.path.exists(os.path.join(root, "egress", sandbox_id)):
            found.append(f"cgroup {root}/egress/{sandbox_id}")
    if not claims.load_all():  # the last sandbox takes egress's parent cgroups along
        for root in (mounts.v2, mounts.freezer, mounts.cpu):
            if root and os.path.exists(os.path.join(root, "egress")):
                found.append(f"cgroup {root}/egress")
    if (claims.sandboxes_dir() / f"{sandbox_id}.json").exists():
        found.append(f"claim {sandbox_id}")
    if Path("/etc/netns", f"egress-{sandbox_id}").exists():
        found.append(f"/etc/netns/egress-{sandbox_id}")
    return found


def refused(argv: list[str], environ: dict[str, str]) -> tuple[int, str, list[str]]:
    """Run an `egressctl` that should refuse; (exit code, stderr, what it left: claims it
    owns and their namespaces, which a sandbox has from its first step on)."""
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, env=environ)  # fmt: skip
    _, err = proc.communicate(timeout=120)
    left = [f"claim {c.id} (netns {c.netns})" for c in claims.load_all() if c.owner_pid == proc.pid]
    return proc.returncode, err, left


def cleanup(sandbox_id: str) -> None:
    for claim in claims.load_all():
        if claim.id == sandbox_id:
            teardown_claim(claim)

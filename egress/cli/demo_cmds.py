"""`egressctl demo`: the main job end to end, on a lab internet, with nobody at the keyboard.

Brings up a throwaway lab (namespaces only: no network access needed), runs a scripted
agent in a sandbox under an embedded policy, narrates what happened from the agent's
output, the run's report and the lab's DNS query log, then removes everything.
"""

from __future__ import annotations

import argparse
import json
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from egress.policy import parse_policy

DEMO_POLICY = """\
# The demo's policy: one allowed name and a CDN, plain HTTP, nothing else.
apiVersion: egress/v1
kind: Policy
metadata: {name: demo}
spec:
  dns:
    upstreams: ["198.51.100.53"]     # the lab's DNS server
    allow:
      - allowed.lab.test
      - "*.cdn.lab.test"
      - meta.lab.test                # allowed, but it answers 169.254.169.254
  connect:
    ports: [80]
  violations:
    blocked_connect: block
"""

ALLOWED, DENIED, REBIND, DIRECT = (
    "allowed.lab.test",
    "denied.lab.test",
    "meta.lab.test",
    "198.51.100.12",
)
EPILOG = """\
Needs root (it creates network namespaces). Takes a few seconds; leaves nothing behind.

example:
  sudo egressctl demo
"""


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "demo", help="run a scripted agent in a sandbox against a lab internet",
        description="Show egress at work: a scripted agent in a sandbox, a lab internet.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    p.set_defaults(func=cmd_demo)


def say(text: str = "") -> None:
    print(text, flush=True)


def cmd_demo(args: argparse.Namespace) -> int:
    from egress.runtime.lab import Lab

    say("egress demo: a scripted agent in a sandbox, against a lab internet in namespaces\n")
    start = time.monotonic()
    lab = Lab.up(name=f"egd{secrets.token_hex(2)}")
    try:
        say(f"lab      up in {time.monotonic() - start:.1f} s: uplink netns {lab.uplink_netns}, "
            f"DNS {lab.dns4}, HTTP on {', '.join(lab.http4[:2])}, ...")  # fmt: skip
        return _run_agent(lab)
    finally:
        lab.down()
        say("teardown sandbox and lab removed")


def _run_agent(lab: Any) -> int:
    policy, _ = parse_policy(DEMO_POLICY, "<embedded demo policy>")
    say("policy   demo: resolve allowed.lab.test, *.cdn.lab.test, meta.lab.test; connect port 80")
    workdir = Path(tempfile.mkdtemp(prefix="egress-demo-"))
    try:
        workdir.chmod(0o755)  # the agent runs as nobody and must read its script
        agent = workdir / "agent.py"
        shutil.copy(Path(__file__).with_name("demo_agent.py"), agent)
        report = workdir / "report.json"
        policy_path = workdir / "demo.yaml"
        policy_path.write_text(DEMO_POLICY)
        argv = [sys.executable, "-m", "egress.cli.main", "run", "--policy", str(policy_path),
                "--uplink-netns", lab.uplink_netns, "--report", str(report), "--user", "nobody",
                "--", "/usr/bin/python3", str(agent), ALLOWED, DENIED, REBIND, DIRECT]  # fmt: skip
        done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
        if not report.exists():
            say(f"egressctl run failed ({done.returncode}):\n{done.stderr}")
            return 1
        steps = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
        _narrate(steps, json.loads(report.read_text()), lab, policy.name)
        return 0
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _narrate(steps: list[dict[str, Any]], report: dict[str, Any], lab: Any, name: str) -> None:
    by = {s["step"]: s for s in steps}
    say(f"sandbox  {report['sandbox']} ready in {report['timings_ms']['create']:.0f} ms; "
        f"the agent runs as {report['user']} with no capabilities\n")  # fmt: skip
    say("what the agent tried:")
    _line(by.get("fetch-allowed"), f"resolve {ALLOWED} and fetch it over HTTP",
          lambda s: f"{s['addresses'][0]}, got {s['body']!r}")  # fmt: skip
    upstream = "it reached the lab's DNS server!" if lab.saw(DENIED) else "never sent upstream"
    _line(by.get("resolve-denied"), f"resolve {DENIED}",
          lambda s: f"answered {s['addresses']}", f"refused ({{error}}); {upstream}")  # fmt: skip
    _line(by.get("connect-direct"), f"connect to {DIRECT}:80 by IP, no DNS",
          lambda s: "connected", "rejected by the kernel in {ms} ms ({error})")  # fmt: skip
    _line(by.get("resolve-rebinding"), f"resolve {REBIND} (its answer is 169.254.169.254)",
          lambda s: f"answered {s['addresses']}",
          "no address: the answer was dropped ({error})")  # fmt: skip
    say("\nviolations egress recorded (report: class, layer, what):")
    for v in report["violations"]:
        say(f"  {v['class']:<16} {v['layer']:<8} {v['detail']}")
    c = report["counters"]
    say(f"\ncounters: {c.get('dns_queries', 0)} DNS queries ({c.get('dns_allowed', 0)} allowed, "
        f"{c.get('dns_denied', 0)} denied), {c.get('set_updates', 0)} set updates, "
        f"{c.get('dropped_packets', 0)} packets dropped; "
        f"agent exit status {report['exit_code']}")  # fmt: skip


def _line(
    step: dict[str, Any] | None, what: str, ok: Any, failed: str = "failed ({error})"
) -> None:
    if step is None:
        say(f"  ?  {what}: the agent did not get this far")
        return
    mark = "ok " if step["ok"] else "no "
    text = ok(step) if step["ok"] else failed.format(**step)
    say(f"  {mark} {what}: {text}")

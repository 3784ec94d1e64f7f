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
    blocked_connect: freeze          # the default, spelled out: stop everything, keep it
    name_mismatch: block             # an allowed address asked for another name: reset
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
    from egress.lab import Lab

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
    _policy, _ = parse_policy(DEMO_POLICY, "<embedded demo policy>")
    say(
        "policy   demo: resolve allowed.lab.test, *.cdn.lab.test, meta.lab.test; connect port 80;"
        " a blocked connect freezes the sandbox"
    )
    base = Path(tempfile.mkdtemp(prefix="egress-demo-"))
    try:
        # The agent sees only its working directory; the policy, journal and report stay
        # beside it, where it can't rewrite them.
        workdir = base / "work"
        workdir.mkdir()
        agent = workdir / "agent.py"
        shutil.copy(Path(__file__).with_name("demo_agent.py"), agent)
        report, state = base / "report.json", base / "state"
        policy_path = base / "demo.yaml"
        policy_path.write_text(DEMO_POLICY)
        ctl = [sys.executable, "-m", "egress.cli.main"]
        argv = [
            *ctl,
            "run",
            "--policy",
            str(policy_path),
            "--state-dir",
            str(state),
            "--uplink-netns",
            lab.uplink_netns,
            "--report",
            str(report),
            "--workdir",
            str(workdir),
            "--",
            "/usr/bin/python3",
            str(agent),
            ALLOWED,
            DENIED,
            REBIND,
            DIRECT,
        ]
        run = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            _review(ctl, state)
            out, err = run.communicate(timeout=60)
        finally:
            if run.poll() is None:
                run.kill()
                run.wait()
        if not report.exists():
            say(f"egressctl run failed ({run.returncode}):\n{err}")
            return 1
        steps = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
        _narrate(steps, json.loads(report.read_text()), lab, err)
        return 0
    finally:
        shutil.rmtree(base, ignore_errors=True)


def _review(ctl: list[str], state: Path) -> None:
    """Play the person: wait for the freeze, read the journal, kill the sandbox."""
    from egress.store.journal import Journal

    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if (state / "journal.db").exists():
            with Journal.open(state) as journal:
                frozen = [f for f in journal.freezes() if f.get("confirmed_at")]
            if frozen:
                sandbox = frozen[0]["sandbox_id"]
                break
        time.sleep(0.05)
    else:
        say("the sandbox never froze")
        return
    say(f"\n$ egressctl journal --sandbox {sandbox}")
    shown = subprocess.run(
        [*ctl, "journal", "--state-dir", str(state), "--sandbox", sandbox],
        capture_output=True,
        text=True,
    )
    say(shown.stdout.rstrip())
    say(f"\n$ egressctl kill {sandbox}")
    killed = subprocess.run(
        [*ctl, "kill", "--state-dir", str(state), sandbox, "--note", "the demo's reviewer"],
        capture_output=True,
        text=True,
    )
    say((killed.stdout or killed.stderr).rstrip())


def _narrate(steps: list[dict[str, Any]], report: dict[str, Any], lab: Any, err: str) -> None:
    by = {s["step"]: s for s in steps}
    say(
        f"\nsandbox  {report['sandbox']} was ready in {report['timings_ms']['create']:.0f} ms; "
        f"the agent ran as {report['user']} (uid {report.get('uid')}, its own) with no "
        "capabilities, in its own PID namespace and view of the host"
    )
    say("\nwhat the agent tried:")
    _line(
        by.get("fetch-allowed"),
        f"resolve {ALLOWED} and fetch it over HTTP",
        lambda s: f"{s['addresses'][0]}, got {s['body']!r}",
    )
    served = [r for r in lab.requests() if r.get("host") == DENIED]
    _line(
        by.get("other-name"),
        f"ask {ALLOWED}'s address for {DENIED} (HTTP Host)",
        lambda s: f"answered {s['body']!r}",
        "refused ({error}); the lab's web server "
        + ("answered it!" if served else "never saw the request"),
    )
    upstream = "it reached the lab's DNS server!" if lab.saw(DENIED) else "never sent upstream"
    _line(
        by.get("resolve-denied"),
        f"resolve {DENIED}",
        lambda s: f"answered {s['addresses']}",
        f"refused ({{error}}); {upstream}",
    )
    _line(
        by.get("resolve-rebinding"),
        f"resolve {REBIND} (its answer is 169.254.169.254)",
        lambda s: f"answered {s['addresses']}",
        "no address: the answer was dropped ({error})",
    )
    _line(
        by.get("connect-direct"),
        f"connect to {DIRECT}:80 by IP, no DNS",
        lambda s: "connected",
        "failed ({error})",
        missing="frozen inside connect(), then killed: it never ran another instruction",
    )
    say("\nwhat egress printed when it froze the sandbox:")
    block = [line for line in err.splitlines() if line.startswith(("egress:", "  "))]
    say("\n".join("  | " + line for line in block[:8]))
    say("\nviolations in the report (class, layer, what):")
    for v in report["violations"]:
        say(f"  {v['class']:<16} {v['layer']:<8} {v['detail']}")
    c = report["counters"]
    say(
        f"\ncounters: {c.get('dns_queries', 0)} DNS queries ({c.get('dns_allowed', 0)} allowed, "
        f"{c.get('dns_denied', 0)} denied), {c.get('set_updates', 0)} set updates, "
        f"{c.get('dropped_packets', 0)} packets dropped; frozen: {report['frozen']} "
        f"({report['freeze_latency_ms'] or 0:.2f} ms after detection), "
        f"outcome: {report['outcome']}, "
        f"exit status {report['exit_code']}"
    )


def _line(
    step: dict[str, Any] | None,
    what: str,
    ok: Any,
    failed: str = "failed ({error})",
    missing: str = "the agent did not get this far",
) -> None:
    if step is None:
        say(f"  --  {what}: {missing}")
        return
    mark = "ok " if step["ok"] else "no "
    text = ok(step) if step["ok"] else failed.format(**step)
    say(f"  {mark} {what}: {text}")

"""Issue 4: the filtering resolver inside a real sandbox, against the lab's DNS server.

The workload uses real `dig` and the system resolver (getaddrinfo) through the sandbox's
resolv.conf; the lab's query log is the proof of what reached "upstream".
"""

from __future__ import annotations

import json
import re
import subprocess
import time

import pytest

from egress.lab import Lab
from tests.support import SYSTEM_PYTHON
from tests.support.sandboxes import (
    env,
    policy_file,
    run_in,
    run_probe,
    workdir,
)

pytestmark = [pytest.mark.privileged, pytest.mark.usefixtures("require_root")]

POLICY = """
apiVersion: egress/v1
kind: Policy
metadata: {name: resolver}
spec:
  dns:
    upstreams: ["198.51.100.53"]
    ttl: {min: 1s, max: 1h}
    allow:
      - allowed.lab.test
      - "*.cdn.lab.test"
      - alias-ok.lab.test
      - alias-bad.lab.test
      - alias-chain.lab.test
      - big.lab.test
      - short-ttl.lab.test
      - slow.lab.test
      - {name: meta.lab.test, types: [A]}
      - {name: loop.lab.test, types: [A]}
      - {name: ten.lab.test, types: [A]}
      - {name: ll6.lab.test, types: [AAAA]}
      - {name: mapped.lab.test, types: [AAAA]}
  connect:
    ports: [80]
  violations: {blocked_connect: block}
"""
DIG = "/usr/bin/dig"


def dig(*args: str) -> dict:
    return {"op": "run", "argv": [DIG, "+tries=1", "+time=5", "@127.0.0.53", *args]}


def status(step: dict) -> str:
    m = re.search(r"status: (\w+)", step.get("stdout", ""))
    return m.group(1) if m else f"no status (rc {step.get('rc')}): {step.get('stderr')}"


def answers(step: dict) -> list[str]:
    out = step.get("stdout", "")
    section = (
        out.split(";; ANSWER SECTION:")[1].split("\n\n")[0] if ";; ANSWER SECTION:" in out else ""
    )
    return [line.split()[-1] for line in section.strip().splitlines() if line]


def test_denied_names_and_types_are_refused_and_never_sent_upstream(lab: Lab) -> None:
    long_name = ".".join(["a" * 63] * 3) + ".allowed.lab.test"  # over 253 characters
    queries = [
        ("denied.lab.test", "A", "NXDOMAIN"),
        ("DeNiEd.LaB.TeSt.", "A", "NXDOMAIN"),
        ("evil-allowed.lab.test", "A", "NXDOMAIN"),
        ("allowed.lab.test.evil.test", "A", "NXDOMAIN"),
        ("a.b.cdn.lab.test", "A", "NXDOMAIN"),
        ("cdn.lab.test", "A", "NXDOMAIN"),
        (long_name, "A", None),
        ("allowed.lab.test", "TXT", "REFUSED"),
        ("allowed.lab.test", "NULL", "REFUSED"),
        ("allowed.lab.test", "ANY", "REFUSED"),
        ("allowed.lab.test", "TYPE65280", "REFUSED"),
    ]
    lab.clear_queries()
    steps = [dig(name, qtype) for name, qtype, _ in queries]
    steps += [dig("AlLoWeD.LaB.TeSt.", "A"), dig("a1.cdn.lab.test", "A")]
    out = run_probe(POLICY, steps, lab.uplink_netns)
    assert out.rc == 0, out.stderr
    for (name, qtype, expected), step in zip(queries, out.steps, strict=False):
        if expected:
            assert status(step) == expected, (name, qtype, step)
            # What the agent reads: dig prints the Extended DNS Error (RFC 8914) egress sent.
            why, cls = ("name", "denied_name") if expected == "NXDOMAIN" else (
                "record type", "denied_type")  # fmt: skip
            ede = f"; EDE: 15 (Blocked): (egress: {why} not allowed by policy resolver ({cls}))"
            assert ede in step["stdout"], (name, qtype, step["stdout"])
        else:  # dig itself may refuse to send a name this long; either way, nothing leaves
            assert status(step) in ("FORMERR", "NXDOMAIN") or step["rc"] != 0, step
    mixed, cdn = out.steps[-2:]
    assert status(mixed) == "NOERROR" and answers(mixed) == ["203.0.113.10"]
    assert status(cdn) == "NOERROR" and answers(cdn) == ["203.0.113.13"]
    arrived = [(q["qname"].rstrip("."), q.get("qtype")) for q in lab.queries() if q.get("qname")]
    names = [n for n, _ in arrived]
    assert "allowed.lab.test" in names and "a1.cdn.lab.test" in names  # lowercased: ours
    for name, _, expected in queries:
        if expected != "REFUSED":  # denied names: the name itself never arrives
            assert not any(n.lower() == name.lower().rstrip(".") for n in names), name
    assert not any("evil" in n or "denied" in n for n in names), names
    assert {t for _, t in arrived} <= {"A", 1}, arrived  # denied types never arrive
    classes = {v["class"] for v in out.violations()}
    assert classes == {"denied_name", "denied_type"}, classes


def test_cname_chains(lab: Lab) -> None:
    out = run_probe(POLICY, [dig("alias-bad.lab.test"), dig("alias-ok.lab.test"),
                             dig("alias-chain.lab.test")], lab.uplink_netns)  # fmt: skip
    bad, ok, chain = out.steps
    assert status(bad) == "NXDOMAIN" and answers(bad) == []
    why = "egress: answer leads to a name not allowed by policy resolver (denied_name)"
    assert f"; EDE: 15 (Blocked): ({why})" in bad["stdout"], bad["stdout"]
    assert status(ok) == "NOERROR" and answers(ok) == ["allowed.lab.test.", "203.0.113.10"]
    # alias-chain -> alias-ok -> allowed: every name on the chain is allowlisted.
    assert answers(chain)[-1] == "203.0.113.10"
    [v] = out.violations("denied_name")
    assert "denied.lab.test" in v["detail"]


HTTPS_POLICY = """
apiVersion: egress/v1
kind: Policy
metadata: {name: https}
spec:
  dns:
    upstreams: ["198.51.100.53"]
    allow: [ech.lab.test, alt-port.lab.test, https.lab.test]
  connect:
    ports: [443]
"""


def https_rdata(step: dict) -> list[str]:
    out = step.get("stdout", "")
    section = out.split(";; ANSWER SECTION:")[1].split("\n\n")[0] if "ANSWER SECTION" in out else ""
    return [line.split("HTTPS", 1)[1].strip() for line in section.splitlines() if "HTTPS" in line]


def test_https_answers_reach_the_sandbox_without_ech_or_address_hints(lab: Lab) -> None:
    upstream = lab.run(["dig", "+time=3", "+tries=1", f"@{lab.dns4}", "+short", "ech.lab.test",
                        "HTTPS"]).stdout  # fmt: skip
    assert "ech=" in upstream and "ipv4hint=" in upstream and "ipv6hint=" in upstream, upstream
    names = ("ech.lab.test", "alt-port.lab.test", "https.lab.test")
    out = run_probe(HTTPS_POLICY, [dig(n, "HTTPS") for n in names], lab.uplink_netns)
    assert out.rc == 0, out.stderr
    ech, alt, plain = out.steps
    assert [status(s) for s in out.steps] == ["NOERROR"] * 3, out.steps
    assert https_rdata(ech) == ['1 . alpn="h2"'], ech["stdout"]
    assert https_rdata(alt) == [], alt["stdout"]  # port 8443: not allowed, so no record
    assert https_rdata(plain) == ['1 . alpn="h2,http/1.1"'], plain["stdout"]
    assert not out.violations()


def test_rebinding_answers_are_dropped(lab: Lab) -> None:
    names = [("meta", "A"), ("loop", "A"), ("ten", "A"), ("ll6", "AAAA"), ("mapped", "AAAA")]
    out = run_probe(POLICY, [dig(f"{n}.lab.test", t) for n, t in names], lab.uplink_netns)
    for step in out.steps:
        assert status(step) == "NOERROR" and answers(step) == [], step
    dropped = [v["detail"] for v in out.violations("rebinding")]
    for needle in ("169.254.169.254", "127.0.0.1", "10.1.2.3", "fe80::1", "::ffff:"):
        assert any(needle in d for d in dropped), (needle, dropped)


def test_dns_over_tcp_and_truncation_fallback(lab: Lab) -> None:
    steps = [dig("+tcp", "allowed.lab.test"), dig("+noedns", "big.lab.test"),
             dig("+noedns", "+ignore", "big.lab.test")]  # fmt: skip
    out = run_probe(POLICY, steps, lab.uplink_netns)
    tcp, big, truncated = out.steps
    assert status(tcp) == "NOERROR" and answers(tcp) == ["203.0.113.10"]
    assert status(big) == "NOERROR" and len(answers(big)) == 40, big["stdout"][-400:]
    assert " tc " in truncated["stdout"].split("flags:")[1].split(";")[0] + " "


def test_upstream_slow_or_down_gives_servfail_and_the_server_lives(lab: Lab) -> None:
    out = run_probe(POLICY, [{**dig("slow.lab.test"), "t": 1}, dig("allowed.lab.test")],
                    lab.uplink_netns)  # fmt: skip
    slow, after = out.steps
    assert status(slow) == "SERVFAIL" and slow["elapsed"] < 3.0, slow
    assert status(after) == "NOERROR"
    steps = [dig("allowed.lab.test"), {"op": "tcp", "host": "203.0.113.10", "port": 80}]
    down = run_probe(POLICY, steps, lab.uplink_netns, extra=["--upstream", "198.51.100.99"])
    servfail, connect = down.steps
    assert status(servfail) == "SERVFAIL" and servfail["elapsed"] < 3.0
    assert not connect["ok"]  # nothing was allowed


def test_an_ip_is_forgotten_after_its_clamped_ttl(lab: Lab) -> None:
    with workdir() as d:
        go = d / "go"
        steps = [
            {"op": "fetch", "name": "short-ttl.lab.test"},
            {"op": "wait_file", "path": str(go)},
            {"op": "tcp", "host": "203.0.113.11", "port": 80, "http": False},
        ]
        argv = [*run_in(d), "--policy", str(policy_file(d, POLICY)),
                "--uplink-netns", lab.uplink_netns,
                "--", SYSTEM_PYTHON, str(d / "probe.py"), json.dumps(steps)]  # fmt: skip
        with subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, env=env()) as proc:
            try:
                assert proc.stdout is not None
                first = json.loads(proc.stdout.readline())
                assert first["ok"] and first["address"] == "203.0.113.11", first
                netns = _sandbox_netns(proc.pid)
                _wait_until_set_forgets(netns, "203.0.113.11", deadline_s=10)
            finally:
                go.touch()
            rest = [json.loads(line) for line in proc.stdout]
            proc.wait(timeout=30)
    assert not rest[-1]["ok"], rest


def test_a_name_asked_across_its_ttl_is_reachable_whenever_it_is_answered(lab: Lab) -> None:
    """The workload (its own uid, in its sandbox) asks short-ttl.lab.test (TTL 2 s) and
    connects to the answer at once, every 0.2 s for about 6 s. Its resolver replays the
    answer while the cache holds it, ages its TTLs each second, and once the entry and
    the kernel's element are gone asks the lab again. Every connect reaches the lab's web
    server: no answer, replayed or not, named an address the kernel had forgotten."""
    start = time.time()
    step = {"op": "repeat_fetch", "name": "short-ttl.lab.test", "port": 80, "count": 30,
            "interval": 0.2, "timeout": 2}  # fmt: skip
    out = run_probe(POLICY, [step], lab.uplink_netns)
    [result] = out.steps
    assert result["ok"] and result["failed"] == 0, result
    seen = [r for r in lab.requests() if r["ts"] >= start and r["host"] == "short-ttl.lab.test"]
    assert len(seen) == 30, seen
    asked = [q for q in lab.queries() if q["ts"] >= start and q.get("qname") is not None
             and q["qname"].lower().rstrip(".") == "short-ttl.lab.test"]  # fmt: skip
    # Asked again after each expiry (about 3 times in 6 s), not at each of the 30 answers.
    assert 2 <= len(asked) < 30, asked
    assert out.violations() == []


def _sandbox_netns(pid: int) -> str:
    from egress.store import claims

    [claim] = [c for c in claims.load_all() if c.owner_pid == pid]
    return claim.netns


def _wait_until_set_forgets(netns: str, ip: str, deadline_s: float) -> None:
    """Watch the kernel's set until the element times out (the TTL is 2 s)."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        argv = ["ip", "netns", "exec", netns, "nft", "list", "set", "inet", "egress", "allow4"]
        listing = subprocess.run(argv, capture_output=True, text=True).stdout
        if ip not in listing:
            return
        time.sleep(0.05)
    raise AssertionError(f"{ip} still in allow4 after {deadline_s} s")


SERIES_POLICY = """
apiVersion: egress/v1
kind: Policy
metadata: {name: series}
spec:
  dns:
    upstreams: ["198.51.100.53"]
    allow: ["*.any.lab.test"]
  connect:
    ports: [8081]
  violations: {blocked_connect: block}
"""


def test_allowed_answer_then_immediate_connect_1000_times(lab: Lab) -> None:
    """Every name answers a new IP, so every connect proves the set was updated first."""
    step = {"op": "fetch_series", "count": 1000, "port": 8081,
            "template": "ip-198-19-{a}-{b}.any.lab.test"}  # fmt: skip
    out = run_probe(SERIES_POLICY, [step], lab.uplink_netns, timeout=300)
    [result] = out.steps
    assert result["ok"] and result["failed"] == 0, result
    assert out.report["counters"]["set_updates"] == 1000
    assert out.violations() == []


def test_each_upstream_question_leaves_from_a_port_of_its_own(lab: Lab) -> None:
    """What reached the lab's DNS from 40 new names asked in a row: each question from a
    socket used once (the sockets come ready from a supply shared in the process), so
    the ports are the kernel's random picks, not one socket reused. Random picks from
    ~28,000 ports may repeat by chance (40 picks: ~3%); a reused socket gives 1-4 ports."""
    start = time.time()
    step = {"op": "fetch_series", "count": 40, "port": 8081,
            "template": "ip-198-19-{a}-{b}.any.lab.test"}  # fmt: skip
    out = run_probe(SERIES_POLICY, [step], lab.uplink_netns)
    [result] = out.steps
    assert result["ok"] and result["failed"] == 0, result
    asked = [q for q in lab.queries() if q["ts"] >= start
             and (q.get("qname") or "").lower().endswith(".any.lab.test")]  # fmt: skip
    assert len(asked) == 40, asked
    assert len({q["sport"] for q in asked}) >= 38, sorted(q["sport"] for q in asked)


AUDIT_POLICY = POLICY.replace(
    "metadata: {name: resolver}\nspec:\n", "metadata: {name: audit}\nspec:\n  mode: audit\n"
)


def test_audit_mode_resolves_everything_and_records_what_enforce_would_do(lab: Lab) -> None:
    steps = [dig("denied.lab.test"), dig("meta.lab.test"), dig("txt.lab.test", "TXT"),
             dig("allowed.lab.test", "MX"),
             {"op": "tcp", "host": "198.51.100.11", "port": 80}]  # fmt: skip
    out = run_probe(AUDIT_POLICY, steps, lab.uplink_netns)
    denied, meta, txt, mx, connect = out.steps
    assert status(denied) == "NOERROR" and answers(denied) == ["198.51.100.12"]
    assert answers(meta) == ["169.254.169.254"]
    assert status(txt) == "NOERROR" and "v=egresslab1" in txt["stdout"]
    assert status(mx) == "NOERROR"  # forwarded: the lab has no MX there (NODATA)
    assert connect["ok"], connect  # the kernel logs and accepts
    classes = {v["class"] for v in out.violations()}
    assert {"denied_name", "rebinding", "denied_type", "blocked_connect"} <= classes
    assert out.report["frozen"] is False

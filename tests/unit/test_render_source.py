"""The source check in a sandbox's ruleset (datapath.render): nothing leaves but from an
address of the sandbox's own netns, in every mode, and a reload flushes every chain."""

from __future__ import annotations

import re

import pytest

from egress.datapath import constants as c
from egress.datapath.evidence import drop_class, drop_violation
from egress.datapath.render import CHAINS, NEWER_CHAINS, Sidecar, reload_rules, render_sandbox
from egress.model import Flow, ViolationClass
from egress.policy import parse_policy
from egress.store.paths import read_template
from tests.unit.test_render_first_bytes import chain

POLICY = """
apiVersion: egress/v1
kind: Policy
metadata: {{name: t}}
spec:
  mode: {mode}
  dns: {{allow: [a.test]}}
  connect: {{check_names: {checks}}}
"""
CHECK = "fib saddr type != local goto spoofed_source"


def rendered(mode: str, checks: str = "false", sidecar: bool = False) -> str:
    policy, _ = parse_policy(POLICY.format(mode=mode, checks=checks), "t.yaml")
    side = Sidecar((("192.0.2.53", 53),), 1000) if sidecar else None
    return render_sandbox(read_template("sandbox.nft"), policy, side)


@pytest.mark.parametrize(
    ("mode", "checks", "sidecar"),
    [("enforce", "false", False), ("audit", "false", False), ("enforce", "[443]", True)],
)
def test_every_packet_but_a_query_to_the_resolver_meets_the_check_first(
    mode: str, checks: str, sidecar: bool
) -> None:
    lines = chain(rendered(mode, checks, sidecar), "output")
    assert lines[0] == "type filter hook output priority filter; policy drop;"
    assert lines[1].startswith('oif "lo" ip daddr $RESOLVER4 ') and lines[1].endswith(" accept")
    # The kernel's own messages before the link has an address; the resets the ruleset
    # sends to the workload; nothing else.
    assert lines[2].startswith("ip6 saddr :: ip6 daddr ff02::/16 icmpv6 type { ")
    assert lines[3] == 'oif "lo" tcp flags & rst == rst accept'
    assert lines[4] == CHECK
    assert lines.count(CHECK) == 1


@pytest.mark.parametrize("mode", ["enforce", "audit"])
def test_a_spoofed_source_is_counted_logged_to_both_layers_and_dropped_in_every_mode(
    mode: str,
) -> None:
    lines = chain(rendered(mode), "spoofed_source")
    limit = f"limit rate {c.LOG_RATE} burst {c.LOG_BURST} packets"
    assert lines == [
        "counter name dropped",
        f'{limit} log group {c.INLINE_GROUP} prefix "egress spoofed_source"',
        f'{limit} log group {c.OBSERVER_GROUP} prefix "egress spoofed_source" queue-threshold 1',
        "drop",
    ]
    assert drop_class("egress spoofed_source") is ViolationClass.SPOOFED_SOURCE


def test_its_evidence_says_blocked_in_audit_mode_too() -> None:
    flow = Flow("udp", "2001:db8:80::10", "fd00:e9e5:5000::2", 4444, 5000)
    for mode, verb in (("audit", "blocked"), ("enforce", "blocked")):
        policy, _ = parse_policy(POLICY.format(mode=mode, checks="false"), "t.yaml")
        v = drop_violation(policy, ViolationClass.SPOOFED_SOURCE, flow, 7, 1.0, "inline")
        assert v.rule == "a sandbox sends only from its own addresses"
        assert v.detail == f"{flow} {verb} (uid 7)"
    # Where the policy lets violations through, a blocked connect says so.
    policy, _ = parse_policy(POLICY.format(mode="audit", checks="false"), "t.yaml")
    v = drop_violation(policy, ViolationClass.BLOCKED_CONNECT, flow, 7, 1.0, "inline")
    assert "allowed (audit)" in v.detail


def test_a_reload_declares_and_flushes_every_chain_a_ruleset_has() -> None:
    template = read_template("sandbox.nft")
    policy, _ = parse_policy(POLICY.format(mode="enforce", checks="[443]"), "t.yaml")
    whole = render_sandbox(template, policy)
    declared = set(re.findall(r"^\tchain (\w+) \{", whole, re.MULTILINE))
    text = reload_rules(template, policy)
    flushed = re.findall(rf"^flush chain inet {c.TABLE} (\w+)$", text, re.MULTILINE)
    assert set(flushed) == declared == set(CHAINS) and len(flushed) == len(CHAINS)
    # Each flush follows the declarations of the chains an older table may lack.
    first_flush = text.index("flush chain")
    for line in NEWER_CHAINS:
        assert 0 <= text.index(line) < first_flush
    assert text.endswith(whole)

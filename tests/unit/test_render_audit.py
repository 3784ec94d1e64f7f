"""mode: audit's extra logging in a sandbox's ruleset (datapath.render): every new flow it
lets through reaches the inline layer once, for `egressctl learn`, and no verdict moves."""

from __future__ import annotations

from egress.datapath import constants as c
from egress.datapath.evidence import drop_class
from egress.datapath.render import render_sandbox
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
  connect: {{allow: [{{cidr: 192.0.2.0/24, ports: [8443]}}]}}
"""


def output(mode: str) -> list[str]:
    policy, _ = parse_policy(POLICY.format(mode=mode), "t.yaml")
    return chain(render_sandbox(read_template("sandbox.nft"), policy), "output")


def test_audit_logs_new_learned_and_static_flows_to_the_inline_group_only() -> None:
    lines = output("audit")
    learned = f'log group {c.INLINE_GROUP} prefix "{c.CONNECT_LEARNED_PREFIX}"'
    logs = [i for i, line in enumerate(lines) if learned in line]
    assert [lines[i].split(" log ")[0] for i in logs] == [
        "ct state new ip daddr . meta l4proto . th dport @allow4",
        "ct state new ip6 daddr . meta l4proto . th dport @allow6",
    ]
    established = lines.index("ct state established,related accept")
    first_accept = min(i for i, line in enumerate(lines) if "@allow4" in line and "log" not in line)
    assert established < logs[0] and logs[-1] < first_accept  # new flows only, before any accept
    assert all("accept" not in lines[i] and "limit" not in lines[i] for i in logs)
    [static] = [line for line in lines if "192.0.2.0/24" in line]
    assert static.startswith(
        f"ip daddr 192.0.2.0/24 tcp dport {{ 8443 }} log group {c.INLINE_GROUP} prefix"
        f' "{c.CONNECT_STATIC_PREFIX}" accept'
    )
    assert str(c.OBSERVER_GROUP) not in " ".join(lines[i] for i in logs)


def test_audit_learns_from_every_blocked_flow_the_observer_copy_stays_limited() -> None:
    policy, _ = parse_policy(POLICY.format(mode="audit"), "t.yaml")
    blocked = chain(render_sandbox(read_template("sandbox.nft"), policy), "blocked_connect")
    inline = [line for line in blocked if f"log group {c.INLINE_GROUP} " in line]
    observer = [line for line in blocked if f"log group {c.OBSERVER_GROUP} " in line]
    assert inline == [f'log group {c.INLINE_GROUP} prefix "egress blocked_connect"']
    assert len(observer) == 1 and observer[0].startswith("limit rate")
    policy, _ = parse_policy(POLICY.format(mode="enforce"), "t.yaml")
    blocked = chain(render_sandbox(read_template("sandbox.nft"), policy), "blocked_connect")
    assert all(line.startswith("limit rate") for line in blocked if " log group " in line)


def test_enforce_logs_no_allowed_flow() -> None:
    text = " ".join(output("enforce"))
    assert c.CONNECT_PREFIX not in text


def test_connect_prefixes_are_no_violation_class() -> None:
    assert drop_class(c.CONNECT_LEARNED_PREFIX) is None
    assert drop_class(c.CONNECT_STATIC_PREFIX) is None

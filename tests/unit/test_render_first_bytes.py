"""The first-bytes rules in a sandbox's ruleset (datapath.render; issue 14, item 2).

What nft -c cannot say: that a checked flow's segments are marked for the queue only
while unread, that the verdict rules come before ``ct state established`` (which would
accept a held segment whatever it carries), and that no check means no mark at all."""

from __future__ import annotations

from egress.datapath import constants as c
from egress.datapath.evidence import drop_class
from egress.datapath.render import queue_rules, render_sandbox
from egress.policy import parse_policy
from egress.store.paths import read_template

POLICY = """
apiVersion: egress/v1
kind: Policy
metadata: {{name: t}}
spec:
  dns: {{allow: [a.test]}}
  connect: {{ports: [443, 8443], check_names: {checks}}}
"""


def ruleset(checks: str) -> str:
    policy, _ = parse_policy(POLICY.format(checks=checks), "t.yaml")
    return render_sandbox(read_template("sandbox.nft"), policy)


def chain(text: str, name: str) -> list[str]:
    body = text.split(f"\tchain {name} {{\n", 1)[1].split("\n\t}", 1)[0]
    return [
        line.strip()
        for line in body.splitlines()
        if line.strip() and not line.strip().startswith("#")
    ]


def test_checked_flows_are_marked_when_new_and_queued_until_judged() -> None:
    text = ruleset("[443]")
    assert "define CHECK_PORTS = { 443 }" in text
    out = chain(text, "output")
    established = out.index("ct state established,related accept")
    verdicts = [i for i, r in enumerate(out) if r.startswith("meta mark $")]
    assert len(verdicts) == 6 and max(verdicts) < established
    assert out[verdicts[0]] == "meta mark $QUEUE_MARK ct mark $CT_CHECKED accept"  # a probe
    assert out[verdicts[1]].endswith("counter name dropped drop")  # never queued: dropped
    assert out[verdicts[2]] == "meta mark $READ_QUEUE_MARK counter name dropped drop"
    assert "meta mark $READ_MARK ct mark set $CT_READING accept" in out  # read on
    needs = [r for r in out if "ct mark set $CT_NEEDS_CHECK" in r]
    assert [r.split()[0] for r in needs] == ["ip", "ip6"]
    pickups = [r for r in out if r.endswith("tcp flags & (syn | ack) != syn drop")]
    assert len(pickups) == 2 and out.index(pickups[1]) < out.index(needs[0])
    assert all("tcp dport $CHECK_PORTS" in r for r in needs)
    assert out.index(needs[0]) < out.index("ip daddr . meta l4proto . th dport @allow4 accept")
    fb = chain(text, "first_bytes")
    assert fb[0].startswith("type filter hook output priority mangle - 10")
    # every SYN to a checked destination starts unchecked, whatever conntrack makes of it
    assert [r.split(" daddr")[0] for r in fb[2:4]] == [
        "tcp flags & (syn | ack) == syn ip",
        "tcp flags & (syn | ack) == syn ip6",
    ]
    assert all(r.endswith("ct mark set $CT_NEEDS_CHECK") for r in fb[2:4])
    assert fb[4] == "tcp flags & syn == 0 ct mark != { $CT_NEEDS_CHECK, $CT_READING } accept"
    assert sum(r.endswith("accept") and "doff" in r for r in fb) == 22  # no data: no queue
    assert fb[-2] == "ct mark $CT_READING goto read_on"  # plain HTTP, read on
    assert fb[-1].endswith("meta mark set $QUEUE_MARK") and c.FIRST_BYTES_LOG_PREFIX in fb[-1]
    [read] = chain(text, "read_on")
    assert read.endswith("meta mark set $QUEUE_MARK") and c.READ_LOG_PREFIX in read
    assert any(c.ANSWER_LOG_PREFIX in r for r in out)


def test_no_checks_no_mark_and_an_empty_chain() -> None:
    text = ruleset("false")
    assert "QUEUE_MARK" not in text and "CT_NEEDS_CHECK" not in text
    assert chain(text, "first_bytes") == [
        "type filter hook output priority mangle - 10; policy accept;"
    ]
    assert "\tchain read_on {\n\t}" in text  # empty


def test_the_queue_rules_have_no_bypass_and_ask_conntrack_which_flow() -> None:
    unchecked, reread, read = queue_rules()
    for rule in (unchecked, read):
        assert "--queue-bypass" not in rule and "--fail-open" not in rule
        assert rule[rule.index("--queue-num") + 1] == str(c.FIRST_BYTES_QUEUE)
    assert unchecked[unchecked.index("--mark") + 1] == hex(c.QUEUE_MARK)
    assert unchecked[unchecked.index("connmark") + 2] == hex(c.CT_NEEDS_CHECK)
    # a read flow's segment marked for the queue is told apart as it is queued
    assert reread[reread.index("--mark") + 1] == hex(c.QUEUE_MARK)
    assert reread[reread.index("connmark") + 2] == hex(c.CT_READING)
    assert reread[reread.index("--set-mark") + 1] == hex(c.READ_QUEUE_MARK)
    assert read[read.index("--mark") + 1] == hex(c.READ_QUEUE_MARK)
    assert read[read.index("connmark") + 2] == hex(c.CT_READING)


def test_the_observers_drop_evidence_is_handed_over_at_once_and_its_copies_batched() -> None:
    """The observer's listener lets the kernel batch its copies (observer.layer.BATCH):
    without a per-rule threshold of 1, a drop would wait for the batch to fill or the
    kernel's next tick before the observer could act on it. What the inline layer judges
    first (DNS queries, answers, queued segments) is batched: a segment copy handed over
    at once woke the observer to compete for the CPUs while its flow waited."""
    text = ruleset("[443]")
    logs = [ln.strip() for ln in text.splitlines() if f"log group {c.OBSERVER_GROUP} " in ln]
    prefixes = [ln.split('prefix "', 1)[1].split('"')[0] for ln in logs]
    evidence = [ln for ln, p in zip(logs, prefixes, strict=True) if drop_class(p) is not None]
    copies = [ln for ln in logs if ln not in evidence]
    # drops: foreign DNS, spoofed source, blocked connect; copies: queries, answers,
    # segments, read flows' segments
    assert len(evidence) == 3 and len(copies) == 4
    assert any(c.FIRST_BYTES_LOG_PREFIX in ln for ln in copies)
    assert all("queue-threshold 1" in ln for ln in evidence)
    assert not any("queue-threshold" in ln for ln in copies)

"""The learner (egress.learn): patterns only from enough siblings under one registered
domain (Public Suffix List cases), risks never allowed, the least each rule needs, a
written policy that validates and allows exactly what was seen, and the diff."""

from __future__ import annotations

from typing import Any

import pytest

from egress.learn.diff import against
from egress.learn.draft import make_draft
from egress.learn.observed import collect
from egress.learn.siblings import group
from egress.learn.write import policy_text
from egress.model import Action, ViolationClass
from egress.policy import parse_policy
from egress.policy.matcher import Matcher

T0 = 1_764_644_000.0


def pats(names: list[str], n: int = 4) -> dict[str, tuple[str, ...]]:
    return {g.pattern: g.members for g in group(names, n)}


def test_four_siblings_make_one_level_pattern_three_do_not() -> None:
    four = [f"{x}.cdn.example.com" for x in "abcd"]
    assert pats(four) == {"*.cdn.example.com": tuple(four)}
    assert set(pats(four[:3])) == set(four[:3])
    assert set(pats(four, n=5)) == set(four)


def test_siblings_at_the_registered_domain_itself_may_make_a_pattern() -> None:
    names = [f"{x}.example.com" for x in ("www", "api", "cdn", "static")]
    assert list(pats(names)) == ["*.example.com"]


@pytest.mark.parametrize(
    "names",
    [
        [f"{x}.github.io" for x in ("alice", "bob", "carol", "dave")],  # PSL private section
        [f"{x}.co.uk" for x in ("bbc", "amazon", "tesco", "argos")],  # a two-label suffix
        [f"{x}.com" for x in ("a", "b", "c", "d")],  # registered domains are not siblings
        [f"bucket{i}.s3.amazonaws.com" for i in range(4)],  # each bucket is its own zone
        [f"{x}.blogspot.com" for x in "abcd"],
    ],
    ids=["github.io", "co.uk", "com", "s3", "blogspot"],
)
def test_no_pattern_covers_a_public_suffix_or_crosses_registered_domains(names: list[str]) -> None:
    assert pats(names) == {n: (n,) for n in names}


def test_a_wide_pattern_never_reaches_into_registered_domains_below_a_suffix() -> None:
    """amazonaws.com is a registered domain, and s3.amazonaws.com and friends are public
    suffixes under it: names in buckets below them belong to their owners, not to it."""
    buckets = [f"b.{s}.amazonaws.com" for s in ("s3", "s3.us-east-1", "s3.eu-west-1",
               "s3-website-us-east-1", "execute-api.us-east-1")]  # fmt: skip
    got = pats([*buckets, "www.amazonaws.com", "console.amazonaws.com"])
    assert not any(p.startswith("*") for p in got), got


def test_siblings_under_a_two_label_suffix_are_grouped_below_it() -> None:
    names = [f"{i}.example.co.uk" for i in "1234"]
    assert list(pats(names)) == ["*.example.co.uk"]


def test_deep_names_under_enough_children_make_a_many_label_pattern() -> None:
    deep = [f"a.{x}.example.com" for x in "wxyz"]
    got = pats([*deep, "example.com"])
    assert got == {"**.example.com": tuple(sorted(deep)), "example.com": ("example.com",)}
    # three branches are not enough; each stays exact
    assert set(pats(deep[:3])) == set(deep[:3])


def test_patterns_deepest_first_do_not_add_up_to_a_wider_one() -> None:
    names = [f"{x}.{y}.example.com" for y in ("img", "api", "cdn", "js") for x in "abcd"]
    assert sorted(pats(names)) == [
        f"*.{y}.example.com" for y in sorted(("img", "api", "cdn", "js"))
    ]


# -- draft and written policy ------------------------------------------------------------


def name_row(
    name: str, qtype: int = 1, count: int = 1, sb: str = "s1", **kw: Any
) -> dict[str, Any]:
    return {"sandbox_id": sb, "name": name, "qtype": qtype, "count": count,
            "verdict": kw.get("verdict", "denied_name"), "first_seen": T0, "last_seen": T0 + 5,
            "risks": list(kw.get("risks", ())), "chain": list(kw.get("chain", ()))}  # fmt: skip


def connect_row(address: str, port: int, names: list[str], proto: str = "tcp",
                sb: str = "s1") -> dict[str, Any]:  # fmt: skip
    return {"sandbox_id": sb, "address": address, "proto": proto, "port": port, "count": 1,
            "verdict": "blocked_connect", "first_seen": T0, "last_seen": T0,
            "names": names}  # fmt: skip


TUNNEL = "aGVsbG8gd29ybGQgdGhpcyBpcyBhIHR1bm5lbCBwYXlsb2Fk.t.lab.test"  # scores 3.6


def learned(
    names: list[dict[str, Any]], connects: list[dict[str, Any]], **kw: Any
) -> tuple[Any, str]:
    seen = collect(names, connects, kw.pop("overflow", None))
    draft = make_draft(seen, **kw)
    text = policy_text(draft, "learned")
    policy, _ = parse_policy(text, "learned.yaml")
    return policy, text


def with_base(base_text: str, names: list[dict[str, Any]],
              connects: list[dict[str, Any]]) -> tuple[Any, str]:  # fmt: skip
    """The draft learned over a --base policy, and the text written from both."""
    from egress.learn.write import base_settings
    from egress.policy.tree import compose

    base, _ = parse_policy(base_text, "base.yaml")
    draft = make_draft(collect(names, connects), base)
    return draft, policy_text(draft, "team", base_settings(compose(base_text, "base.yaml")[0]))


def test_the_written_policy_allows_what_was_seen_and_nothing_else() -> None:
    cdn = "edge.cdn.example.net"
    names = [name_row("pypi.org"), name_row("pypi.org", 28),
             name_row("files.example.net", chain=(cdn,)),
             name_row("only-once.example.org", sb="s2")]  # fmt: skip
    connects = [connect_row("203.0.113.11", 443, ["pypi.org"]),
                connect_row("203.0.113.12", 443, ["files.example.net", cdn])]  # fmt: skip
    policy, text = learned(names, connects)
    m = Matcher(policy)
    assert policy.mode.value == "enforce"
    assert m.decide("pypi.org", 1).allowed and m.decide("pypi.org", 28).allowed
    assert not m.decide("pypi.org", 16).allowed  # TXT was never asked
    assert not m.decide("www.pypi.org", 1).allowed  # no name beyond those seen
    assert m.decide("files.example.net", 5).allowed  # the answer came through a CNAME
    assert m.decide("edge.cdn.example.net", 1).name_allowed  # and its target must pass
    assert m.decide("only-once.example.org", 1).allowed  # a name only one run asked
    [pypi] = [r for r in policy.dns.allow if r.pattern.text == "pypi.org"]
    assert [str(p) for p in pypi.ports.tcp] == ["443"] and not pypi.ports.udp
    [once] = [r for r in policy.dns.allow if r.pattern.text == "only-once.example.org"]
    assert once.ports.is_empty() and policy.connect.ports.is_empty()  # never connected: none
    assert "1 query in 1 sandbox," in text and "from 2 audit runs (s1, s2)" in text


def test_risks_are_commented_out_never_allowed() -> None:
    names = [name_row(TUNNEL), name_row("meta.example.com", risks=("rebinding",)),
             name_row("txt.example.com", 16), name_row("mixed.example.com", 1),
             name_row("mixed.example.com", 16), name_row("x.example.com", verdict="tunnel"),
             name_row("null.example.com", 10)]  # fmt: skip
    policy, text = learned(names, [connect_row("169.254.169.254", 80, ["meta.example.com"])])
    m = Matcher(policy)
    for name in (
        TUNNEL,
        "meta.example.com",
        "txt.example.com",
        "x.example.com",
        "null.example.com",
    ):
        assert not m.decide(name, 1).name_allowed, name
        assert f"# - {name}  # " in text
    assert (
        m.decide("mixed.example.com", 1).allowed and not m.decide("mixed.example.com", 16).allowed
    )
    assert "mixed.example.com TXT asked 1x: not allowed" in text
    assert "tunnel-shaped: score" in text and "rebinding" in text
    assert "# - 169.254.169.254 tcp/80  # 1 connect" in text and not policy.connect.allow


def test_a_tunnel_whose_names_look_plain_one_by_one_is_a_risk_zone_and_no_pattern() -> None:
    """iodine-like names each score low; replayed in order, their zone is a tunnel. Without
    the replay the learner would write "*.t.tunnel-op.net" from its hundreds of siblings.
    (Not under .test: the scorer leaves special-use zones alone unless a policy says.)"""
    import random

    rng = random.Random(5)
    chars = "abcdefghijklmnopqrstuvwxyz0123456789"
    names = [name_row("".join(rng.choice(chars) for _ in range(50)) + ".t.tunnel-op.net")
             for _ in range(200)]  # fmt: skip
    for i, row in enumerate(names):
        row["first_seen"] = row["last_seen"] = T0 + i * 0.05  # 20 a second, as a tunnel asks
    names.append(name_row("git.tunnel-op.net"))
    policy, text = learned(names, [])
    assert [r.pattern.text for r in policy.dns.allow] == ["git.tunnel-op.net"]
    assert "# RISK: under tunnel-op.net, which the tunnel scorer flags" in text
    assert "(200 names)" in text and text.count(".t.tunnel-op.net  # 1 query") == 200
    assert "git.tunnel-op.net: kept, though under tunnel-op.net" in text


def test_a_shared_address_gives_its_port_only_to_the_name_its_flows_asked_for() -> None:
    """Two names, one address (a CDN): the first bytes said which one was connected to."""
    row = connect_row("203.0.113.12", 80, ["npm.example.com", "www.example.com"])
    row["asked"] = ["www.example.com"]
    tls = connect_row("203.0.113.12", 443, ["npm.example.com", "www.example.com"])
    tls["asked"] = ["npm.example.com"]
    policy, _ = learned([name_row("npm.example.com"), name_row("www.example.com")], [row, tls])
    ports = {r.pattern.text: [str(p) for p in r.ports.tcp] for r in policy.dns.allow}
    assert ports == {"npm.example.com": ["443"], "www.example.com": ["80"]}
    row.pop("asked")  # not read (a port outside connect.check_names): both names get it
    policy, _ = learned([name_row("npm.example.com"), name_row("www.example.com")], [row])
    assert all([str(p) for p in r.ports.tcp] == ["80"] for r in policy.dns.allow)


def test_a_flow_asking_for_a_name_its_address_never_answered_is_a_risk() -> None:
    row = connect_row("203.0.113.12", 443, ["npm.example.com"])
    row["asked"] = ["other.example.org"]
    _, text = learned([name_row("npm.example.com")], [row])
    assert "asked for other.example.org, which no answer for this address named" in text


def test_a_destination_no_answer_named_is_a_flagged_static_entry() -> None:
    policy, text = learned(
        [], [connect_row("192.0.2.7", 8443, []), connect_row("192.0.2.7", 9, [], "udp")]
    )
    got = sorted((str(r.network), [str(p) for p in r.ports.tcp], [str(p) for p in r.ports.udp])
                 for r in policy.connect.allow)  # fmt: skip
    assert got == [("192.0.2.7/32", [], ["9"]), ("192.0.2.7/32", ["8443"], [])]
    assert text.count("# FLAGGED: no DNS answer named 192.0.2.7") == 2


def test_the_cap_being_reached_is_said_in_the_policy() -> None:
    _, text = learned([name_row("a.example.com")], [], overflow={"names": 12, "connects": 0})
    assert "WARNING: the audit record was full (cap reached): 12 queries" in text


def test_a_base_keeps_its_settings_and_rules_and_what_it_allows_is_not_added() -> None:
    base_text = """apiVersion: egress/v1
kind: Policy
metadata: {name: team}
spec:
  mode: audit
  dns:
    upstreams: ["192.0.2.53"]
    ttl: {min: 10s, max: 30m}
    allow: [{name: pypi.org, ports: [443]}]
  violations: {denied_name: freeze}
"""
    draft, text = with_base(base_text, [name_row("pypi.org"), name_row("new.example.com")],
                            [connect_row("203.0.113.11", 443, ["pypi.org"])])  # fmt: skip
    assert draft.in_base == ("pypi.org",)
    policy, _ = parse_policy(text, "out.yaml")
    assert policy.mode.value == "enforce" and policy.dns.ttl_min == 10
    assert [r.pattern.text for r in policy.dns.allow] == ["pypi.org", "new.example.com"]
    assert policy.action(ViolationClass.DENIED_NAME) is Action.FREEZE  # the base's own
    assert "Already allowed by the base policy: pypi.org." in text


def test_diff_says_what_to_add_remove_and_which_risks_the_policy_allows() -> None:
    current, _ = parse_policy("""apiVersion: egress/v1
kind: Policy
metadata: {name: cur}
spec:
  dns:
    allow: [pypi.org, unused.example.com, "**.t.lab.test"]
  connect: {ports: [80], allow: [{cidr: 198.51.100.0/24}]}
""", "cur.yaml")  # fmt: skip
    seen = collect([name_row("pypi.org"), name_row("new.example.com"), name_row(TUNNEL)],
                   [connect_row("203.0.113.11", 443, ["pypi.org"])])  # fmt: skip
    lines = against(make_draft(seen), seen, current)
    text = "\n".join(lines)
    assert "+ pypi.org: port tcp/443 (dns.allow[0] pypi.org allows tcp 80)" in text
    assert "+ new.example.com: A (no rule matches 'new.example.com')" in text
    assert "- dns.allow[1] unused.example.com (cur.yaml:6:23): no audit query needed it" in text
    assert f"! {TUNNEL}: the policy allows it, but tunnel-shaped" in text
    assert "- connect.allow[0] 198.51.100.0/24" in text
    assert all(line[0] in "+-!" for line in lines)


# -- what an upstream or a workload in audit mode could push the learner into (review) --


def test_a_cname_target_is_judged_like_an_asked_name_and_never_a_pattern_sibling() -> None:
    """The upstream picks the chain: a target with a '*', four targets under one parent,
    a tunnel-shaped target. None may become a pattern or be allowed unjudged."""
    rows = [name_row("www.evil.com", chain=("*.evil.com",)),
            name_row("api.evil.com", chain=tuple(f"t{i}.cdn.evil.com" for i in range(4))),
            name_row("git.example.org", chain=(TUNNEL,)),
            name_row("ok.example.net", chain=("edge.cdn.example.net",))]  # fmt: skip
    policy, text = learned(rows, [])
    patterns = {r.pattern.text for r in policy.dns.allow}
    assert patterns == {"api.evil.com", *(f"t{i}.cdn.evil.com" for i in range(4)),
                        "ok.example.net", "edge.cdn.example.net"}, text  # fmt: skip
    assert "a CNAME target of www.evil.com: not a host name" in text
    assert "its answers lead through *.evil.com, set aside" in text
    assert f"its answers lead through {TUNNEL}, set aside" in text


def test_no_pattern_covers_a_risk_or_a_zone_the_tunnel_scorer_flags() -> None:
    import random

    rng = random.Random(3)
    risky = [name_row(f"{x}.evil.com") for x in ("www", "api", "cdn", "mail")]
    risky.append(name_row(TUNNEL.replace(".t.lab.test", ".evil.com")))
    policy, _ = learned(risky, [])
    assert "*.evil.com" not in {r.pattern.text for r in policy.dns.allow}  # it covers the risk
    chars = "abcdefghijklmnopqrstuvwxyz0123456789"
    tunnel = [name_row("".join(rng.choice(chars) for _ in range(50)) + ".t.tunnel-op.net")
              for _ in range(80)]  # fmt: skip
    for i, row in enumerate(tunnel):
        row["first_seen"] = row["last_seen"] = T0 + i * 0.05
    plain = [name_row(f"{a}.{b}.tunnel-op.net") for a, b in zip("abcd", "wxyz", strict=True)]
    policy, text = learned(tunnel + plain, [])
    assert {r.pattern.text for r in policy.dns.allow} == {r["name"] for r in plain}, text


def test_icmp_and_inside_destinations_are_risks_not_static_entries() -> None:
    rows = [connect_row("169.254.169.254", 80, []), connect_row("127.0.0.1", 22, []),
            connect_row("10.0.0.5", 5432, []), connect_row("192.0.2.9", 443, [])]  # fmt: skip
    icmp = connect_row("192.0.2.9", 0, [])
    icmp["proto"] = "icmp"
    policy, text = learned([], [*rows, icmp])
    assert [str(r.network) for r in policy.connect.allow] == ["192.0.2.9/32"]
    assert "# - 169.254.169.254 tcp/80" in text and "# - 127.0.0.1 tcp/22" in text
    assert "# - 10.0.0.5 tcp/5432" in text and "protocol icmp: egress allows TCP and UDP" in text


def test_a_base_whose_rules_use_connect_ports_keeps_them() -> None:
    base_text = """apiVersion: egress/v1
kind: Policy
metadata: {name: team}
spec:
  dns: {allow: [foo.example.com]}
  connect: {ports: [8443]}
"""
    draft, text = with_base(base_text, [name_row("foo.example.com"), name_row("bar.example.com")],
                            [connect_row("203.0.113.5", 8443, ["foo.example.com"])])  # fmt: skip
    assert draft.in_base == ("foo.example.com",)
    policy, _ = parse_policy(text, "out.yaml")
    assert [str(p) for p in policy.connect.ports.tcp] == ["8443"]  # foo still reaches 8443
    assert "it takes the base's connect.ports" in text


def test_a_pattern_is_marked_for_review_with_the_names_that_made_it() -> None:
    policy, text = learned([name_row(f"{x}.cdn.example.com") for x in "abcd"], [])
    assert [r.pattern.text for r in policy.dns.allow] == ["*.cdn.example.com"]
    assert "# REVIEW: a pattern: every such name under cdn.example.com is allowed" in text
    assert "4 names seen (a.cdn.example.com, b.cdn.example.com" in text

"""egress.native: a package's compiled modules are used only while they match the
sources, and decide exactly as the sources do (the tunnel scorer, the NFLOG walk, the
resolver core, the observer's sift)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from egress.datapath.native import NATIVE as DATAPATH
from egress.native import Native
from egress.observer.native import NATIVE as OBSERVER
from egress.resolver.native import NATIVE as RESOLVER
from egress.tunnel.native import NATIVE as TUNNEL

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(params=[TUNNEL, DATAPATH, RESOLVER, OBSERVER], ids=lambda n: n.package)
def tree(request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Native:
    """A copy of a package's modules' sources, and a ``Native`` of them."""
    real: Native = request.param
    for name in real.modules:
        shutil.copy2(real.here / f"{name}.py", tmp_path / f"{name}.py")
    monkeypatch.delenv("EGRESS_NATIVE", raising=False)
    return Native(real.package, tmp_path, real.modules)


def fake_build(tree: Native, sources: str | None = None) -> None:
    """A ``_native/`` as the build leaves it: one file per module and the shared library,
    and the stamp of the sources and of each file."""
    tree.build.mkdir(mode=0o755)
    lines = [tree.digests() if sources is None else sources]
    for name in [*tree.modules, "native_core__mypyc"]:
        (tree.build / f"{name}.so").write_bytes(name.encode() * 100)
        digest = hashlib.sha256((tree.build / f"{name}.so").read_bytes()).hexdigest()
        lines.append(f"{digest}  {name}.so\n")
    tree.stamp.write_text("".join(lines), encoding="ascii")


def test_a_build_is_used_only_while_it_matches_the_sources(tree: Native) -> None:
    path = ["/pkg"]
    assert not tree.fresh() and not tree.activate(path) and path == ["/pkg"]  # no build
    fake_build(tree)
    assert tree.activate(path) and path == [str(tree.build), "/pkg"]

    with (tree.here / f"{tree.modules[-1]}.py").open("a") as f:  # edited after the build
        f.write("# edited\n")
    path = ["/pkg"]
    assert not tree.fresh() and not tree.activate(path) and path == ["/pkg"]


@pytest.mark.parametrize("damage", ["changed", "missing", "unlisted", "writable", "interpreter"])
def test_a_damaged_or_foreign_build_is_not_used(tree: Native, damage: str) -> None:
    if damage == "interpreter":
        other = tree.digests().replace(sys.implementation.cache_tag, "cpython-399", 1)
        fake_build(tree, other)
    else:
        fake_build(tree)
    assert tree.fresh() or damage == "interpreter"
    so = tree.build / f"{tree.modules[-1]}.so"
    if damage == "changed":
        so.write_bytes(b"something else")
    elif damage == "missing":
        so.unlink()
    elif damage == "unlisted":  # the stamp names one file fewer than the build has
        lines = tree.stamp.read_text(encoding="ascii").splitlines(keepends=True)
        tree.stamp.write_text("".join(lines[:-1]), encoding="ascii")
    elif damage == "writable":
        tree.build.chmod(0o777)
    assert not tree.fresh()


def test_a_build_is_stale_once_a_module_it_imports_changes(tmp_path: Path) -> None:
    """Compiled code checks values against the declarations it was compiled with: a
    function of egress it calls, changed since, would get a TypeError from it."""
    top = tmp_path / "egress"
    (top / "pkg").mkdir(parents=True)
    (top / "__init__.py").write_text("")
    (top / "pkg" / "__init__.py").write_text("")
    (top / "pkg" / "hot.py").write_text("from egress.dep import f\nfrom ..other import deeper\n")
    (top / "dep.py").write_text("from egress import leaf\ndef f() -> bool: ...\n")
    (top / "leaf.py").write_text("import os\n")
    (top / "other").mkdir()
    (top / "other" / "__init__.py").write_text("")
    (top / "other" / "deeper.py").write_text("")
    (top / "unrelated.py").write_text("")
    tree = Native("egress.pkg", top / "pkg", ("hot",))
    deps = tree.dependencies()
    assert deps == ("__init__.py", "dep.py", "leaf.py", "other/__init__.py", "other/deeper.py")
    fake_build(tree, tree.digests(deps=deps))
    assert tree.fresh()
    (top / "unrelated.py").write_text("x = 1\n")
    assert tree.fresh()
    (top / "leaf.py").write_text("import os, sys\n")  # imported through dep.py
    assert not tree.fresh()
    (top / "leaf.py").write_text("import os\n")
    assert tree.fresh()
    (top / "dep.py").unlink()
    assert not tree.fresh()


def test_switched_off_a_fresh_build_is_not_used(
    tree: Native, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake_build(tree)
    monkeypatch.setenv("EGRESS_NATIVE", "0")
    path: list[str] = []
    assert tree.fresh() and not tree.activate(path) and path == []


# Replays channels and tool samples through a fresh scorer and prints every verdict with
# its figures: what the compiled modules decide must be what the sources decide.
REPLAY = r"""
import json, random, sys
sys.path[:0] = [sys.argv[1], sys.argv[1] + "/tests/unit"]
from test_tunnel_samples import SAMPLES, read_samples
from egress.model import TunnelSpec
from egress.tunnel import TunnelScorer, native
from tests.support import channels as ch

class Clock:
    now = 1_800_000_000.0
    def __call__(self):
        return self.now

out = {"in_use": native.in_use(), "runs": []}
payload = random.Random(7).randbytes(4000)
streams = []
for c in ch.all_channels():
    zones = [f"t.example{i}.com" for i in range(c.zones)] if c.zones > 1 else ["exfil-lab.com"]
    streams.append(c.queries(payload, zones))
streams += [read_samples(path) for path in sorted(SAMPLES.glob("*.txt"))]
for queries in streams:
    clock = Clock()
    scorer = TunnelScorer(TunnelSpec(), clock)
    for name, qtype in queries:
        clock.now += 0.01
        if scorer.observe_query(name, qtype) is None:
            scorer.observe_response(name, 0)
    out["runs"].append([[v.zone, v.name, v.queries_before, v.bytes_before, v.unique_before,
                         [[c.rule, round(c.value, 6), c.limit] for c in v.reasons]]
                        for v in scorer.verdicts])
print(json.dumps(out))
"""


# Walks damaged and whole NFLOG buffers (tests/support/nflog.py's) and prints what it found.
WALK = r"""
import json, random, sys
sys.path[:0] = [sys.argv[1]]
from tests.support.nflog import PACKET, QUERY, copy
from egress.datapath.native import NATIVE
from egress.datapath.nflog_wire import udp4_payload, walk

rng = random.Random(23)
base = [copy(b"egress dns", QUERY), copy(b"egress dns answer", QUERY + b"\1" * 40),
        copy(None, None)]
out = {"in_use": NATIVE.in_use(), "runs": []}
for _ in range(3000):
    buf = bytearray(b"".join(rng.choice(base) for _ in range(rng.randint(1, 4))))
    for _ in range(rng.randint(0, 6)):
        buf[rng.randrange(len(buf))] = rng.randrange(256)
    found = walk(bytes(buf), PACKET)
    out["runs"].append([[k, s, e, p.hex(), d.hex(), (udp4_payload(d) or b"-").hex()]
                        for k, s, e, p, d in found])
print(json.dumps(out))
"""


# Drives one resolver core (with its tunnel scorer, two upstreams) through queries
# (allowed, denied, malformed, repeated, asked again while upstream, over TCP, without
# EDNS for answers too long for 512 bytes) and upstream answers (addresses, CNAMEs to
# other names, rebinding, refusals, other types, bytes damaged at random, set updates
# refused or late), with the policy swapped to audit mode halfway, and prints every action
# it asks for: the compiled core must ask for exactly what the sources ask for.
RESOLVE = r"""
import json, random, sys
sys.path[:0] = [sys.argv[1]]
from dnslib import AAAA, CNAME, MX, QTYPE, RR, SOA, TXT, A, DNSRecord, EDNS0
from egress.policy import parse_policy
from egress.resolver import native
from egress.resolver.actions import AllowThenReply, Forward, Reply, Report, Revoke
from egress.resolver.core import ResolverCore
from egress.tunnel import scorer_for

POLICY = '''
apiVersion: egress/v1
kind: Policy
metadata: {name: t}
spec:
  dns:
    upstreams: ["192.0.2.53"]
    ttl: {min: 5s, max: 1h}
    allow:
      - allowed.test
      - {name: "*.cdn.test", types: [A, AAAA, TXT, MX]}
      - {name: api.test, types: [A], ports: [443]}
'''

def show(a):
    if isinstance(a, Reply):
        return ["reply", a.client, a.data.hex()]
    if isinstance(a, Forward):
        return ["forward", a.token, a.upstream, a.data.hex(), a.tcp]
    if isinstance(a, Report):
        v = a.violation
        return ["report", v.cls.value, v.layer, v.rule, v.detail, v.at]
    if isinstance(a, Revoke):
        return ["revoke", repr(a.update)]
    return ["allow", a.token, repr(a.update), repr(a.adds), a.qname, a.qtype,
            [str(ip) for ip in a.ips],
            [[r.client, r.data.hex(), r.fallback.hex()] for r in a.replies]]

rng = random.Random(11)
now = 1_800_000_000.0
policy, _ = parse_policy(POLICY, "t.yaml")
scorer = scorer_for(policy.tunnel, lambda: now)
core = ResolverCore(policy, 2, random.Random(7).getrandbits, scorer=scorer, monotonic=lambda: now)
audit, _ = parse_policy(POLICY.replace("spec:", "spec:\n  mode: audit"), "audit.yaml")
names = ["allowed.test", "api.test", "denied.test", "www.cdn.test", "x1.cdn.test",
         "Mixed.CDN.test", "a.b.c.cdn.test", "k9xq2v7z3b8n.cdn.test"]
types = ["A", "AAAA", "TXT", "MX", "CNAME", "ANY", "SRV"]
records = [
    lambda n: RR(n, QTYPE.A, rdata=A("198.51.100.%d" % rng.randint(1, 250)),
                 ttl=rng.choice([0, 3, 60, 86400])),
    lambda n: RR(n, QTYPE.AAAA, rdata=AAAA("2001:db8::%x" % rng.randint(1, 999)), ttl=60),
    lambda n: RR(n, QTYPE.A, rdata=A("10.0.0.%d" % rng.randint(1, 250)), ttl=60),
    lambda n: RR(n, QTYPE.CNAME, rdata=CNAME(rng.choice(names)), ttl=30),
    lambda n: RR(n, QTYPE.TXT, rdata=TXT("v=%d" % rng.randint(0, 9)), ttl=30),
    lambda n: RR(n, QTYPE.MX, rdata=MX("mail." + n), ttl=30),
]
soa = SOA("ns.cdn.test", "h.cdn.test", (1, 2, 3, 4, 5))
out = {"in_use": native.NATIVE.in_use(), "runs": []}
for i in range(2500):
    if i == 1250:
        core.set_policy(audit)
    now += rng.choice([0.001, 0.01, 0.5, 2.0])
    q = DNSRecord.question(rng.choice(names), rng.choice(types))
    q.header.id = rng.getrandbits(16)
    if rng.random() < 0.3:
        q.add_ar(EDNS0(udp_len=rng.choice([512, 1232, 4096])))
    data = bytearray(q.pack())
    if rng.random() < 0.05:
        data[rng.randrange(len(data))] = rng.randrange(256)
    data = bytes(data)
    tcp = rng.random() < 0.1
    replayed = None if tcp else core.replay(data, now)
    run = [["replay", None if replayed is None else replayed.hex()]]
    asked = core.on_query(data, "c%d" % i, tcp, now)
    if rng.random() < 0.2:  # asked again while the first is upstream: it waits with it
        asked += core.on_query(data, "again%d" % i, tcp, now)
    for a in asked:
        run.append(show(a))
        if not isinstance(a, Forward):
            continue
        try:
            up = DNSRecord.parse(a.data)
        except Exception:  # audit forwards a name dnslib cannot read: no answer comes
            run += [show(b) for b in core.on_upstream_failure(a.token, now)]
            continue
        r = up.reply()
        r.header.rcode = rng.choice([0, 0, 0, 0, 2, 3, 5])
        qn = str(up.q.qname).rstrip(".")
        for _ in range(rng.choice([0, 1, 2, 3, 4, 40])):
            r.add_answer(rng.choice(records)(qn))
        if rng.random() < 0.2:
            r.add_auth(RR("cdn.test", QTYPE.SOA, rdata=soa, ttl=60))
        raw = bytearray(r.pack())
        for _ in range(rng.choice([0, 0, 0, 1, 3])):
            raw[rng.randrange(len(raw))] = rng.randrange(256)
        acts = core.on_upstream_reply(a.token, bytes(raw), now)
        run += [show(b) for b in acts]
        for b in acts:
            if isinstance(b, AllowThenReply):
                acked = rng.choice([len(b.adds), len(b.adds), 0])
                late = rng.random() < 0.05
                run += [show(c) for c in core.on_allowed(b.token, acked, now, late=late)]
        if a.token in core.pending:
            run += [show(b) for b in core.on_upstream_failure(a.token, now)]
    out["runs"].append(run)
out["stats"] = core.stats
print(json.dumps(out))
"""


# Hands the observer's sift datagrams of copies (repeats of queries judged allowed, and
# queries not judged, and queries judged longer ago than REPLAY_S; answers, allowed and
# not, over UDP and TCP, damaged; other prefixes) on clocks that advance by milliseconds
# to seconds, handing it the rest after each copy it stops at (which would be an event),
# and prints how many it dealt with each time and what the bindings hold.
SIFT = r"""
import ipaddress, json, random, struct, sys
sys.path[:0] = [sys.argv[1]]
from dnslib import QTYPE, RR, A, DNSRecord
from egress.observer import native
from egress.observer.answers import Answers
from egress.observer.replays import REPLAY_S, QueryReplays
from egress.observer.sift import ANSWER_PREFIX, DNS_PREFIX, sift
from egress.policy import parse_policy
from egress.policy.matcher import Matcher
from egress.resolver.bindings import Bindings

POLICY = '''
apiVersion: egress/v1
kind: Policy
metadata: {name: t}
spec:
  dns: {upstreams: ["192.0.2.53"], allow: [allowed.test, "*.cdn.test"]}
  connect: {ports: [443]}
'''

def ip4(proto, payload):
    return struct.pack("!BBHHHBBH4s4s", 0x45, 0, 20 + len(payload), 1, 0x4000, 64, proto, 0,
                       bytes([10, 0, 0, 2]), bytes([127, 0, 0, 53])) + payload

def udp(sport, dport, data):
    return ip4(17, struct.pack("!HHHH", sport, dport, 8 + len(data), 0) + data)

rng = random.Random(5)
policy, _ = parse_policy(POLICY, "t.yaml")
bindings = Bindings()
queries, answers = QueryReplays(), Answers(policy, Matcher(policy), bindings)
names = ["allowed.test", "www.cdn.test", "x.cdn.test", "denied.test", "a.b.cdn.test"]
ips = ["198.51.100.%d" % i for i in range(1, 9)]
now, wall = 100.0, 1_800_000_000.0
out = {"in_use": native.NATIVE.in_use(), "runs": []}

def question(qtype):
    q = DNSRecord.question(rng.choice(names), qtype)
    q.header.id = rng.getrandbits(16)
    return q

def answer():
    r = question("A").reply()
    for _ in range(rng.choice([0, 1, 2])):
        r.add_answer(RR(str(r.q.qname), QTYPE.A, rdata=A(rng.choice(ips)),
                        ttl=rng.choice([0, 5, 60])))
    data = bytearray(r.pack())
    if rng.random() < 0.1:
        data[rng.randrange(len(data))] = rng.randrange(256)
    return bytes(data)

for i in range(3000):
    now += rng.choice([0.001, 0.02, 0.3, 1.5])
    wall += rng.choice([0.001, 0.02, 0.3, 1.5, 30.0])
    copies = []
    for _ in range(rng.randint(1, 12)):
        kind = rng.random()
        if kind < 0.45:
            data = bytes(question(rng.choice(["A", "AAAA", "TXT"])).pack())
            packet = udp(rng.randint(1024, 65535), 53, data)
            if rng.random() < 0.8:
                queries.remember(packet, data, now - rng.choice([0.0, 0.5, REPLAY_S + 1.0]))
            copies.append((0, 0, 0, DNS_PREFIX, packet))
        elif kind < 0.85:
            packet = udp(53, 40000, answer())
            if rng.random() < 0.05:
                packet = ip4(6, packet[20:])
            copies.append((0, 0, 0, ANSWER_PREFIX, packet))
        else:
            copies.append((0, 0, 0, rng.choice([b"", b"egress first_bytes\0"]), udp(1, 2, b"x")))
    run = []
    while copies:
        dealt = sift(copies, queries, answers, now, wall)
        run.append(dealt)
        copies = copies[dealt + 1:]  # the one it stopped at became an event
        if rng.random() < 0.1:
            queries.clear()
    run.append([list(bindings.names(ipaddress.ip_address(ip), wall)) for ip in ips])
    run += [len(queries), len(answers), bindings.changes]
    out["runs"].append(run)
print(json.dumps(out))
"""


def replay(script: str, native_on: bool) -> dict[str, object]:
    # One hash seed for both: the tables' collisions (and so the last digits of a price)
    # follow str hashes, which are per process otherwise.
    env = {**os.environ, "EGRESS_NATIVE": "1" if native_on else "0", "PYTHONHASHSEED": "7"}
    done = subprocess.run(
        [sys.executable, "-c", script, str(ROOT)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    result: dict[str, object] = json.loads(done.stdout)
    return result


def test_the_compiled_scorer_decides_exactly_as_the_sources() -> None:
    runs = compare(TUNNEL, REPLAY)
    assert all(runs), "every stream should end in a verdict"


def test_the_compiled_walk_finds_exactly_what_the_sources_find() -> None:
    runs = compare(DATAPATH, WALK)
    assert sum(map(bool, runs)) > len(runs) // 2, "most buffers hold a message still"


def test_the_compiled_resolver_answers_exactly_as_the_sources() -> None:
    runs = compare(RESOLVER, RESOLVE)
    kinds = {action[0] for run in runs for action in run}  # type: ignore[union-attr]
    assert {"reply", "forward", "report", "allow", "revoke"} <= kinds, kinds
    acts = [action for run in runs for action in run]  # type: ignore[union-attr]
    assert any(a[0] == "replay" and a[1] for a in acts), "a repeat should be replayed"
    assert any(a[0] == "allow" and len(a[-1]) > 1 for a in acts), "one answer, two clients"
    assert any(a[0] == "reply" and int(a[2][4:8], 16) & 0x0200 for a in acts), "TC=1 to one"
    assert any(a[0] == "report" and a[1] == "tunnel" for a in acts), "a tunnel verdict"


def test_the_compiled_sift_deals_with_exactly_what_the_sources_deal_with() -> None:
    runs = compare(OBSERVER, SIFT)
    dealt = [n for run in runs for n in run[:-4]]  # type: ignore[index]
    assert 0 in dealt and any(n > 1 for n in dealt), "some copies dealt with, some not"
    bound = [names for run in runs for names in run[-4]]  # type: ignore[index]
    assert any(bound), "an answer should bind a name"


def compare(built: Native, script: str) -> list[object]:
    if not built.fresh():
        pytest.skip("no build of these sources: `make setup` compiles one")
    compiled, sources = replay(script, True), replay(script, False)
    assert (compiled["in_use"], sources["in_use"]) == ("compiled (mypyc)", "Python sources")
    runs = compiled["runs"]
    assert isinstance(runs, list) and runs == sources["runs"]
    return runs

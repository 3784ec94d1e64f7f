"""egress.native: a package's compiled modules are used only while they match the
sources, and decide exactly as the sources do (the tunnel scorer, the NFLOG walk)."""

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
from egress.tunnel.native import NATIVE as TUNNEL

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(params=[TUNNEL, DATAPATH], ids=lambda n: n.package)
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


def compare(built: Native, script: str) -> list[object]:
    if not built.fresh():
        pytest.skip("no build of these sources: `make setup` compiles one")
    compiled, sources = replay(script, True), replay(script, False)
    assert (compiled["in_use"], sources["in_use"]) == ("compiled (mypyc)", "Python sources")
    runs = compiled["runs"]
    assert isinstance(runs, list) and runs == sources["runs"]
    return runs

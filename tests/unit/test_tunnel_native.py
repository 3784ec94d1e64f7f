"""egress.tunnel.native: the compiled scorer is used only while it matches the sources,
and decides exactly as the sources do."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from egress.tunnel import native

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def tree(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A copy of the modules' sources, and ``native`` pointed at it."""
    for name in native.MODULES:
        shutil.copy2(native.HERE / f"{name}.py", tmp_path / f"{name}.py")
    monkeypatch.setattr(native, "HERE", tmp_path)
    monkeypatch.setattr(native, "BUILD", tmp_path / "_native")
    monkeypatch.setattr(native, "STAMP", tmp_path / "_native" / "SOURCES")
    monkeypatch.delenv("EGRESS_NATIVE", raising=False)
    return tmp_path


def fake_build(tree: Path, sources: str | None = None) -> None:
    """A ``_native/`` as the build leaves it: one file per module and the shared library,
    and the stamp of the sources and of each file."""
    build = tree / "_native"
    build.mkdir(mode=0o755)
    lines = [native.digests(tree) if sources is None else sources]
    for name in [*native.MODULES, "native_core__mypyc"]:
        (build / f"{name}.so").write_bytes(name.encode() * 100)
        digest = hashlib.sha256((build / f"{name}.so").read_bytes()).hexdigest()
        lines.append(f"{digest}  {name}.so\n")
    (build / "SOURCES").write_text("".join(lines), encoding="ascii")


def test_a_build_is_used_only_while_it_matches_the_sources(tree: Path) -> None:
    path = ["/pkg"]
    assert not native.fresh() and not native.activate(path) and path == ["/pkg"]  # no build
    fake_build(tree)
    assert native.activate(path) and path == [str(tree / "_native"), "/pkg"]

    with (tree / "vocab.py").open("a") as f:  # a source edited after the build
        f.write("# edited\n")
    path = ["/pkg"]
    assert not native.fresh() and not native.activate(path) and path == ["/pkg"]


@pytest.mark.parametrize("damage", ["changed", "missing", "writable", "interpreter"])
def test_a_damaged_or_foreign_build_is_not_used(tree: Path, damage: str) -> None:
    if damage == "interpreter":
        other = native.digests(tree).replace(sys.implementation.cache_tag, "cpython-399", 1)
        fake_build(tree, other)
    else:
        fake_build(tree)
    assert native.fresh() or damage == "interpreter"
    so = tree / "_native" / "vocab.so"
    if damage == "changed":
        so.write_bytes(b"something else")
    elif damage == "missing":
        so.unlink()
    elif damage == "writable":
        (tree / "_native").chmod(0o777)
    assert not native.fresh()


def test_switched_off_a_fresh_build_is_not_used(
    tree: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake_build(tree)
    monkeypatch.setenv("EGRESS_NATIVE", "0")
    path: list[str] = []
    assert native.fresh() and not native.activate(path) and path == []


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


def replay(native_on: bool) -> dict[str, object]:
    # One hash seed for both: the tables' collisions (and so the last digits of a price)
    # follow str hashes, which are per process otherwise.
    env = {**os.environ, "EGRESS_NATIVE": "1" if native_on else "0", "PYTHONHASHSEED": "7"}
    done = subprocess.run(
        [sys.executable, "-c", REPLAY, str(ROOT)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    result: dict[str, object] = json.loads(done.stdout)
    return result


def test_the_compiled_scorer_decides_exactly_as_the_sources() -> None:
    if not native.fresh():
        pytest.skip("no build of these sources: `make setup` compiles one")
    compiled, sources = replay(True), replay(False)
    assert (compiled["in_use"], sources["in_use"]) == ("compiled (mypyc)", "Python sources")
    runs = compiled["runs"]
    assert isinstance(runs, list) and all(runs), "every stream should end in a verdict"
    assert runs == sources["runs"]

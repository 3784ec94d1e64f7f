"""Per-zone overrides apply to the zone they name and everything under it, at whatever
label it sits (longest match), and `egressctl check` says which one applied.

Before, the scorer keyed zones on the registered domain only, so an override naming a
zone below it (``g.example.com`` under ``example.com``) was silently never consulted.
"""

from __future__ import annotations

import base64
import random
from pathlib import Path

import pytest

from egress.cli.main import main
from egress.model import TunnelSpec, TunnelZoneOverride
from egress.tunnel import TunnelScorer
from egress.tunnel.overrides import SPECIAL, Overrides


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def tunnel(zone: str, n: int = 400, seed: int = 7) -> list[str]:
    """Base32 data labels, as dns2tcp-like tools send them."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        data = base64.b32encode(rng.randbytes(30)).decode().rstrip("=").lower()
        out.append(f"{data}.{i}.{zone}")
    return out


def first_verdict(spec: TunnelSpec, names: list[str]) -> tuple[int, str] | None:
    clock = Clock()
    scorer = TunnelScorer(spec, clock)
    for i, name in enumerate(names):
        clock.now += 0.01
        verdict = scorer.observe_query(name, 16)
        if verdict is not None:
            return i, verdict.zone
    return None


def spec(*zones: TunnelZoneOverride) -> TunnelSpec:
    return TunnelSpec(zones=zones)


def test_a_zone_below_the_registered_domain_is_watched_though_its_parent_is_exempt() -> None:
    """exempt example.com, but not g.example.com: a tunnel under g.example.com is caught,
    as a zone of its own; one under the rest of example.com is not scored."""
    rules = spec(TunnelZoneOverride("example.com", exempt=True),
                 TunnelZoneOverride("g.example.com", exempt=False))  # fmt: skip
    caught = first_verdict(rules, tunnel("g.example.com"))
    assert caught is not None and caught[1] == "g.example.com", caught
    assert first_verdict(rules, tunnel("other.example.com")) is None


def test_an_exempt_zone_below_the_registered_domain_is_exempt_and_its_siblings_are_not() -> None:
    rules = spec(TunnelZoneOverride("cdn.example.com", exempt=True))
    assert first_verdict(rules, tunnel("cdn.example.com")) is None
    assert first_verdict(rules, tunnel("x.cdn.example.com")) is None  # everything under it
    caught = first_verdict(rules, tunnel("api.example.com"))
    assert caught is not None and caught[1] == "example.com"


def test_the_longest_matching_override_wins_and_scales_apply_below_the_registered_domain() -> None:
    plain = first_verdict(spec(), tunnel("a.b.example.com"))
    scaled = first_verdict(spec(TunnelZoneOverride("b.example.com", limit_scale=8.0)),
                           tunnel("a.b.example.com"))  # fmt: skip
    assert plain is not None and scaled is not None
    assert scaled[1] == "b.example.com" and scaled[0] > plain[0], (plain, scaled)
    o = Overrides([TunnelZoneOverride("example.com", exempt=True),
                   TunnelZoneOverride("b.example.com", exempt=False),
                   TunnelZoneOverride("a.b.example.com", limit_scale=2.0)])  # fmt: skip
    assert o.applied("x.a.b.example.com").zone == "a.b.example.com"
    deepest = TunnelZoneOverride("a.b.example.com", limit_scale=2.0)
    assert o.applied("x.a.b.example.com").override == deepest
    assert o.applied("x.b.example.com").override == TunnelZoneOverride("b.example.com")
    assert o.applied("x.example.com").override == TunnelZoneOverride("example.com", exempt=True)
    assert o.applied("X.B.Example.COM.").zone == "b.example.com"  # case and the root dot
    assert Overrides([]).applied("printer.local").override is SPECIAL


def test_check_prints_which_override_applied(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    policy = tmp_path / "p.yaml"
    policy.write_text(
        "apiVersion: egress/v1\nkind: Policy\nmetadata: {name: o}\nspec:\n"
        "  dns: {allow: ['*.example.com']}\n"
        "  tunnel:\n    zones:\n"
        "      - {zone: example.com, exempt: true}\n"
        "      - {zone: g.example.com, exempt: false}\n"
        "      - {zone: big.example.com, scale: 4}\n"
    )
    main(["check", str(policy), "a1.g.example.com", "A"])
    assert (
        "scored as its own zone: spec.tunnel.zones names g.example.com" in capsys.readouterr().out
    )
    main(["check", str(policy), "a1.big.example.com", "A"])
    assert "limits x4: spec.tunnel.zones scales big.example.com" in capsys.readouterr().out
    main(["check", str(policy), "a1.www.example.com", "A"])
    assert "not scored: spec.tunnel.zones exempts example.com" in capsys.readouterr().out

"""Issue 6 "Must hold": real DNS tunnels are frozen before 2 KB leaves, benign names never.

Each case runs `egressctl run` for real against the lab with the attacker's tools on both
ends (see tunnels.py for who runs where and what is measured). Bytes are counted where
they arrive: the lab DNS server's query log, the part of each name left of the tunnel
zone, every query it received for the zone, handshake included.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from egress.lab import Lab
from tests.support import channels
from tests.support import tunnels as tn
from tests.support.sandboxes import leftovers

pytestmark = [pytest.mark.privileged, pytest.mark.usefixtures("require_root")]


def assert_frozen_by_tunnel(out: tn.Outcome) -> None:
    assert out.freeze is not None, f"not frozen: {out.describe()}"
    assert out.freeze["confirmed_at"], out.freeze
    assert out.trigger is not None and out.trigger["class"] == "tunnel", out.describe()
    assert out.trigger["action"] == "freeze"


@pytest.mark.parametrize("encoding", tn.IODINE_ENCODINGS)
@pytest.mark.parametrize("qtype", tn.IODINE_TYPES)
def test_iodine_is_frozen_before_2_kb_and_carries_nothing(
    lab: Lab, qtype: str, encoding: str
) -> None:
    """iodine 0.7 as root in the sandbox, every query type and downstream encoding.

    iodine logs in within its first three queries (its tun gets 10.53.0.2 before any
    verdict can exist), so what must not happen is data: the prober on iodined's side,
    dialling the agent at 10.53.0.2 every 20 ms from before iodine starts, never connects
    (a connect there can only go through the tunnel), and iodined's tun never receives a
    packet from the client. One iodine run, as started; it may give up by itself.
    """
    out = tn.run_iodine(lab, qtype, encoding)
    assert out.bytes < tn.BUDGET, out.describe()
    assert out.data == [], out.describe()
    assert out.server_rx_packets == 0, out.describe()
    assert_frozen_by_tunnel(out)
    assert out.rc == 137, out.describe()
    assert leftovers(out.sandbox, lab.uplink_netns) == []


@pytest.mark.parametrize("qtype", ["TXT", "KEY"])
def test_dns2tcp_is_frozen_before_2_kb_and_carries_nothing(lab: Lab, qtype: str) -> None:
    """dns2tcp 0.5.2 as root in the sandbox, TXT and KEY queries (both allowed by the
    policy); the agent pushes an 8 KB secret into dns2tcpc's local port until it is taken,
    and the sink behind dns2tcpd counts what arrives."""
    out = tn.run_dns2tcp(lab, qtype)
    assert out.bytes < tn.BUDGET, out.describe()
    assert out.data == [], out.describe()
    assert_frozen_by_tunnel(out)
    assert out.rc == 137, out.describe()
    assert leftovers(out.sandbox, lab.uplink_netns) == []


@pytest.mark.parametrize("shape", tn.SLOW, ids=[s.name for s in tn.SLOW])
def test_slow_exfiltration_is_frozen_before_4_kb(lab: Lab, shape: tn.Trickle) -> None:
    """A real process with a real clock: the generator would move 8 KB if never stopped."""
    out = tn.run_exfil(lab, shape)
    assert_frozen_by_tunnel(out)
    assert out.bytes < 4096, out.describe()
    if shape.name.startswith("short-labels"):
        detail = out.trigger["detail"] if out.trigger else ""
        assert "information in new names" in detail and " in 30 s " in detail, out.describe()
    assert out.rc == 137, out.describe()
    assert leftovers(out.sandbox, lab.uplink_netns) == []


WORDS_16X8 = 0  # channels.all_channels()[0]: 8 words of 16 per name, the attack
BASE36 = [c.name for c in channels.all_channels()].index("base36 12")


def test_word_list_channel_is_frozen_before_1_kb_decoded(lab: Lab) -> None:
    """The issue's attack as the sandbox's own workload, 100 names a second: the payload
    bytes the attacker's nameserver can decode from every query it got stay under 1 KB
    (it would be 8 KB if nothing stopped it)."""
    assert channels.all_channels()[WORDS_16X8].name == "words 16x8"
    run = tn.run_channel(lab, WORDS_16X8, rate=100)
    out = run.outcome
    assert_frozen_by_tunnel(out)
    assert 0 < run.decoded <= 1024, (run.decoded, out.describe())
    assert "information in new names" in out.trigger["detail"], out.describe()
    assert out.rc == 137, out.describe()
    assert leftovers(out.sandbox, lab.uplink_netns) == []


def test_slow_channel_is_caught_by_the_slow_window(lab: Lab) -> None:
    """base36 chunks at one name a second stay under every 30 s limit; the slow window
    (shortened to 10 min, its limit to 512 B, so the test takes a minute and not an hour:
    the unit tests run the defaults over two hours of fake time) freezes it, with no more
    decoded at the lab server than that limit."""
    run = tn.run_channel(lab, BASE36, rate=1, cap=2048, tunnel=tn.SLOW_WINDOW_TUNNEL, timeout=180)
    out = run.outcome
    assert_frozen_by_tunnel(out)
    assert " in 10 min " in out.trigger["detail"], out.describe()
    assert 0 < run.decoded <= 512, (run.decoded, out.describe())
    assert out.rc == 137, out.describe()
    assert leftovers(out.sandbox, lab.uplink_netns) == []


def test_zones_asked_round_robin_are_frozen_at_their_first_return(lab: Lab) -> None:
    """An attacker's names spread round-robin over 1,000 zones (more than the 256 the
    scorer tracks), 200 a second: each zone's first names are within its allowance, and
    before 84cca9c each return after its eviction had a new one, so the sum over all
    zones let ~9,000 names (~240 KB) through. Now a zone back has what it sent taken off:
    frozen at the first returns. Counted at the lab DNS server: the names that reached it."""
    run = tn.run_zone_cycle(lab, zones=1_000, rate=200, count=3_000, timeout=90)
    assert run.freeze is not None and run.freeze["confirmed_at"], run.describe()
    assert run.trigger is not None and run.trigger["class"] == "tunnel", run.describe()
    assert "over all zones" in run.trigger["detail"], run.describe()
    # ~27 B of name each; the first 256 zones, made before the scorer's memory of names,
    # come back once as new zones: ~1,300 names (the unit test's fake clock: 1,292)
    assert 1_000 <= run.before <= 1_400, run.describe()
    assert run.names <= run.before + 2, run.describe()  # what was in flight, at most
    assert run.rc == 137, run.describe()


def test_benign_corpus_refused_upstream_is_never_a_tunnel(lab: Lab) -> None:
    """Both corpora (tests/data/benign_names.txt and benign_extra.txt, 5,984 lookups of
    1,407 names) through the sandbox's resolver, every name allowed exactly; the default
    lab refuses them all (REFUSED, counted with NXDOMAIN by the scorer's failure share):
    a sandbox whose upstream fails everything must not look like exfiltration that needs
    no answers.

    Pace: 40 names at 25/s, then a burst of 150 (16 in flight), 40 more, a burst of 400
    (32 in flight), over and over: the whole corpus in about 30 s, which puts far more
    names into each 30 s window than an agent would (conservative for false verdicts).
    """
    check_benign(lab, tn.run_benign(lab, tn.benign_policy(tn.corpus())), answered=False)


def test_benign_corpus_answered_is_never_a_tunnel(
    make_lab: Callable[..., Lab], tmp_path: Path
) -> None:
    """The same replay with a lab that answers every corpus name (addresses it serves,
    so the resolver also fills the sandbox's allow sets as in real life)."""
    queries = tn.corpus()
    zones = tmp_path / "benign-zones.yaml"
    zones.write_text(tn.benign_zones(queries))
    lab = make_lab(zones=zones)
    check_benign(lab, tn.run_benign(lab, tn.benign_policy(queries)), answered=True)


def check_benign(lab: Lab, run: tn.Replay, answered: bool) -> None:
    said = f"{run.summary} {run.stderr[-2000:]}"
    assert run.freeze is None, f"frozen: {run.freeze} {said}"
    assert [v for v in run.violations if v["class"] == "tunnel"] == [], said
    assert run.violations == [], [(v["class"], v["detail"]) for v in run.violations[:10]]
    assert run.rc == 0, said
    rcodes = run.summary["rcodes"]
    assert sum(rcodes.values()) == run.summary["queries"] == len(tn.corpus()), said
    assert set(rcodes) == ({"0"} if answered else {"5"}), said
    assert run.forwarded > 700, said  # the names went upstream (each one at least once)
    assert leftovers(run.sandbox, lab.uplink_netns) == []

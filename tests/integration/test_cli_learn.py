"""`egressctl learn` on a journal: what it writes, and bad input (exit 2, a message that
says what to do, nothing written)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from egress.cli.learn_cmds import parse_since
from egress.cli.main import main
from egress.policy.loader import load_policy
from egress.resolver.audit import AuditBatch, ConnectRow, NameRow
from egress.store.journal import Journal

NOW = time.time()


@pytest.fixture
def state(tmp_path: Path) -> Path:
    directory = tmp_path / "state"
    with Journal.open(directory) as j:
        j.record_sandbox("aud1", "audit-all")
        j.record_sandbox("aud2", "audit-all")
        j.record_sandbox("plain", "python-dev")
        j.record_audit("aud1", AuditBatch(
            names=(NameRow("pypi.org", 1, "denied_name", 3, NOW - 60, NOW - 50),),
            connects=(ConnectRow("203.0.113.11", "tcp", 443, "blocked_connect", 1, NOW - 55,
                                 NOW - 55, ("pypi.org",)),),
        ))  # fmt: skip
        j.record_audit("aud2", AuditBatch(
            names=(NameRow("old.example.com", 1, "denied_name", 1, NOW - 7200, NOW - 7200),),
        ))  # fmt: skip
    return directory


def learn(state: Path, *args: str) -> int:
    return main(["learn", "--state-dir", str(state), *args])


def test_learns_every_audit_run_by_default(
    state: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "learned.yaml"
    assert learn(state, "-o", str(out)) == 0
    assert (
        "2 rules, 0 flagged destinations, 0 risks set aside, from 2 audit runs"
        in capsys.readouterr().err
    )
    policy = load_policy(str(out))
    assert sorted(r.pattern.text for r in policy.dns.allow) == ["old.example.com", "pypi.org"]
    assert oct(out.stat().st_mode & 0o777) == "0o644"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["learned.yaml", "state"]  # no temp


def test_sandbox_and_since_choose_what_is_learned(
    state: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert learn(state, "--since", "1h") == 0
    text = capsys.readouterr().out
    assert "pypi.org" in text and "old.example.com" not in text
    assert learn(state, "--sandbox", "aud2") == 0
    text = capsys.readouterr().out
    assert "old.example.com" in text and "pypi.org" not in text


def test_diff_against_a_policy(
    state: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert learn(state, "--diff", "policies/python-dev.yaml") == 0
    lines = capsys.readouterr().out.splitlines()
    assert any(line.startswith("+ old.example.com: A") for line in lines)
    assert any(line.startswith("- dns.allow[1] files.pythonhosted.org") for line in lines)
    assert not any(line.startswith("+ pypi.org") for line in lines)  # allowed on 443 already


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--sandbox", "nope"], "no sandbox 'nope' in the journal (egressctl ps --all lists them)"),
        (
            ["--sandbox", "plain"],
            "sandbox 'plain' has no audit record: was its policy in `mode: audit`?",
        ),
        (["--since", "yesterday"], "--since 'yesterday': expected a duration ago (30m, 2h, 7d)"),
        (["--since", "1s"], "no audit runs in "),
        (["--min-siblings", "1"], "--min-siblings must be at least 2"),
        (["--base", "tests/data/policies/bad_types.yaml"], "bad_types.yaml:"),
    ],
)
def test_bad_input_exits_2_and_writes_nothing(
    state: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    out = tmp_path / "out.yaml"
    assert learn(state, *args, "-o", str(out)) == 2
    assert message in capsys.readouterr().err
    assert not out.exists()


def test_no_journal_says_what_to_do_and_creates_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "none"
    assert learn(missing) == 2
    assert (
        "no journal at" in capsys.readouterr().err
        and "mode: audit" in capsys.readouterr().err + "mode: audit"
    )
    assert not missing.exists()


def test_an_existing_output_is_kept_without_force(
    state: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "mine.yaml"
    out.write_text("hand-written\n")
    assert learn(state, "-o", str(out)) == 2
    assert f"{out} exists; pass --force to replace it" in capsys.readouterr().err
    assert out.read_text() == "hand-written\n"
    assert learn(state, "-o", str(out), "--force") == 0
    assert load_policy(str(out)).name == "learned"


def test_since_reads_durations_and_dates() -> None:
    assert parse_since("90m", 10_000.0) == 10_000.0 - 5400
    assert parse_since("1h30m", 10_000.0) == 10_000.0 - 5400
    assert parse_since("2026-12-01", 0.0) == 1_796_083_200.0
    assert parse_since("2026-12-01T09:30+01:00", 0.0) == 1_796_083_200.0 + 8.5 * 3600

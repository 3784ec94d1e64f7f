"""egressctl validate | check | schema, through the real entry point."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from egress.cli.main import main

ROOT = Path(__file__).resolve().parents[2]
PYTHON_DEV = str(ROOT / "policies" / "python-dev.yaml")
GIT = str(ROOT / "policies" / "git-https.yaml")
BAD = str(ROOT / "tests" / "data" / "policies" / "durations.yaml")
BAD_NAMES = str(ROOT / "tests" / "data" / "policies" / "bad_names.yaml")

WARNS = """\
apiVersion: egress/v1
kind: Policy
metadata: {name: warns}
spec:
  dns:
    allow: ["**.com"]
"""


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    status = main(list(argv))
    out, err = capsys.readouterr()
    return status, out, err


def test_validate_ok(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, err = run(capsys, "validate", PYTHON_DEV, GIT)
    assert status == 0
    assert out.splitlines() == [f"{PYTHON_DEV}: ok (2 rules)", f"{GIT}: ok (5 rules)"]
    assert err == ""


def test_validate_warnings_do_not_fail(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = tmp_path / "w.yaml"
    path.write_text(WARNS)
    status, out, err = run(capsys, "validate", str(path))
    assert status == 0
    assert out == f"{path}: ok (1 rule)\n"
    assert err == (
        f"{path}:6:13: warning: spec.dns.allow[0] **.com: "
        "this allows every name under the top-level domain 'com'\n"
    )


def test_validate_reports_every_problem_of_every_file(capsys: pytest.CaptureFixture[str]) -> None:
    missing = str(ROOT / "no-such.yaml")
    status, out, err = run(capsys, "validate", BAD, PYTHON_DEV, missing, BAD_NAMES)
    assert status == 2
    assert out == f"{PYTHON_DEV}: ok (2 rules)\n"
    lines = err.splitlines()
    assert lines[0] == f"{BAD}:6:16: spec.dns.ttl.min: duration '30' needs a unit: s, m or h"
    assert lines[1].startswith(f"{BAD}:6:25: spec.dns.ttl.max: invalid duration '2d'")
    assert lines[2] == f"{missing}: cannot read: No such file or directory"
    assert sum(line.startswith(f"{BAD_NAMES}:") for line in lines) == 10
    assert f"{BAD_NAMES}:15:9: warning: " in err
    assert "Traceback" not in err


def test_check_allow(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, err = run(capsys, "check", GIT, "Raw.GitHubUserContent.com.", "AAAA")
    assert status == 0
    assert out.splitlines() == [
        "allow",
        f"rule: dns.allow[3] *.githubusercontent.com ({GIT}:19:9)",
        "reason: matched dns.allow[3] *.githubusercontent.com (exactly one more label)",
        "ports: tcp 443",
    ]
    assert err == ""


def test_check_type_defaults_to_a(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = run(capsys, "check", PYTHON_DEV, "pypi.org")
    assert status == 0 and out.startswith("allow\n")


def test_check_deny_name(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = run(capsys, "check", PYTHON_DEV, "evil.com")
    assert status == 1
    assert out.splitlines() == ["deny", "rule: none", "reason: no rule matches 'evil.com'"]


def test_check_deny_type(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = run(capsys, "check", PYTHON_DEV, "pypi.org", "txt")
    assert status == 1
    assert out.splitlines() == [
        "deny",
        f"rule: dns.allow[0] pypi.org ({PYTHON_DEV}:26:9)",
        "reason: type TXT not allowed by dns.allow[0] pypi.org (allows A, AAAA, CNAME, HTTPS)",
    ]


def test_check_numeric_type(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = run(capsys, "check", PYTHON_DEV, "pypi.org", "65")
    assert status == 0 and out.startswith("allow\n")


def test_check_invalid_name_is_a_denial(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = run(capsys, "check", PYTHON_DEV, "a..pypi.org")
    assert status == 1
    assert "reason: invalid name 'a..pypi.org': empty label" in out


@pytest.mark.parametrize("qtype", ["TXTT", "0", "70000"])
def test_check_bad_type(capsys: pytest.CaptureFixture[str], qtype: str) -> None:
    status, out, err = run(capsys, "check", PYTHON_DEV, "pypi.org", qtype)
    assert status == 2 and out == ""
    assert err.startswith("egressctl check: ")


def test_check_bad_policy(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, err = run(capsys, "check", BAD, "pypi.org")
    assert status == 2 and out == ""
    assert err.splitlines()[0].startswith(f"{BAD}:6:16: ")


def test_check_missing_policy(capsys: pytest.CaptureFixture[str]) -> None:
    status, _, err = run(capsys, "check", "/nonexistent/p.yaml", "pypi.org")
    assert status == 2
    assert err == "/nonexistent/p.yaml: cannot read: No such file or directory\n"


def test_schema(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = run(capsys, "schema")
    assert status == 0
    schema = json.loads(out)
    assert schema["title"] == "egress policy v1"
    assert out.startswith('{\n  "$schema"')  # indent 2


@pytest.mark.parametrize("command", ["validate", "check", "schema"])
def test_help_has_an_example(capsys: pytest.CaptureFixture[str], command: str) -> None:
    with pytest.raises(SystemExit) as info:
        main([command, "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert f"egressctl {command}" in out.split("example", 1)[1]


def test_validate_needs_a_file(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["validate"])
    assert info.value.code == 2
    assert "FILE" in capsys.readouterr().err

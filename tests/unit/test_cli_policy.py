"""egressctl validate | check | schema, through the real entry point."""

from __future__ import annotations

import io
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
        "tunnel: Raw.GitHubUserContent.com. score 0.00 (zone raw.githubusercontent.com): "
        "nothing unusual",
    ]
    assert err == ""


def test_check_type_defaults_to_a(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = run(capsys, "check", PYTHON_DEV, "pypi.org")
    assert status == 0 and out.startswith("allow\n")


def test_check_deny_name(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = run(capsys, "check", PYTHON_DEV, "evil.com")
    assert status == 1
    assert out.splitlines() == [
        "deny",
        "rule: none",
        "reason: no rule matches 'evil.com'",
        "tunnel: evil.com score 0.00 (zone evil.com): nothing unusual",
    ]


def test_check_deny_type(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = run(capsys, "check", PYTHON_DEV, "pypi.org", "txt")
    assert status == 1
    lines = Path(PYTHON_DEV).read_text(encoding="utf-8").splitlines()
    line = next(n for n, text in enumerate(lines, 1) if text.startswith("      - pypi.org"))
    assert out.splitlines() == [
        "deny",
        f"rule: dns.allow[0] pypi.org ({PYTHON_DEV}:{line}:9)",
        "reason: type TXT not allowed by dns.allow[0] pypi.org (allows A, AAAA, CNAME, HTTPS)",
        "tunnel: pypi.org score 0.00 (zone pypi.org): nothing unusual",
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


# -- check: tunnel scoring -----------------------------------------------------------------

SAMPLES = ROOT / "tests" / "data" / "tunnel_samples"
BENIGN = ROOT / "tests" / "data" / "benign_names.txt"
LAB = """\
apiVersion: egress/v1
kind: Policy
metadata: {name: tunnel-lab}
spec:
  dns:
    allow:
      - pypi.org
      - {name: "**.evil-tunnel.com", types: [A, NULL]}
      - "**.example.com"
      - "**.internal"
"""


def lab(tmp_path: Path, tunnel: str = "") -> str:
    path = tmp_path / "lab.yaml"
    path.write_text(LAB + tunnel)
    return str(path)


def iodine_data_name() -> str:
    """The first data query (after the handshake) of the generated iodine base32 sample."""
    for line in (SAMPLES / "iodine_base32.txt").read_text().splitlines():
        if line.startswith("0"):
            return line.split()[0]
    raise AssertionError("no data query in the sample")


def test_check_benign_name_scores_nothing(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = run(capsys, "check", PYTHON_DEV, "files.pythonhosted.org", "AAAA")
    assert status == 0
    assert out.splitlines()[0] == "allow"
    assert out.splitlines()[-1] == (
        "tunnel: files.pythonhosted.org score 0.00 (zone pythonhosted.org): nothing unusual"
        " [limits x4: built in, pythonhosted.org is a provider zone]"
    )


def test_check_scores_a_search_list_expansion_as_the_name_itself(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    # As the scorer does for queries: the features, zone and note are those of the name
    # without the declared search domain, and the line says so.
    policy = lab(tmp_path, "  tunnel: {search_domains: [corp.example.com]}\n")
    name = "a1b2c3d4e5f60718.t.evil-tunnel.com.corp.example.com"
    status, out, _ = run(capsys, "check", policy, name)
    assert status == 0
    assert out.splitlines()[-1].startswith(
        f"tunnel: {name.removesuffix('.corp.example.com')} score "
    )
    assert "(zone evil-tunnel.com)" in out
    assert "[scored as a1b2c3d4e5f60718.t.evil-tunnel.com: spec.tunnel.search_domains" in out


def test_check_iodine_like_name_is_tunnel_shaped(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    name = iodine_data_name()
    status, out, _ = run(capsys, "check", lab(tmp_path), name, "NULL")
    assert status == 0  # the rules allow it; the scorer is what stops a tunnel
    lines = out.splitlines()
    assert lines[0] == "allow"
    assert lines[-1] == (
        f"tunnel: {name} score 6.50 (zone evil-tunnel.com): subdomain 230 B +2.00; "
        "label of 63 chars +1.50; random-looking label (1.00) +1.50; data-only type NULL +1.50 "
        "[tunnel-shaped: score >= name_score 3]"
    )


def test_check_tunnel_line_shows_what_the_policy_changes(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    tunnel = """\
  tunnel:
    enabled: false
    name_score: 8
    zones:
      - {zone: evil-tunnel.com, scale: 4}
      - {zone: example.com, exempt: true}
"""
    policy = lab(tmp_path, tunnel)
    cases = {
        iodine_data_name(): "[limits x4: spec.tunnel.zones scales evil-tunnel.com]",
        "a.b.example.com": "[not scored: spec.tunnel.zones exempts example.com]",
        "db.corp.internal": "[not scored: special-use name, never delegated]",
        "pypi.org": "",
    }
    for name, note in cases.items():
        status, out, _ = run(capsys, "check", policy, name, "NULL" if "evil" in name else "A")
        assert status == 0, name
        last = out.splitlines()[-1]
        assert "tunnel-shaped" not in last  # name_score 8 is above every score here
        assert last.endswith(f"{note} [detection off: spec.tunnel.enabled is false]".lstrip())


def write_names(tmp_path: Path, text: str) -> str:
    path = tmp_path / "names.txt"
    path.write_text(text)
    return str(path)


def test_names_replay_without_verdict(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    names = write_names(
        tmp_path,
        "# a pip session\npypi.org\nfiles.pythonhosted.org AAAA   # the file host\n\n"
        "Files.PythonHosted.org. 28\n",
    )
    status, out, err = run(capsys, "check", PYTHON_DEV, "--names", names)
    assert (status, err) == (0, "")
    assert out.splitlines() == [
        "allow  score  0.00  pypi.org A",
        "allow  score  0.00  files.pythonhosted.org AAAA"
        "  [limits x4: built in, pythonhosted.org is a provider zone]",
        "allow  score  0.00  Files.PythonHosted.org. AAAA"
        "  [limits x4: built in, pythonhosted.org is a provider zone]",
        "3 names: 3 allowed, 0 denied; no tunnel verdict",
    ]


def test_names_replay_with_a_denied_name_fails(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    names = write_names(tmp_path, "pypi.org\nevil.com\npypi.org TXT\n")
    status, out, _ = run(capsys, "check", PYTHON_DEV, "--names", names)
    assert status == 1
    assert out.splitlines() == [
        "allow  score  0.00  pypi.org A",
        "deny   score  0.00  evil.com A  (no rule matches 'evil.com')",
        "deny   score  0.00  pypi.org TXT  (type TXT not allowed by dns.allow[0] pypi.org "
        "(allows A, AAAA, CNAME, HTTPS))",
        "3 names: 1 allowed, 2 denied; no tunnel verdict",
    ]


def test_names_replay_catches_iodine(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    sample = SAMPLES / "iodine_base32.txt"
    queries = [line.split()[0] for line in sample.read_text().splitlines()[1:]]
    status, out, _ = run(capsys, "check", lab(tmp_path), "--names", str(sample))
    assert status == 1
    lines = out.splitlines()
    per_name, report = lines[: len(queries)], lines[len(queries) :]
    assert [line.split()[3] for line in per_name] == queries
    assert all(line.startswith("allow  score ") for line in per_name)
    assert per_name[5].endswith(" A")  # forwarded
    assert per_name[6].endswith(" A  <- tunnel verdict on evil-tunnel.com: not forwarded")
    assert all(
        line.endswith(" A  (not forwarded: tunnel verdict on evil-tunnel.com)")
        for line in per_name[7:]
    )
    assert report == [
        "verdict at name 7 (t=0.7s): DNS tunnel suspected under evil-tunnel.com",
        f"  query: {queries[6]} A (not forwarded)",
        "  score: 1.06 (largest value/limit of the limits crossed)",
        "  reason: shaped_names: tunnel-shaped names 3 in 30 s >= 3 (name score >= 3)",
        "  reason: name_info_bytes: information in new names 408 B in 30 s > 384 B",
        "  before: 6 queries forwarded, 444 B of subdomain text, 6 unique subdomains",
        "  types: A 6",
        f"{len(queries)} names: {len(queries)} allowed, 0 denied; 1 tunnel verdict",
    ]


def test_names_interval_is_the_fake_clock(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    sample = str(SAMPLES / "iodine_base32.txt")
    status, out, _ = run(capsys, "check", lab(tmp_path), "--names", sample, "--interval", "60")
    assert status == 1
    # One data name a minute never fills the 30 s window: the slow window catches it.
    assert "verdict at name 20 (t=1200s)" in out
    assert "  reason: slow_text_bytes: unique subdomain text 3,133 B in 1 h > 3,072 B" in out


def test_names_policy_thresholds_reach_the_scorer(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    sample = str(SAMPLES / "iodine_base32.txt")
    raised = lab(
        tmp_path,
        "  tunnel: {shaped_names: 100, long_text_bytes: 100000, name_info_bytes: 100000}\n",
    )
    status, out, _ = run(capsys, "check", raised, "--names", sample)
    assert status == 1
    assert "verdict at name 7 " not in out
    assert "  reason: info_bytes: " in out or "  reason: text_bytes: " in out
    exempt = lab(tmp_path, "  tunnel: {zones: [{zone: evil-tunnel.com, exempt: true}]}\n")
    status, out, _ = run(capsys, "check", exempt, "--names", sample)
    assert status == 0
    assert out.splitlines()[-1] == "52 names: 52 allowed, 0 denied; no tunnel verdict"
    off = lab(tmp_path, "  tunnel: {enabled: false}\n")
    status, out, _ = run(capsys, "check", off, "--names", sample)
    assert status == 0
    assert out.splitlines()[-1] == (
        "52 names: 52 allowed, 0 denied; tunnel detection off (spec.tunnel.enabled is false)"
    )


@pytest.mark.parametrize("corpus", [BENIGN, BENIGN.with_name("benign_extra.txt")])
def test_names_benign_corpus_has_no_verdict(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, corpus: Path
) -> None:
    queries = [line.split() for line in corpus.read_text().splitlines() if line[:1] != "#"]
    tlds = sorted({q[0].rstrip(".").rsplit(".", 1)[-1] for q in queries})
    types = "[A, AAAA, CNAME, HTTPS, TXT, SRV, PTR, MX, NS, CAA]"
    rules = "".join(f'      - {{name: "**.{tld}", types: {types}}}\n' for tld in tlds)
    policy = tmp_path / "all.yaml"
    policy.write_text(LAB.split("    allow:\n")[0] + "    allow:\n" + rules)
    status, out, _ = run(capsys, "check", str(policy), "--names", str(corpus))
    assert out.splitlines()[-1] == (
        f"{len(queries)} names: {len(queries)} allowed, 0 denied; no tunnel verdict"
    )
    assert status == 0


def test_names_from_stdin(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("sys.stdin", io.StringIO("pypi.org AAAA\n"))
    status, out, _ = run(capsys, "check", PYTHON_DEV, "--names", "-")
    assert status == 0
    assert out.splitlines()[0] == "allow  score  0.00  pypi.org AAAA"


def test_names_file_problems_are_all_reported(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    names = write_names(tmp_path, "a b c\npypi.org TXTT\nok.com\npypi.org 0\n")
    status, out, err = run(capsys, "check", BAD, "--names", names)
    assert (status, out) == (2, "")
    assert err.splitlines()[-3:] == [
        f"{names}:1: expected NAME [TYPE], got 3 fields",
        f"{names}:2: unknown record type 'TXTT' (did you mean TXT?)",
        f"{names}:4: record type 'TYPE0' is out of range: TYPE1 to TYPE65535",
    ]
    assert err.splitlines()[0].startswith(f"{BAD}:6:16: ")  # the policy's problems too


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("# only a comment\n\n", "no names (one a line: NAME [TYPE])"),
        (b"\xffpypi.org\n", "not UTF-8 text: invalid start byte at byte 0"),
        (None, "cannot read: No such file or directory"),
    ],
    ids=["empty", "binary", "missing"],
)
def test_names_file_unusable(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, content: str | bytes | None, message: str
) -> None:
    path = tmp_path / "names.txt"
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        path.write_text(content)
    status, out, err = run(capsys, "check", PYTHON_DEV, "--names", str(path))
    assert (status, out, err) == (2, "", f"{path}: {message}\n")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["pypi.org", "--names", "x.txt"], "give a NAME or --names FILE, not both"),
        ([], "give a NAME to check, or --names FILE to replay"),
        (["pypi.org", "--interval", "1"], "--interval only applies to --names"),
    ],
)
def test_check_argument_combinations(
    capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    status, out, err = run(capsys, "check", PYTHON_DEV, *argv)
    assert (status, out, err) == (2, "", f"egressctl check: {message}\n")


@pytest.mark.parametrize("interval", ["-1", "nan", "inf", "soon"])
def test_check_bad_interval(capsys: pytest.CaptureFixture[str], interval: str) -> None:
    with pytest.raises(SystemExit) as info:
        main(["check", PYTHON_DEV, "--names", "x.txt", "--interval", interval])
    assert info.value.code == 2
    assert f"expected seconds >= 0, like 0.1; got {interval!r}" in capsys.readouterr().err


def test_check_help_explains_names(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["check", "--help"])
    out = capsys.readouterr().out
    assert "egressctl check policies/python-dev.yaml --names queries.txt" in out
    assert "--interval SECONDS" in out and '"tunnel:" line' in out

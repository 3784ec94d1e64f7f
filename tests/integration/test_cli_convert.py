"""`egressctl import cilium` and `egressctl export cilium`: files written whole, nothing
written on a refusal (exit 2, every problem with FILE:LINE:COL), existing files kept."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from egress.cli.main import main
from egress.policy.loader import load_policy

ROOT = Path(__file__).resolve().parents[2]
MIXED = str(ROOT / "policies/cilium/clusterwide-mixed.yaml")
GITHUB = str(ROOT / "policies/cilium/fqdn-github.yaml")


def test_one_policy_to_a_file_that_validates(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "p.yaml"
    assert main(["import", "cilium", GITHUB, "-o", str(out)]) == 0
    assert f"{out}: written" in capsys.readouterr().err
    policy = load_policy(str(out))
    assert policy.name == "agent-github" and policy.connect.check_names == (443,)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.yaml"]  # no temporary file left


def test_several_policies_to_a_directory_or_stdout(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["import", "cilium", MIXED, "-o", str(tmp_path)]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["build-farm.yaml", "metrics-push.yaml"]
    assert load_policy(str(tmp_path / "metrics-push.yaml")).name == "metrics-push"
    capsys.readouterr()
    assert main(["import", "cilium", MIXED]) == 0
    out, err = capsys.readouterr()
    assert len([d for d in yaml.safe_load_all(out) if d]) == 2
    assert "2 policies; -o DIR writes one file each" in err
    assert main(["import", "cilium", MIXED, "-o", str(tmp_path / "one.yaml")]) == 2
    assert "2 policies need a directory" in capsys.readouterr().err


def test_refusals_exit_2_list_every_problem_and_write_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "bad.yaml"
    text = Path(GITHUB).read_text().replace('"*.githubusercontent.com"', '"raw-*.github.com"')
    bad.write_text(text + "---\nkind: Secret\n")
    out = tmp_path / "out"
    out.mkdir()
    assert main(["import", "cilium", str(bad), "-o", str(out)]) == 2
    err = capsys.readouterr().err.splitlines()
    assert [line.split(": ")[0] for line in err] == [
        f"{bad}:{n}" for n in ("26:31", "30:25", "38:15", "40:7")
    ]
    assert "kind 'Secret' is not a Cilium policy" in err[-1]
    assert list(out.iterdir()) == []


def test_existing_files_are_kept_unless_forced(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "p.yaml"
    out.write_text("mine\n")
    assert main(["import", "cilium", GITHUB, "-o", str(out)]) == 2
    assert "p.yaml exists; pass --force to replace" in capsys.readouterr().err
    assert out.read_text() == "mine\n"
    assert main(["import", "cilium", GITHUB, "-o", str(out), "--force", "--name", "gh"]) == 0
    assert load_policy(str(out)).name == "gh"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["import", "cilium", "/nonexistent.yaml"], "/nonexistent.yaml: cannot read"),
        (["import", "cilium", GITHUB, "--types", "A,TXTT"], "--types: unknown record type 'TXTT'"),
        (["import", "cilium", MIXED, "--name", "x"], "--name names one policy"),
        (["export", "cilium", "tests/data/policies/bad_types.yaml"], "bad_types.yaml:"),
        (
            ["export", "cilium", "policies/python-dev.yaml", "--selector", "app"],
            "expected KEY=VALUE",
        ),
    ],
)
def test_bad_input(args: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(args) == 2
    assert message in capsys.readouterr().err


def test_export_with_a_selector_and_kind(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    kind = "CiliumClusterwideNetworkPolicy"
    args = ["--selector", "app=agent", "--kind", kind, "--namespace", "ignored"]
    assert main(["export", "cilium", "policies/python-dev.yaml", *args]) == 0
    doc = yaml.safe_load(capsys.readouterr().out)
    assert doc["kind"] == "CiliumClusterwideNetworkPolicy" and "namespace" not in doc["metadata"]
    assert doc["spec"]["endpointSelector"] == {"matchLabels": {"app": "agent"}}
    audit = tmp_path / "audit.yaml"
    audit.write_text(
        Path("policies/python-dev.yaml").read_text().replace("mode: enforce", "mode: audit")
    )
    assert main(["export", "cilium", str(audit), "-o", str(tmp_path / "x.yaml")]) == 2
    assert "Cilium's audit mode is set per endpoint" in capsys.readouterr().err
    assert not (tmp_path / "x.yaml").exists()

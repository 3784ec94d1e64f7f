"""bench/figures.py: what the benchmarks record reaches the README's table, and only its
table; without EGRESS_BENCH_FIGURES a bench records nothing."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]


def figures() -> ModuleType:
    spec = importlib.util.spec_from_file_location("figures", ROOT / "bench" / "figures.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_records_reach_the_readme_table_and_nothing_else(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fig = figures()
    out = tmp_path / "figures.jsonl"
    monkeypatch.delenv(fig.ENV, raising=False)
    fig.record("bench_x", "unrecorded", "1 ms", "<= 1 ms", True)
    assert not out.exists()
    monkeypatch.setenv(fig.ENV, str(out))
    fig.record("bench_deployed", "cache hits", "63,155 qps (0.69x)", ">= 1.0x", False,
               "91,019 qps")  # fmt: skip
    fig.record("bench_egressd", "lost", "0", "0", True)
    readme = tmp_path / "README.md"
    readme.write_text(f"# egress\nbefore\n{fig.BEGIN}\nold table\n{fig.END}\nafter\n")
    assert fig.main([str(out), str(readme)]) == 0
    text = readme.read_text()
    assert text.startswith("# egress\nbefore\n") and text.endswith(f"{fig.END}\nafter\n")
    assert "old table" not in text
    rows = [line for line in text.splitlines() if line.startswith("| `bench")]
    assert rows == [
        "| `bench_deployed` | cache hits | 63,155 qps (0.69x) | 91,019 qps | >= 1.0x "
        "| **not met** |",
        "| `bench_egressd` | lost | 0 | - | 0 | met |",
    ]
    # A later run that recorded nothing leaves the table as it was.
    assert fig.main([str(tmp_path / "none.jsonl"), str(readme)]) == 0
    assert readme.read_text() == text


def test_a_readme_without_the_markers_is_refused(tmp_path: Path) -> None:
    fig = figures()
    out = tmp_path / "figures.jsonl"
    out.write_text('{"bench": "b", "what": "w", "measured": "m", "target": "t", "met": true, '
                   '"peer": ""}\n')  # fmt: skip
    readme = tmp_path / "README.md"
    readme.write_text("# no table here\n")
    with pytest.raises(SystemExit, match=r"no .* block"):
        fig.main([str(out), str(readme)])
    assert readme.read_text() == "# no table here\n"


def test_the_project_readme_has_the_block() -> None:
    fig = figures()
    text = (ROOT / "README.md").read_text()
    assert text.count(fig.BEGIN) == 1 and text.count(fig.END) == 1
    assert text.index(fig.BEGIN) < text.index(fig.END)

"""Issue 17's targets as the benchmarks last measured them: recorded, then written into
the README.

A bench calls ``record`` for each target it measures (its figure, the target, the peer's
figure of the same run where there is one, met or not). With EGRESS_BENCH_FIGURES set
(`make bench` sets it) each record is a JSON line appended to that file; without it,
``record`` does nothing and the bench only prints. `make bench` then runs this file,
which rewrites the README's table between its two markers from those lines:

    python bench/figures.py FIGURES.jsonl README.md

The rest of the README is left as it is; a run that recorded nothing leaves the table.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from pathlib import Path

ENV = "EGRESS_BENCH_FIGURES"
BEGIN = "<!-- figures: begin (written by `make bench`, bench/figures.py; edit bench/ instead) -->"
END = "<!-- figures: end -->"


def record(bench: str, what: str, measured: str, target: str, met: bool, peer: str = "") -> None:
    """One target's figure of this run (a no-op unless EGRESS_BENCH_FIGURES is set)."""
    path = os.environ.get(ENV)
    if not path:
        return
    row = {"bench": bench, "what": what, "measured": measured, "target": target,
           "met": met, "peer": peer}  # fmt: skip
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")


def table(rows: list[dict[str, object]], when: str, machine: str) -> str:
    """The markdown table of ``rows``, in the order they were recorded."""
    out = [
        f"Issue 17's targets, measured by `make bench` on {when} ({machine}):",
        "",
        "| bench | what | measured | dnsmasq `--nftset`, same run | target | |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        mark = "met" if r["met"] else "**not met**"
        out.append(f"| `{r['bench']}` | {r['what']} | {r['measured']} | {r['peer'] or '-'} "
                   f"| {r['target']} | {mark} |")  # fmt: skip
    return "\n".join(out)


def rewrite(readme: str, block: str) -> str:
    """``readme`` with the text between the markers replaced by ``block``."""
    try:
        head, rest = readme.split(BEGIN, 1)
        _, tail = rest.split(END, 1)
    except ValueError:
        raise SystemExit(f"the README has no {BEGIN!r} ... {END!r} block") from None
    return f"{head}{BEGIN}\n{block}\n{END}{tail}"


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__.split("\n\n")[2].strip(), file=sys.stderr)
        return 2
    figures, readme = Path(argv[0]), Path(argv[1])
    try:
        rows = [json.loads(line) for line in figures.read_text().splitlines() if line.strip()]
    except FileNotFoundError:
        rows = []
    if not rows:
        print(f"figures: nothing recorded in {figures}; the README's table is left as it was")
        return 0
    machine = f"{os.cpu_count()} vCPUs, kernel {platform.release()}"
    block = table(rows, time.strftime("%Y-%m-%d"), machine)
    readme.write_text(rewrite(readme.read_text(), block))
    print(f"figures: {len(rows)} rows written into {readme}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

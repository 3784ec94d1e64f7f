"""`egressctl learn`: a policy from what audit runs saw (egress.learn does the thinking).

Reads the journal's audit tables (written by the inline layer of sandboxes whose policy
says ``mode: audit``), never writes the journal, and writes the policy only once it is
complete and valid: to a temporary file beside -o, then renamed over it.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from egress.errors import InputError

FMT = argparse.RawDescriptionHelpFormatter
_AGO = re.compile(r"([0-9]+)([smhd])")
_UNIT = {"s": 1, "m": 60, "h": 3600, "d": 86400}

DESCRIPTION = """\
Write a policy from audit runs: run the workload under a policy with `mode: audit`
(everything is allowed and journaled), then learn what it needed.

The learned policy holds the least the runs needed: exact names as seen, a `*.` or `**.`
pattern only where at least --min-siblings names under one registered domain were seen
(never over a public suffix such as github.io), per name the record types asked and the
ports connected to, and `connect.allow` entries, flagged, for destinations no DNS answer
named. Every entry carries a comment: how often, when, in how many sandboxes.
Tunnel-shaped names, rebinding answers and data-only record types (TXT, NULL, ...) are
listed as risks, commented out: the learner never allows them."""

EPILOG = """\
examples:
  sudo egressctl run --policy audit.yaml -- ./agent-task.sh        # mode: audit
  egressctl learn -o learned.yaml                  # every audit run in the journal
  egressctl learn --sandbox 3f2a1c --sandbox 9b0e77 --since 2h --base audit.yaml -o p.yaml
  egressctl learn --diff policies/python-dev.yaml   # what learning would change, and why

exit status: 0 written (or the diff printed), 2 nothing to learn from or bad input
(nothing is written)."""


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "learn", help="write a policy from audit runs (mode: audit)", formatter_class=FMT,
        description=DESCRIPTION, epilog=EPILOG,
    )  # fmt: skip
    p.add_argument("--sandbox", action="append", metavar="ID", default=[],
                   help="learn from this sandbox's audit run (repeatable; default: every"
                        " sandbox with an audit record since --since)")  # fmt: skip
    p.add_argument("--since", metavar="WHEN",
                   help="only what was last seen since then: 30m, 2h, 7d ago, or a UTC"
                        " date/time (2026-12-01, 2026-12-01T09:30)")  # fmt: skip
    p.add_argument("--base", metavar="POLICY",
                   help="keep this policy's settings and rules (upstreams, TTLs, tunnel,"
                        " violations) and add what was learned")  # fmt: skip
    p.add_argument("-o", "--output", metavar="FILE", help="write here (default: stdout)")
    p.add_argument("--force", action="store_true", help="overwrite an existing -o FILE")
    p.add_argument(
        "--name",
        metavar="NAME",
        help="metadata.name of the policy (default: the base's, else learned)",
    )
    p.add_argument(
        "--min-siblings",
        type=int,
        default=4,
        metavar="N",
        help="names under one parent before a pattern is written (default 4)",
    )
    p.add_argument("--diff", metavar="POLICY",
                   help="print what learning would add to (+) and remove from (-) POLICY,"
                        " and risks it allows (!), instead of a policy")  # fmt: skip
    p.add_argument(
        "--state-dir",
        metavar="DIR",
        help="journal directory (default: $EGRESS_STATE_DIR or /var/lib/egress)",
    )
    p.set_defaults(func=cmd_learn)


def cmd_learn(args: argparse.Namespace) -> int:
    from egress.learn.diff import against
    from egress.learn.draft import make_draft
    from egress.learn.observed import collect
    from egress.learn.write import policy_text

    if args.min_siblings < 2:
        raise InputError("--min-siblings must be at least 2 (1 would turn every name into *.)")
    since = parse_since(args.since, time.time()) if args.since else 0.0
    record = _read_audit(args.state_dir, args.sandbox, since)
    seen = collect(record["names"], record["connects"], record["overflow"])
    if args.diff:
        from egress.policy.loader import load_policy

        policy = load_policy(args.diff)
        lines = against(make_draft(seen, None, args.min_siblings), seen, policy)
        print("\n".join(lines) if lines else f"{args.diff}: nothing to add or remove")
        return 0
    base_policy, base_data = _base(args.base)
    draft = make_draft(seen, base_policy, args.min_siblings)
    name = args.name or (base_policy.name if base_policy is not None else "learned")
    text = policy_text(draft, name, base_data)
    if args.output:
        _write(Path(args.output), text, args.force)
        rules = len(draft.rules)
        print(f"{args.output}: {rules} rule{'s' if rules != 1 else ''}, {len(draft.statics)}"
              f" flagged destination{'s' if len(draft.statics) != 1 else ''},"
              f" {len(draft.risks)} risk{'s' if len(draft.risks) != 1 else ''} set aside,"
              f" from {len(draft.sandboxes)} audit run{'s' if len(draft.sandboxes) != 1 else ''}",
              file=sys.stderr)  # fmt: skip
    else:
        sys.stdout.write(text)
    return 0


def parse_since(text: str, now: float) -> float:
    """``30m``/``2h``/``7d`` ago, or an ISO date/time (UTC unless it says otherwise)."""
    parts = _AGO.findall(text)
    if parts and "".join(n + u for n, u in parts) == text:
        return now - sum(int(n) * _UNIT[u] for n, u in parts)
    try:
        when = datetime.fromisoformat(text)
    except ValueError:
        raise InputError(
            f"--since {text!r}: expected a duration ago (30m, 2h, 7d) or a date/time"
            " (2026-12-01, 2026-12-01T09:30)"
        ) from None
    return (when if when.tzinfo else when.replace(tzinfo=UTC)).timestamp()


def _read_audit(state: str | None, wanted: list[str], since: float) -> dict[str, Any]:
    from egress.store.journal import JOURNAL_FILE, Journal
    from egress.store.paths import state_dir

    directory = state_dir(state)
    if not (directory / JOURNAL_FILE).exists():
        raise InputError(
            f"no journal at {directory / JOURNAL_FILE}: run a sandbox under a policy with"
            " `mode: audit` first (or pass --state-dir)"
        )
    with Journal.open(directory) as journal:
        audited = journal.audited_sandboxes(since)
        for sid in wanted:
            if journal.sandbox(sid) is None:
                raise InputError(
                    f"no sandbox {sid!r} in the journal (egressctl ps --all lists them)"
                )
            if sid not in audited:
                raise InputError(
                    f"sandbox {sid!r} has no audit record{' since --since' if since else ''}:"
                    " was its policy in `mode: audit`?"
                )
        ids = list(dict.fromkeys(wanted)) or audited
        if not ids:
            raise InputError(
                f"no audit runs in {directory / JOURNAL_FILE}"
                f"{' since --since' if since else ''}: run the workload under a policy with"
                " `mode: audit`, then learn"
            )
        return journal.audit(ids, since)


def _base(path: str | None) -> tuple[Any, dict[str, Any] | None]:
    if path is None:
        return None, None
    from egress.learn.write import base_settings
    from egress.policy.loader import MAX_BYTES, load_policy
    from egress.policy.tree import compose

    policy = load_policy(path)  # PolicyError with every problem if it is not valid
    with open(path, "rb") as handle:
        text = handle.read(MAX_BYTES).decode("utf-8-sig")
    tree, _ = compose(text, path)
    return policy, base_settings(tree)


def _write(path: Path, text: str, force: bool) -> None:
    if path.exists() and not force:
        raise InputError(f"{path} exists; pass --force to replace it")
    from egress.store.paths import write_whole

    write_whole(path, text.encode())

"""egressctl validate | check | schema: policy files from the command line.

Exit statuses follow the usual checker convention: 0 fine, 1 "no" (check: denied, or a
tunnel verdict in a replay), 2 the input itself is wrong (bad policy, unreadable file, bad
argument). Problems go to stderr as ``FILE:LINE:COL: message`` so editors and CI can jump
to them.

``check`` is where the policy and the tunnel scorer meet outside a sandbox: the policy
package only builds ``spec.tunnel`` (it must not import ``egress.tunnel``), so scoring a
name, or replaying a list of names through a ``TunnelScorer`` on a fake clock, happens
here, the way the resolver does it: only names the rules allow reach the scorer.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Iterable

from egress.errors import PolicyError, Problem
from egress.model import Policy, TunnelSpec
from egress.policy import Matcher, load_policy_with_warnings
from egress.policy.ports import describe_ports
from egress.policy.rrtypes import type_name, type_number
from egress.policy.schema import policy_json_schema
from egress.tunnel import TunnelScorer, TunnelVerdict

VALIDATE_EPILOG = """\
examples:
  egressctl validate policies/python-dev.yaml
  egressctl validate policies/*.yaml      # every problem of every file, then exit 2

Warnings (FILE:LINE:COL: warning: ...) are printed but do not fail validation.
"""

CHECK_EPILOG = """\
examples:
  egressctl check policies/python-dev.yaml files.pythonhosted.org AAAA
  egressctl check policies/git-https.yaml raw.githubusercontent.com
  egressctl check policies/python-dev.yaml --names queries.txt
  egressctl check policies/python-dev.yaml --names - --interval 2 < queries.txt

One name: the first line is allow or deny, then the rule, the reason, the ports, and a
"tunnel:" line with the name's tunnel score and the features behind it ([tunnel-shaped]
when the score reaches spec.tunnel.name_score).

--names FILE replays names in order (one a line: NAME [TYPE], "#" starts a comment, "-"
is stdin) through the policy and, for the names it allows, a tunnel scorer built from
spec.tunnel, its clock advancing --interval seconds per name. Per name it prints allow or
deny and the score, then each tunnel verdict with the limits crossed and what was
forwarded before it. Responses are not replayed, so nx_ratio never applies.

exit status: 0 allowed (with --names: every name allowed and no tunnel verdict),
1 denied or a tunnel verdict, 2 bad policy, names file or arguments
"""

DEFAULT_INTERVAL = 0.1  # seconds between replayed names: a busy but plausible client

SCHEMA_EPILOG = """\
example:
  egressctl schema > egress-policy.schema.json
  # VS Code (redhat.vscode-yaml): "yaml.schemas": {"egress-policy.schema.json": "policies/*.yaml"}
"""


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add this module's subcommands to egressctl."""
    validate = _parser(
        sub, "validate", "check policy files and report every problem", VALIDATE_EPILOG
    )
    validate.add_argument("files", nargs="+", metavar="FILE", help="policy files to check")
    validate.set_defaults(func=cmd_validate)

    check = _parser(sub, "check", "would a policy allow this DNS query?", CHECK_EPILOG)
    check.add_argument("file", metavar="FILE", help="policy file")
    check.add_argument(
        "name", metavar="NAME", nargs="?", help="DNS name, e.g. files.pythonhosted.org"
    )
    check.add_argument("qtype", metavar="TYPE", nargs="?", default="A", help="record type (A)")
    check.add_argument(
        "--names", metavar="FILE", help="replay the names in this file (- for stdin) instead"
    )
    check.add_argument(
        "--interval",
        metavar="SECONDS",
        type=_interval,
        help=f"fake time between replayed names (default {DEFAULT_INTERVAL:g})",
    )
    check.set_defaults(func=cmd_check)

    schema = _parser(sub, "schema", "print the JSON Schema of the policy language", SCHEMA_EPILOG)
    schema.set_defaults(func=cmd_schema)


def _parser(
    sub: argparse._SubParsersAction[argparse.ArgumentParser], name: str, summary: str, epilog: str
) -> argparse.ArgumentParser:
    return sub.add_parser(
        name,
        help=summary,
        description=summary,
        epilog=epilog,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )


def cmd_validate(args: argparse.Namespace) -> int:
    status = 0
    for path in args.files:
        policy = _load(path)
        if policy is None:
            status = 2
            continue
        rules = len(policy.dns.allow) + len(policy.connect.allow)
        print(f"{path}: ok ({rules} rule{'' if rules == 1 else 's'})")
    return status


def cmd_check(args: argparse.Namespace) -> int:
    usage = _check_usage(args)
    if usage is not None:
        print(f"egressctl check: {usage}", file=sys.stderr)
        return 2
    return _check_names(args) if args.names is not None else _check_one(args)


def _check_one(args: argparse.Namespace) -> int:
    """``check FILE NAME [TYPE]``: the first line is allow or deny, scripts rely on it."""
    try:
        qtype = _qtype(args.qtype)
    except ValueError as exc:
        print(f"egressctl check: {exc}", file=sys.stderr)
        return 2
    policy = _load(args.file)
    if policy is None:
        return 2
    decision = Matcher(policy).decide(args.name, qtype)
    print("allow" if decision.allowed else "deny")
    rule = decision.rule
    if rule is None:
        print("rule: none")
    else:
        print(f"rule: {rule.describe()} ({rule.where})")
    print(f"reason: {decision.reason}")
    if decision.allowed and rule is not None:
        print(f"ports: {describe_ports(rule.ports)}")
    print(f"tunnel: {_tunnel_line(policy.tunnel, args.name, qtype)}")
    return 0 if decision.allowed else 1


def _check_usage(args: argparse.Namespace) -> str | None:
    """What is wrong with the combination of arguments, if anything."""
    if args.names is not None and args.name is not None:
        return "give a NAME or --names FILE, not both"
    if args.names is None and args.name is None:
        return "give a NAME to check, or --names FILE to replay"
    if args.names is None and args.interval is not None:
        return "--interval only applies to --names"
    return None


def _interval(text: str) -> float:
    try:
        seconds = float(text)
    except ValueError:
        seconds = math.nan
    if not math.isfinite(seconds) or seconds < 0:
        raise argparse.ArgumentTypeError(f"expected seconds >= 0, like 0.1; got {text!r}")
    return seconds


def _qtype(text: str) -> int:
    """A record type as typed on the command line: ``AAAA``, ``txt`` or ``65``."""
    return type_number(f"TYPE{text}" if text.isascii() and text.isdigit() else text)


def _tunnel_line(spec: TunnelSpec, name: str, qtype: int) -> str:
    """The name's score and features, and what ``spec.tunnel`` makes of them."""
    scorer = TunnelScorer(spec, FakeClock())
    score = scorer.explain(name, qtype)
    notes = []
    if score.score >= spec.name_score:
        notes.append(f"tunnel-shaped: score >= name_score {spec.name_score:g}")
    inner = scorer.scored_as(name)
    if inner != name:
        notes.append(f"scored as {inner}: spec.tunnel.search_domains names the rest")
    zone_note = scorer.applied(name).describe() if score.labels else None
    if zone_note is not None:
        notes.append(zone_note)
    if not spec.enabled:
        notes.append("detection off: spec.tunnel.enabled is false")
    return score.describe() + "".join(f" [{note}]" for note in notes)


class FakeClock:
    """Replay time: starts at 0 and moves only when told to."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _check_names(args: argparse.Namespace) -> int:
    policy = _load(args.file)
    queries = _read_names(args.names)
    if policy is None or queries is None:
        return 2
    interval = DEFAULT_INTERVAL if args.interval is None else args.interval
    return _replay(policy, queries, interval)


def _read_names(path: str) -> list[tuple[str, int]] | None:
    """(name, type) per line of ``path``, or None with every problem printed."""
    try:
        if path == "-":
            text = sys.stdin.read()
        else:
            with open(path, encoding="utf-8") as handle:
                text = handle.read()
    except OSError as exc:
        print(f"{path}: cannot read: {exc.strerror or exc}", file=sys.stderr)
        return None
    except UnicodeDecodeError as exc:
        print(f"{path}: not UTF-8 text: {exc.reason} at byte {exc.start}", file=sys.stderr)
        return None
    queries, problems = _parse_names(text.splitlines())
    for number, message in problems:
        print(f"{path}:{number}: {message}", file=sys.stderr)
    if not queries and not problems:
        print(f"{path}: no names (one a line: NAME [TYPE])", file=sys.stderr)
    return None if problems or not queries else queries


def _parse_names(lines: Iterable[str]) -> tuple[list[tuple[str, int]], list[tuple[int, str]]]:
    queries: list[tuple[str, int]] = []
    problems: list[tuple[int, str]] = []
    for number, line in enumerate(lines, 1):
        fields = line.partition("#")[0].split()
        if not fields:
            continue
        if len(fields) > 2:
            problems.append((number, f"expected NAME [TYPE], got {len(fields)} fields"))
            continue
        try:
            queries.append((fields[0], _qtype(fields[1]) if len(fields) == 2 else 1))
        except ValueError as exc:
            problems.append((number, str(exc)))
    return queries, problems


def _replay(policy: Policy, queries: list[tuple[str, int]], interval: float) -> int:
    """Print one line per query, then the verdicts; 0 only if all allowed, no verdict."""
    clock = FakeClock()
    scorer = TunnelScorer(policy.tunnel, clock)
    matcher = Matcher(policy)
    verdicts: dict[int, TunnelVerdict] = {}  # position of the name that drew it
    denied = 0
    for index, (name, qtype) in enumerate(queries, 1):
        clock.now += interval
        decision = matcher.decide(name, qtype)
        if not decision.allowed:
            denied += 1
            note = f"  ({decision.reason})"
        else:
            verdict = scorer.observe_query(name, qtype)
            note = _verdict_note(verdict, verdicts, index)
        verb = "allow" if decision.allowed else "deny"
        score = scorer.explain(name, qtype).score
        applied = scorer.applied(name).describe()
        note += f"  [{applied}]" if applied and decision.allowed else ""
        print(f"{verb:5}  score {score:5.2f}  {name} {type_name(qtype)}{note}")
    for index, verdict in verdicts.items():
        _print_verdict(index, verdict)
    print(_summary(policy.tunnel, len(queries), denied, len(verdicts)))
    return 1 if denied or verdicts else 0


def _verdict_note(
    verdict: TunnelVerdict | None, verdicts: dict[int, TunnelVerdict], index: int
) -> str:
    """Marks the name that drew a verdict; later names under its zone are stopped too."""
    if verdict is None:
        return ""
    if any(verdict is seen for seen in verdicts.values()):
        return f"  (not forwarded: tunnel verdict on {verdict.zone})"
    verdicts[index] = verdict
    return f"  <- tunnel verdict on {verdict.zone}: not forwarded"


def _print_verdict(index: int, verdict: TunnelVerdict) -> None:
    print(f"verdict at name {index} (t={verdict.at:g}s): DNS tunnel suspected under {verdict.zone}")
    print(f"  query: {verdict.name} {type_name(verdict.qtype)} (not forwarded)")
    print(f"  score: {verdict.score:.2f} (largest value/limit of the limits crossed)")
    for crossing in verdict.reasons:
        print(f"  reason: {crossing.rule}: {crossing.text}")
    print(
        f"  before: {verdict.queries_before} queries forwarded, {verdict.bytes_before:,} B "
        f"of subdomain text, {verdict.unique_before} unique subdomains"
    )
    types = ", ".join(f"{_type_text(kind)} {count}" for kind, count in verdict.types)
    print(f"  types: {types or 'none'}")


def _type_text(kind: str) -> str:
    """A verdict names data-only types (NULL) and gives the others as numbers ("1")."""
    return type_name(int(kind)) if kind.isdigit() else kind


def _summary(spec: TunnelSpec, names: int, denied: int, verdicts: int) -> str:
    counts = f"{names} name{'' if names == 1 else 's'}: {names - denied} allowed, {denied} denied"
    if not spec.enabled:
        return f"{counts}; tunnel detection off (spec.tunnel.enabled is false)"
    if not verdicts:
        return f"{counts}; no tunnel verdict"
    return f"{counts}; {verdicts} tunnel verdict{'' if verdicts == 1 else 's'}"


def cmd_schema(args: argparse.Namespace) -> int:
    print(json.dumps(policy_json_schema(), indent=2))
    return 0


def _load(path: str) -> Policy | None:
    """The policy at ``path`` with its warnings printed, or None with its problems printed."""
    try:
        policy, warnings = load_policy_with_warnings(path)
    except PolicyError as exc:
        _print(exc.problems + exc.warnings)
        return None
    _print(warnings)
    return policy


def _print(problems: list[Problem]) -> None:
    for problem in sorted(problems, key=lambda p: (p.where.line, p.where.col)):
        print(problem, file=sys.stderr)

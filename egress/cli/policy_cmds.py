"""egressctl validate | check | schema: policy files from the command line.

Exit statuses follow the usual checker convention: 0 fine, 1 "no" (check: denied),
2 the input itself is wrong (bad policy, unreadable file, bad argument). Problems go
to stderr as ``FILE:LINE:COL: message`` so editors and CI can jump to them.
"""

from __future__ import annotations

import argparse
import json
import sys

from egress.errors import PolicyError, Problem
from egress.model import Policy
from egress.policy import Matcher, load_policy_with_warnings
from egress.policy.ports import describe_ports
from egress.policy.rrtypes import type_number
from egress.policy.schema import policy_json_schema

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

exit status: 0 allowed, 1 denied, 2 bad policy or arguments
"""

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
    check.add_argument("name", metavar="NAME", help="DNS name, e.g. files.pythonhosted.org")
    check.add_argument("qtype", metavar="TYPE", nargs="?", default="A", help="record type (A)")
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
    try:
        text = f"TYPE{args.qtype}" if args.qtype.isascii() and args.qtype.isdigit() else args.qtype
        qtype = type_number(text)
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
    return 0 if decision.allowed else 1


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

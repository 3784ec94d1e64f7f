"""egressctl main: build the parser from each command module and dispatch."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from egress import __version__
from egress.errors import EgressError, PolicyError

DESCRIPTION = """\
egress: kernel-enforced network egress control for AI-agent sandboxes.

A policy names the DNS names (and record types) a sandbox may resolve and where it may
connect; nftables in the sandbox's network namespace enforces it.

examples:
  egressctl validate policies/python-dev.yaml
  egressctl check policies/python-dev.yaml files.pythonhosted.org AAAA
  egressctl render policies/python-dev.yaml
  sudo egressctl run --policy policies/python-dev.yaml -- pip download requests
"""


def build_parser() -> argparse.ArgumentParser:
    from egress.cli import commands

    parser = argparse.ArgumentParser(
        prog="egressctl",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"egressctl {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for register in commands.REGISTRARS:
        register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    handler = getattr(args, "func", None)
    if handler is None:
        parser.print_help()
        return 2
    try:
        status: int = handler(args)
    except PolicyError as exc:
        for problem in exc.problems + exc.warnings:
            print(problem, file=sys.stderr)
        return 2
    except EgressError as exc:
        print(f"egressctl: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # `egressctl journal | head`: the reader left; that is not an error of ours.
        # Point stdout at /dev/null so the interpreter's final flush stays quiet too.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    return status


if __name__ == "__main__":
    sys.exit(main())

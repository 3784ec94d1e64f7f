"""The options that shape what a workload sees and gets, for `run` and `sandbox exec`.

Read before anything is made: every path is checked for a symlink an earlier workload
could have planted, the binds and the working directory are resolved and checked, and
the --env-file lines are read, so a mistake is an exit 2 with nothing to undo.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the sandbox modules load ctypes and libc: only `run` and `exec` need them
    from egress.sandbox.view import Bind


def add(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--workdir", metavar="DIR",
        help="the directory CMD starts in, read-write (default: the current directory)",
    )  # fmt: skip
    p.add_argument(
        "--ro-bind", action="append", default=[], metavar="PATH[:DEST]",
        help="show host PATH read-only at DEST (default: the same path); repeatable",
    )  # fmt: skip
    p.add_argument(
        "--bind", action="append", default=[], metavar="PATH[:DEST]",
        help="show host PATH read-write at DEST; repeatable",
    )  # fmt: skip
    p.add_argument(
        "--env", action="append", default=[], metavar="NAME[=VALUE]",
        help="pass NAME to CMD (its value here, or VALUE); repeatable",
    )  # fmt: skip
    p.add_argument(
        "--env-file", action="append", default=[], metavar="FILE",
        help="pass the NAME[=VALUE] lines of FILE, as --env does",
    )  # fmt: skip


@dataclass(frozen=True)
class Shape:
    workdir: str  # resolved and checked
    binds: list[Bind]
    env: list[str]  # --env-file lines, then --env items: NAME or NAME=VALUE


def read(args: argparse.Namespace, *, uid_range: range, report: str | None = None) -> Shape:
    from egress.sandbox.view import (
        Bind,
        check_operator_paths,
        check_workdir,
        home_of,
        invoking_user,
    )
    from egress.sandbox.workload import parse_env_file

    check_operator_paths(
        workdir=args.workdir, binds=[*args.ro_bind, *args.bind], env_files=args.env_file,
        report=report, uid_range=uid_range,
    )  # fmt: skip
    binds = [Bind.parse(b, writable=False) for b in args.ro_bind]
    binds += [Bind.parse(b, writable=True) for b in args.bind]
    workdir = check_workdir(args.workdir or os.getcwd(), home_of(invoking_user()[0]))
    env = [item for path in args.env_file for item in parse_env_file(path)] + list(args.env)
    return Shape(workdir, binds, env)

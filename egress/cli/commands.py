"""The command modules whose ``register(subparsers)`` build egressctl, in --help order."""

from __future__ import annotations

import argparse
from collections.abc import Callable

from egress.cli import (
    convert_cmds,
    daemon_cmds,
    demo_cmds,
    lab_cmds,
    learn_cmds,
    observe_cmds,
    policy_cmds,
    review_cmds,
    run_cmds,
)

REGISTRARS: list[Callable[[argparse._SubParsersAction[argparse.ArgumentParser]], None]] = [
    policy_cmds.register,
    run_cmds.register,
    review_cmds.register,
    learn_cmds.register,
    convert_cmds.register,
    lab_cmds.register,
    demo_cmds.register,
    observe_cmds.register,
    daemon_cmds.register,
]

"""(being written)"""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add this module's subcommands to egressctl."""

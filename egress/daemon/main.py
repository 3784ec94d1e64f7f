"""egressd entry point."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from egress import __version__


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="egressd",
        description=(
            "egressd will serve many sandboxes from one process, with an API on a unix "
            "socket. It is not built yet; `egressctl run --policy P -- CMD` serves one "
            "sandbox with the same enforcement today."
        ),
    )
    parser.add_argument("--version", action="version", version=f"egressd {__version__}")
    parser.parse_args(argv)
    print("egressd: the daemon is not available in this version; use `egressctl run`",
          file=sys.stderr)  # fmt: skip
    return 2


if __name__ == "__main__":
    sys.exit(main())

"""The whole suite's: nothing of a run is left in the temp directory once it ends.

pyproject's ``tmp_path_retention_policy = "none"`` has pytest remove each run's tmp_path
trees, passed or failed (by default it keeps the last three runs': 44 MB a `make test`).
What it leaves is the empty per-user directory it made them in; that goes here too,
unless another run is using it.
"""

from __future__ import annotations

import contextlib
import getpass
import os
import tempfile

import pytest


def pytest_unconfigure(config: pytest.Config) -> None:
    root = os.environ.get("PYTEST_DEBUG_TEMPROOT") or tempfile.gettempdir()
    with contextlib.suppress(OSError, KeyError):
        os.rmdir(os.path.join(root, f"pytest-of-{getpass.getuser()}"))  # only if empty

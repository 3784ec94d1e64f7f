"""Integration-test fixtures (loopback, temp dirs; no root needed)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from egress.inline import upstream


@pytest.fixture
def no_upstream_supply_left() -> Iterator[None]:
    """None open before the test, and a closed server or pool leaves no upstream supply
    (nor its ready sockets) behind: any left is closed, and fails the test. Modules ask
    for it with ``pytestmark = pytest.mark.usefixtures("no_upstream_supply_left")``."""
    assert not upstream._supplies, f"supplies open before the test: {list(upstream._supplies)}"
    yield
    left = {key: len(s.ready) for key, s in upstream._supplies.items()}
    for supply in list(upstream._supplies.values()):
        supply.close()
    upstream._supplies.clear()
    assert not left, f"upstream supplies left open (ready sockets by key): {left}"

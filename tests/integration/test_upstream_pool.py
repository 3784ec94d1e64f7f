"""UpstreamPool: fresh upstream sockets, one per query, from a supply shared per process.

On loopback (no netns, no root): what every query gets (its own connected socket, its own
port, never one handed out before), what pools share (the ready sockets of one netns,
upstream and mark, made in batches), and that nothing outlives the last pool.
"""

from __future__ import annotations

import itertools
import os

import pytest

from egress.errors import EgressError, UpstreamError
from egress.inline import upstream
from egress.inline.upstream import REFILL_STEP, SUPPLY_LOW, SUPPLY_SIZE, UpstreamPool

UP_A = ("127.0.0.1", 5301)
UP_B = ("127.0.0.1", 5302)

pytestmark = pytest.mark.usefixtures("no_upstream_supply_left")


def test_every_query_gets_its_own_connected_socket_never_one_handed_out_before() -> None:
    pool = UpstreamPool([UP_A], None)
    try:
        pool.refill()
        taken = [pool.take(0) for _ in range(3 * SUPPLY_SIZE)]  # past the supply, made anew
        try:
            assert len({id(s) for s in taken}) == len(taken)
            assert len({s.getsockname()[1] for s in taken}) == len(taken)  # one port each
            assert {s.getpeername() for s in taken} == {UP_A}
            assert all(not s.getblocking() for s in taken)
        finally:
            for s in taken:
                s.close()
    finally:
        pool.close()


def test_pools_of_one_upstream_share_a_supply_made_in_batches() -> None:
    a, b = UpstreamPool([UP_A], None), UpstreamPool([UP_A, UP_B], None)
    try:
        a.refill()
        b.refill()
        shared = upstream._supplies[(None, 0, *UP_A, None)]
        other = upstream._supplies[(None, 0, *UP_B, None)]
        assert shared.users == 2 and other.users == 1
        assert len(shared.ready) == SUPPLY_SIZE  # b's refill found a's batch: no more made
        # Taken down to just above the low mark, a refill makes nothing; below it, one
        # batch tops the supply up again.
        taken = [b.take(0) for _ in range(SUPPLY_SIZE - SUPPLY_LOW)]
        a.refill()
        assert len(shared.ready) == SUPPLY_LOW
        taken.append(a.take(0))
        a.refill()
        assert len(shared.ready) == SUPPLY_SIZE
        for s in taken:
            s.close()
        with b.take(1) as s:
            assert s.getpeername() == UP_B  # each upstream its own supply
    finally:
        a.close()
        b.close()


def test_a_top_up_in_steps_goes_on_from_the_low_mark_until_the_supply_is_full() -> None:
    pool = UpstreamPool([UP_A], None)
    try:
        pool.refill()
        [supply] = upstream._supplies.values()
        assert supply.refill() is False  # full at once: nothing more to make
        taken = [pool.take(0) for _ in range(SUPPLY_SIZE - SUPPLY_LOW)]
        assert supply.refill(REFILL_STEP) is False and len(supply.ready) == SUPPLY_LOW
        taken.append(pool.take(0))  # below the low mark: a top-up starts
        sizes = [len(supply.ready)]
        while supply.refill(REFILL_STEP):
            sizes.append(len(supply.ready))
        sizes.append(len(supply.ready))
        # Each step made REFILL_STEP (the last one what was left), above the low mark too,
        # until full; then it stops.
        assert sizes[-1] == SUPPLY_SIZE
        assert all(0 < b - a <= REFILL_STEP for a, b in itertools.pairwise(sizes))
        assert len(sizes) - 1 == -(-(SUPPLY_SIZE - SUPPLY_LOW + 1) // REFILL_STEP)
        assert supply.refill(REFILL_STEP) is False and len(supply.ready) == SUPPLY_SIZE
        for s in taken:
            s.close()
    finally:
        pool.close()


def test_a_top_up_whose_batch_fails_stops_rather_than_trying_again_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A server would otherwise run the failing step again on every turn of its loop."""
    pool = UpstreamPool([UP_A], None)
    try:
        pool.refill()
        [supply] = upstream._supplies.values()
        taken = [pool.take(0) for _ in range(SUPPLY_SIZE)]

        def fails(count: int) -> None:
            raise OSError(24, "Too many open files")

        monkeypatch.setattr(supply, "make", fails)
        assert supply.refill(REFILL_STEP) is False and not supply.filling
        monkeypatch.undo()
        assert supply.refill(REFILL_STEP) is True  # the next answer's top-up starts again
        for s in taken:
            s.close()
    finally:
        pool.close()


def test_the_last_pool_out_closes_the_ready_sockets() -> None:
    a, b = UpstreamPool([UP_A], None), UpstreamPool([UP_A], None)
    a.refill()
    b.refill()
    supply = upstream._supplies[(None, 0, *UP_A, None)]
    ready = list(supply.ready)
    a.close()
    assert all(s.fileno() != -1 for s in ready)  # b still uses them
    b.close()
    assert all(s.fileno() == -1 for s in ready)
    assert not upstream._supplies


def test_a_closed_pool_makes_and_holds_nothing() -> None:
    pool = UpstreamPool([UP_A], None)
    pool.refill()
    pool.close()
    pool.refill()  # a refill scheduled before the close ran after it
    assert not upstream._supplies
    with pytest.raises(UpstreamError):
        pool.take(0)
    pool.close()  # twice is harmless


def test_a_netns_that_is_gone_fails_the_query_not_the_refill() -> None:
    pool = UpstreamPool([UP_A], "egress-test-no-such-netns")
    try:
        pool.refill()  # best effort, between queries
        with pytest.raises(EgressError, match="egress-test-no-such-netns"):
            pool.take(0)  # the query's: the server answers it SERVFAIL
    finally:
        pool.close()


def test_a_batch_made_as_the_last_pool_leaves_is_closed_not_kept() -> None:
    pool = UpstreamPool([UP_A], None)
    pool.refill()
    [supply] = upstream._supplies.values()
    pool.close()  # the last out, on another thread, while this one makes a batch
    with pytest.raises(UpstreamError):
        supply.make(2)
    assert supply.ready == []


@pytest.mark.skipif(os.geteuid() != 0, reason="entering a netns (even this one) needs root")
def test_a_supply_holds_its_netns_for_as_long_as_it_lives() -> None:
    here = "/proc/self/ns/net"  # a netns named by path, as a run dir's are
    pool = UpstreamPool([UP_A], here)
    try:
        with pool.take(0) as sock:
            assert sock.getpeername() == UP_A
        [(key, supply)] = upstream._supplies.items()
        assert key == (here, os.stat(here).st_ino, *UP_A, None)
        held = supply._netns_fd
        assert held is not None and os.fstat(held).st_ino == key[1]
    finally:
        pool.close()
    with pytest.raises(OSError):
        os.fstat(held)

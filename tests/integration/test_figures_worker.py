"""kernel/figures_worker.py's process and protocol, unprivileged: what egressd sends a
scrape's requests over, and what comes back (the figures themselves: privileged
test_daemon.py, against what nft lists)."""

from __future__ import annotations

import asyncio
import json
import os
import socket
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest

from egress.daemon.figures import KernelFigures
from egress.errors import DatapathError
from egress.kernel import figures_worker as fw


@pytest.fixture
def worker() -> Iterator[fw.FiguresWorker]:
    w = fw.FiguresWorker(restart_after_s=0)
    try:
        yield w
    finally:
        w.close()
        assert not w._dying, "a worker left unreaped"


def ask(sock: socket.socket, data: bytes, fds: list[int]) -> bytes:
    fw.send(sock, data, fds)
    sock.settimeout(30)
    try:
        return sock.recv(fw.MAX_MESSAGE)
    finally:
        sock.setblocking(False)


def test_request_names_each_sandbox_once_with_its_descriptor_in_order() -> None:
    data, fds = fw.request(5, "egress", ("allow4", "allow6"), "dropped",
                           [("a", 7), ("own", None), ("b", 9)])  # fmt: skip
    body = json.loads(data)
    assert body == {"seq": 5, "table": "egress", "sets": ["allow4", "allow6"],
                    "counter": "dropped", "ids": ["a", "b"], "own": ["own"]}  # fmt: skip
    assert fds == [7, 9]


def test_answers_are_read_or_refused() -> None:
    got = fw.answer(b'{"seq": 3, "figures": {"a": {"sets": {"allow4": 2}, "dropped": 5}, '
                    b'"b": {"sets": {}, "dropped": null}}}')  # fmt: skip
    assert got == (3, {"a": ({"allow4": 2}, 5), "b": ({}, None)})
    with pytest.raises(DatapathError, match="failed: boom"):
        fw.answer(b'{"error": "boom"}')
    for bad in (b"", b"[1]", b'{"seq": 1, "figures": {"a": {"sets": 3}}}', b"{nope",
                b'{"figures": {}}'):  # fmt: skip
        with pytest.raises(DatapathError, match="malformed"):
            fw.answer(bad)


def test_the_worker_answers_each_request_and_closes_what_it_was_passed(
    worker: fw.FiguresWorker,
) -> None:
    sock = worker.socket()
    assert worker.socket() is sock  # running: the same one, not another process
    # A sandbox whose table is not there (unprivileged, or none): no figures, no failure.
    # Its netns is given by a descriptor, as egressd gives it.
    netns = os.open("/proc/self/ns/net", os.O_RDONLY)
    try:
        data, fds = fw.request(1, "no-such-table", ("allow4",), "dropped",
                               [("a", netns), ("b", None)])  # fmt: skip
        assert fw.answer(ask(sock, data, fds)) == (1, {"a": ({}, None), "b": ({}, None)})
    finally:
        os.close(netns)
    # Fewer descriptors than sandboxes: an error answer, and the worker goes on.
    data, _ = fw.request(2, "egress", ("allow4",), "dropped", [("a", 3)])
    with pytest.raises(DatapathError, match="1 sandboxes but 0 descriptors"):
        fw.answer(ask(sock, data, []))
    data, fds = fw.request(3, "egress", (), "dropped", [("c", None)])
    assert fw.answer(ask(sock, data, fds)) == (3, {"c": ({}, None)})
    pid = worker._proc.pid if worker._proc else 0
    left = os.listdir(f"/proc/{pid}/fd")
    assert len(left) <= 4, left  # stdin, stdout, stderr, its socket: none it was passed


def test_a_dead_worker_is_started_again_and_a_killed_one_is_reaped(
    worker: fw.FiguresWorker,
) -> None:
    worker.socket()
    first = worker._proc
    assert first is not None
    first.kill()
    first.wait()
    worker.socket()
    assert worker._proc is not None and worker._proc.pid != first.pid
    assert worker.starts == 2
    second = worker._proc
    worker.close()
    assert second.returncode is not None  # reaped
    with pytest.raises(DatapathError, match="stopping"):
        worker.socket()  # closed: no worker started again, by a late scrape or else


def test_a_worker_that_keeps_failing_is_not_started_at_every_scrape() -> None:
    w = fw.FiguresWorker(restart_after_s=60)
    try:
        w.socket()
        assert w._proc is not None
        w._proc.kill()
        w._proc.wait()
        with pytest.raises(DatapathError, match="started again in"):
            w.socket()
        assert w.starts == 1
    finally:
        w.close()


def box(sid: str) -> Any:
    """A served sandbox as KernelFigures sees one: its netns is the test's own."""
    return SimpleNamespace(id=sid, sb=SimpleNamespace(nft=SimpleNamespace(netns_fd=lambda: None)))


def test_an_answer_to_another_request_is_never_taken_for_this_ones() -> None:
    figures = KernelFigures()
    figures.worker.restart_after_s = 0

    async def scrape() -> None:
        sock = figures.worker.socket()
        # A request whose answer nobody read (as one whose reader was cancelled would
        # leave, were the worker not ended then): its answer comes first.
        data, fds = fw.request(10_000, "egress", (), "dropped", [("stale", None)])
        fw.send(sock, data, fds)
        got = await figures.read([box("fresh")])
        assert set(got) == {"fresh"}

    try:
        asyncio.run(scrape())
    finally:
        figures.close()


def test_a_cancelled_read_ends_its_worker() -> None:
    figures = KernelFigures()
    figures.worker.restart_after_s = 0

    async def scrape() -> None:
        figures.start()
        first = figures.worker._proc
        task = asyncio.ensure_future(figures.read([box(f"s{i}") for i in range(600)]))
        await asyncio.sleep(0)  # its first request is sent; its answer awaited
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert figures.worker._proc is None and first is not None
        got = await figures.read([box("after")])  # a new worker, its own answers
        assert set(got) == {"after"} and figures.worker.starts == 2

    try:
        asyncio.run(scrape())
    finally:
        figures.close()

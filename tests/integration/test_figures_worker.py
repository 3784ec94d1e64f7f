"""kernel/figures_worker.py's process and protocol, unprivileged: what egressd sends a
scrape's requests over, and what comes back (the figures themselves: privileged
test_daemon.py, against what nft lists)."""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Iterator

import pytest

from egress.errors import DatapathError
from egress.kernel import figures_worker as fw


@pytest.fixture
def worker() -> Iterator[fw.FiguresWorker]:
    w = fw.FiguresWorker()
    try:
        yield w
    finally:
        w.kill()


def ask(sock: socket.socket, data: bytes, fds: list[int]) -> bytes:
    fw.send(sock, data, fds)
    sock.settimeout(30)
    try:
        return sock.recv(fw.MAX_MESSAGE)
    finally:
        sock.setblocking(False)


def test_request_names_each_sandbox_once_with_its_descriptor_in_order() -> None:
    data, fds = fw.request("egress", ("allow4", "allow6"), "dropped",
                           [("a", 7), ("own", None), ("b", 9)])  # fmt: skip
    body = json.loads(data)
    assert body == {"table": "egress", "sets": ["allow4", "allow6"], "counter": "dropped",
                    "ids": ["a", "b"], "own": ["own"]}  # fmt: skip
    assert fds == [7, 9]


def test_answers_are_read_or_refused() -> None:
    got = fw.answer(
        b'{"a": {"sets": {"allow4": 2}, "dropped": 5}, "b": {"sets": {}, "dropped": null}}'
    )
    assert got == {"a": ({"allow4": 2}, 5), "b": ({}, None)}
    with pytest.raises(DatapathError, match="failed: boom"):
        fw.answer(b'{"error": "boom"}')
    for bad in (b"", b"[1]", b'{"a": {"sets": 3}}', b"{nope"):
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
        data, fds = fw.request("no-such-table", ("allow4",), "dropped",
                               [("a", netns), ("b", None)])  # fmt: skip
        assert fw.answer(ask(sock, data, fds)) == {"a": ({}, None), "b": ({}, None)}
    finally:
        os.close(netns)
    # Fewer descriptors than sandboxes: an error answer, and the worker goes on.
    data, _ = fw.request("egress", ("allow4",), "dropped", [("a", 3)])
    with pytest.raises(DatapathError, match="1 sandboxes but 0 descriptors"):
        fw.answer(ask(sock, data, []))
    data, fds = fw.request("egress", (), "dropped", [("c", None)])
    assert fw.answer(ask(sock, data, fds)) == {"c": ({}, None)}
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
    second = worker._proc.pid
    worker.kill()
    assert not os.path.exists(f"/proc/{second}")

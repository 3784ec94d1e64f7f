"""The learned-address entries egressd hands its successor go in messages that fit a
SEQPACKET socket's send buffer (a message past it fails with EMSGSIZE)."""

from __future__ import annotations

import json
import socket

from egress.daemon.handoff import CHUNK_BYTES, _chunks


def test_chunks_keep_every_entry_in_order_and_fit_a_seqpacket_message() -> None:
    entries = [
        [f"host{i}.example.test", 28, [f"2001:db8::{i:x}:{j}" for j in range(4)], 1e9 + i]
        for i in range(5000)
    ]
    chunks = list(_chunks(entries))
    assert [e for chunk in chunks for e in chunk] == entries
    assert len(chunks) > 1
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    with a, b:
        for chunk in chunks:
            message = json.dumps({"kind": "learned", "id": "x", "entries": chunk}).encode()
            assert len(message) < CHUNK_BYTES + 4096
            a.sendall(message)  # EMSGSIZE if it did not fit
            assert json.loads(b.recv(1 << 20))["entries"] == chunk


def test_no_entries_no_chunks() -> None:
    assert list(_chunks([])) == []

"""Upstream query IDs (``query_id_bits``): from a buffer of the kernel's random bytes, never
the same sequence in a forked child as in its parent."""

from __future__ import annotations

import os

from egress.inline.upstream import ID_BUFFER, query_id_bits


def test_ids_are_16_bit_and_spread() -> None:
    ids = [query_id_bits(16) for _ in range(3 * ID_BUFFER)]  # refilled twice
    assert all(0 <= i < 1 << 16 for i in ids)
    # 6,144 draws from 65,536 values: ~5,870 distinct expected; a buffer handed out
    # twice, or a constant, gives at most half of that.
    assert len(set(ids)) > 5000


def test_other_widths_come_from_secrets() -> None:
    assert any(query_id_bits(32) >= 1 << 16 for _ in range(20))
    assert all(0 <= query_id_bits(8) < 1 << 8 for _ in range(100))


def test_a_forked_child_does_not_repeat_its_parents_ids() -> None:
    query_id_bits(16)  # the buffer is full now: a child that kept it would pop the same
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its next IDs, to the parent, then out without cleanup
        try:
            os.write(write, b",".join(str(query_id_bits(16)).encode() for _ in range(64)))
        finally:
            os._exit(0)
    os.close(write)
    try:
        got = b""
        while chunk := os.read(read, 4096):
            got += chunk
    finally:
        os.close(read)
        os.waitpid(pid, 0)
    child = [int(x) for x in got.split(b",")]
    parent = [query_id_bits(16) for _ in range(64)]
    assert len(child) == 64
    assert child != parent

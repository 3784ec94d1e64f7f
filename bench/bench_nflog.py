"""What the observer pays per NFLOG copy to find its prefix and payload, and to read them.

Every DNS query and answer of a sandbox reaches its observer as an NFLOG copy, and most
are repeats it deals with from those two attributes alone. Three ways to find them, on
buffers of 64 copies laid out as nfnetlink_log sends them (header, prefix, device, uid,
gid, payload; half queries, half answers):

- dict: every message's attributes into a dict (``kernel.nfnetlink.messages`` and
  ``iter_attrs``, how the listener read each copy before ``datapath.nflog_wire``);
- walk, Python sources: ``nflog_wire.walk`` run by the interpreter (``EGRESS_NATIVE=0``);
- walk, compiled: the same module as mypyc built it (``make setup``).

Then the whole read, compiled and as sources: the listener's ``read_events`` of one such
datagram from a socket (a socketpair: the send is in the figure, ~0.03 us a copy), the
observer's ``_sift`` dealing with every copy (32 repeats of 4 allowed queries, and the
32 answers to them, each bound by ``observer.answers.Answers``): what a cache hit's two
copies cost the observer. Compiled, both the walk and the sift (``observer.native``) are.

Each in its own process, best of 7 rounds of 2,000 buffers. Asserts nothing.

    .venv/bin/python bench/bench_nflog.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

COPIES = 64
ROUNDS, BUFFERS = 7, 2_000


def buffer() -> bytes:
    from tests.support.nflog import copy

    out = b""
    for i in range(COPIES):
        prefix = b"egress dns" if i % 2 == 0 else b"egress dns answer"
        out += copy(prefix, bytes(28 + (33 if i % 2 == 0 else 49)))
    return out


def measure(way: str) -> dict[str, object]:
    from egress.datapath.native import NATIVE
    from egress.datapath.nflog_wire import walk
    from egress.kernel.nfnetlink import NFGEN, iter_attrs, messages

    buf = buffer()

    def dict_way() -> None:
        for _kind, _seq, pos, end in messages(buf):
            attrs = iter_attrs(buf, pos + NFGEN.size, end)
            attrs.get(10, b""), attrs.get(9, b"")

    def walk_way() -> None:
        walk(buf, (4 << 8) | 0)

    run = {"dict": dict_way, "walk": walk_way}.get(way) or reader()
    best = float("inf")
    for _ in range(ROUNDS):
        start = time.perf_counter()
        for _ in range(BUFFERS):
            run()
        best = min(best, time.perf_counter() - start)
    in_use = NATIVE.in_use()
    if way == "read":
        from egress.observer.native import NATIVE as OBSERVER

        in_use = f"walk {in_use}, sift {OBSERVER.in_use()}"
    return {"us": best / (BUFFERS * COPIES) * 1e6, "in_use": in_use}


def reader() -> Callable[[], None]:
    """One datagram of 64 copies the observer deals with itself, sent and read."""
    import socket
    import struct

    from egress.datapath import constants as c
    from egress.kernel.nflog import NflogListener
    from egress.observer.flows import FlowWatch
    from egress.observer.layer import Observer
    from egress.observer.replays import QueryReplays
    from egress.policy import parse_policy
    from egress.policy.matcher import Matcher
    from tests.support.nflog import copy

    policy, _ = parse_policy(POLICY, "bench.yaml")
    observer = object.__new__(Observer)  # the parts _sift uses: no netns, no journal
    observer.queries = QueryReplays()
    observer.flows = FlowWatch(policy, Matcher(policy), None)

    def udp4(payload: bytes, sport: int, dport: int) -> bytes:
        header = struct.pack("!BBHHHBBH4s4s", 0x45, 0, 28 + len(payload), 1, 0x4000, 64, 17, 0,
                             bytes([10, 0, 0, 2]), bytes([127, 0, 0, 53]))  # fmt: skip
        return header + struct.pack("!HHHH", sport, dport, 8 + len(payload), 0) + payload

    out = b""
    for i in range(COPIES // 2):
        name = f"w{i % 4}.allowed.test"
        query = struct.pack("!HHHHHH", i, 0x0100, 1, 0, 0, 0)
        query += b"".join(bytes([len(p)]) + p.encode() for p in name.split(".")) + b"\0\0\1\0\1"
        answer = struct.pack("!HHHHHH", i, 0x8180, 1, 1, 0, 0) + query[12:]
        answer += b"\xc0\x0c" + struct.pack("!HHIH", 1, 1, 60, 4) + bytes([203, 0, 113, i % 4])
        observer.queries.remember(udp4(query, 1, 53), query, time.monotonic() + 3600)
        out += copy(c.DNS_LOG_PREFIX.encode(), udp4(query, 40000 + i, 53))
        out += copy(c.ANSWER_LOG_PREFIX.encode(), udp4(answer, 53, 40000 + i))
    ours, kernel = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
    ours.setblocking(False)
    listener = NflogListener(ours, c.OBSERVER_GROUP, None)
    listener.sift = observer._sift

    def read_way() -> None:
        kernel.send(out)
        if listener.read_events():
            raise RuntimeError("a copy the observer should have dealt with became an event")

    return read_way


POLICY = """
apiVersion: egress/v1
kind: Policy
metadata: {name: bench-nflog}
spec:
  dns: {upstreams: ["192.0.2.53"], allow: ["*.allowed.test"]}
  connect: {ports: [443]}
"""


def child(way: str, native: str) -> dict[str, object]:
    env = {**os.environ, "EGRESS_NATIVE": native}
    done = subprocess.run([sys.executable, __file__, "--child", way], env=env,
                          capture_output=True, text=True, check=True)  # fmt: skip
    result: dict[str, object] = json.loads(done.stdout)
    return result


def main() -> None:
    if sys.argv[1:2] == ["--child"]:
        print(json.dumps(measure(sys.argv[2])))
        return
    rows = [("dict (the listener before)", child("dict", "0")),
            ("walk, Python sources", child("walk", "0")),
            ("walk, compiled", child("walk", "1"))]  # fmt: skip
    print(f"finding each NFLOG copy's prefix and payload ({COPIES} copies a buffer):")
    base = float(str(rows[0][1]["us"]))
    for label, r in rows:
        us = float(str(r["us"]))
        print(f"  {label:<28} {us:6.3f} us a copy   {base / us:5.1f}x   ({r['in_use']})")
    print(f"reading a datagram of {COPIES} copies the observer deals with itself (half "
          f"repeated queries, half answers), sent through a socketpair:")  # fmt: skip
    for label, native in (("read, Python sources", "0"), ("read, compiled", "1")):
        r = child("read", native)
        print(f"  {label:<28} {float(str(r['us'])):6.3f} us a copy   ({r['in_use']})")


if __name__ == "__main__":
    main()

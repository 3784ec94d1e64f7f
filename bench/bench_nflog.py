"""What the observer pays per NFLOG copy to find its prefix and payload.

Every DNS query and answer of a sandbox reaches its observer as an NFLOG copy, and most
are repeats it deals with from those two attributes alone. Three ways to find them, on
buffers of 64 copies laid out as nfnetlink_log sends them (header, prefix, device, uid,
gid, payload; half queries, half answers):

- dict: every message's attributes into a dict (``kernel.nfnetlink.messages`` and
  ``iter_attrs``, how the listener read each copy before ``datapath.nflog_wire``);
- walk, Python sources: ``nflog_wire.walk`` run by the interpreter (``EGRESS_NATIVE=0``);
- walk, compiled: the same module as mypyc built it (``make setup``).

Each in its own process, best of 7 rounds of 2,000 buffers. Asserts nothing.

    .venv/bin/python bench/bench_nflog.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
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

    run = dict_way if way == "dict" else walk_way
    best = float("inf")
    for _ in range(ROUNDS):
        start = time.perf_counter()
        for _ in range(BUFFERS):
            run()
        best = min(best, time.perf_counter() - start)
    return {"us": best / (BUFFERS * COPIES) * 1e6, "in_use": NATIVE.in_use()}


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


if __name__ == "__main__":
    main()

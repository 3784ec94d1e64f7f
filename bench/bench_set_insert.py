"""How long one allowed-set insert takes: it sits on every DNS answer's critical path.

Creates a throwaway netns, loads a table with a concatenated timeout set, then times
1,000 single-element ``NftHandle.add_elements`` calls (timeout 60 s) on an empty set and
on one pre-filled with 20,000 elements; optionally the same through pyroute2's NFTables.
Prints median and p99 in ms. Target: median <= 0.3 ms. Needs root.
"""

from __future__ import annotations

import os
import socket
import statistics
import sys
import time
from collections.abc import Callable

from egress.kernel.netns import create_netns, in_netns, remove_netns
from egress.kernel.nft import NftHandle

N = 1000
PREFILL = 20_000
TABLE = """
table inet egress {
    set allow4 {
        type ipv4_addr . inet_proto . inet_service
        flags timeout
    }
}
"""


_RULES = "add chain inet egress out { type filter hook output priority 0; policy accept; }\n" + (
    "".join(f"add rule inet egress out tcp dport {1000 + i} counter accept\n" for i in range(60))
)


def _addr(i: int, base: int) -> str:
    n = base + i
    return f"{(n >> 24) & 255}.{(n >> 16) & 255}.{(n >> 8) & 255}.{n & 255}"


def _time(op: Callable[[int], None], n: int = N) -> list[float]:
    out = []
    for i in range(n):
        t0 = time.perf_counter()
        op(i)
        out.append((time.perf_counter() - t0) * 1000)
    return out


def _report(label: str, ms: list[float]) -> None:
    ms = sorted(ms)
    p99 = ms[int(len(ms) * 0.99) - 1]
    print(f"{label:<44} median {statistics.median(ms):6.3f} ms   p99 {p99:6.3f} ms")


def _prefill(nft: NftHandle) -> None:
    batch = 1000
    for start in range(0, PREFILL, batch):
        elems = [f"{_addr(i, 0x0A000000)} . tcp . 443" for i in range(start, start + batch)]
        nft.add_elements("inet", "egress", "allow4", elems, timeout_s=3600)


def bench_libnftables(ns: str) -> None:
    with NftHandle.open(ns) as nft:
        nft.load(TABLE)

        def insert(i: int) -> None:
            elem = f"{_addr(i, 0xC6120000)} . tcp . 443"  # 198.18.0.0/15, benchmark space
            nft.add_elements("inet", "egress", "allow4", [elem], timeout_s=60)

        _report("libnftables add_elements, empty set", _time(insert))
        _report("libnftables re-add (refresh timeout)", _time(insert))
        _prefill(nft)
        _report(f"libnftables add_elements, {PREFILL} in set", _time(lambda i: insert(i + N)))
        # A sandbox-sized ruleset next to the set: libnftables refreshes its cache per call.
        nft.load(_RULES)
        _report("libnftables add_elements, + 60-rule chain", _time(lambda i: insert(i + 2 * N)))
        nft.delete_table("inet", "egress")


def bench_pyroute2(ns: str) -> None:
    try:
        from pyroute2.nftables.main import NFTables, NFTSetElem
    except ImportError as exc:
        print(f"pyroute2 NFTables unavailable: {exc}")
        return
    with NftHandle.open(ns) as nft:
        nft.load(TABLE)
        with in_netns(ns):
            p = NFTables(nfgen_family=1)  # NFPROTO_INET
        try:
            _bench_pyroute2_inserts(p, NFTSetElem)
        finally:
            p.close()
        present = len(nft.list_set("inet", "egress", "allow4"))
        print(f"  (elements present after pyroute2 inserts: {present})")
        nft.delete_table("inet", "egress")


def _bench_pyroute2_inserts(p: object, elem_cls: type) -> None:
    from pyroute2.nftables.main import NFTSet

    target = NFTSet(table="egress", name="allow4")

    def insert(i: int) -> None:
        # pyroute2 cannot encode concatenations; hand it the raw key: each field is
        # padded to 4 bytes (address, protocol number, port in network order).
        key = socket.inet_aton(_addr(i, 0xC6120000)) + b"\x06\0\0\0" + b"\x01\xbb\0\0"
        elem = elem_cls(value=key, timeout=60_000)  # pyroute2 timeouts are ms
        p.set_elems("add", set=target, elements={elem})  # type: ignore[attr-defined]

    try:
        _report("pyroute2 NFTables set_elems, empty set", _time(insert))
    except Exception as exc:
        print(f"pyroute2 NFTables insert failed (optional): {type(exc).__name__}: {exc}")


def main() -> int:
    if os.geteuid() != 0:
        print("bench_set_insert: needs root (creates a netns)", file=sys.stderr)
        return 1
    ns = f"egress-bench-{os.getpid()}"
    create_netns(ns)
    try:
        bench_libnftables(ns)
        bench_pyroute2(ns)
    finally:
        remove_netns(ns)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""An in-process nftables handle bound to one network namespace.

The resolver must put an IP into a sandbox's allowed set before it releases the DNS
answer (DESIGN.md invariant 3), so set updates sit on the answer's critical path. A
``nft`` subprocess costs ~3.7 ms per update; libnftables through its ctypes binding
(Debian's python3-nftables) costs ~0.1 ms. The handle's netlink socket is opened while
the thread is inside the target netns and keeps acting on that netns afterwards, so one
process can hold one handle per sandbox.

A handle is NOT thread-safe: libnftables keeps per-context buffers and a cache. Use one
handle per thread, or serialise calls with a lock.

egressd calls ``use_worker()`` first: it holds too many descriptors for libnftables'
select() (see nft_worker.py), so its handles send the same commands to a child process.
"""

from __future__ import annotations

import json
import os
import re
import threading
import weakref
from typing import Any, NamedTuple

import nftables

from egress.datapath import constants as c
from egress.errors import DatapathError, EgressError, SandboxError
from egress.kernel.netns import fd_path, in_netns, netns_path
from egress.kernel.nft_worker import NftWorker

FAMILIES = frozenset({"ip", "ip6", "inet", "arp", "bridge", "netdev"})
_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_\-]{0,255}\Z")
# Element keys are rendered into nft text; anything beyond addresses, protocol names,
# ports, prefixes, ranges and concatenation dots could smuggle in extra commands.
_ELEMENT = re.compile(r"[A-Za-z0-9.:/ \-]{1,400}\Z")


def _name(kind: str, value: str) -> str:
    if not _IDENT.match(value):
        raise DatapathError(f"invalid nft {kind} name {value!r}")
    return value


def _family(value: str) -> str:
    if value not in FAMILIES:
        raise DatapathError(f"invalid nft family {value!r}")
    return value


def _element(value: str) -> str:
    if not _ELEMENT.match(value):
        raise DatapathError(f"invalid set element {value!r}")
    return value.strip()


def _timeout(seconds: float) -> str:
    ms = round(seconds * 1000)
    if ms <= 0:
        raise DatapathError(f"set element timeout must be positive, got {seconds}")
    return f"{ms // 1000}s" if ms % 1000 == 0 else f"{ms}ms"


_worker: NftWorker | None = None


def use_worker() -> NftWorker:
    """Run every handle opened from now on in a child process (nft_worker.py).

    For a process that holds hundreds of descriptors (egressd): libnftables aborts the
    process when its socket's descriptor is 1024 or above. ``egressctl run`` holds few
    and keeps the in-process context (~0.1 ms less per command); an observer opens no
    handle (it asks the kernel through nft_figures' sockets).
    """
    global _worker
    if _worker is None:
        _worker = NftWorker()
    return _worker


class Counter(NamedTuple):
    packets: int
    bytes: int


class _WorkerContext:
    """The three calls NftHandle makes on a libnftables context, run by the worker.

    Unlike a libnftables context it may be shared by threads (egressd's creates and
    deletes run in its executor's): the worker serialises the commands, and the two
    flags are per thread.
    """

    def __init__(self, worker: NftWorker, netns: str | None) -> None:
        self._worker = worker
        self._flags = threading.local()
        self._fd: int | None = None
        self._lock = threading.Lock()  # the descriptor's close against a copy being made
        self._closed = False
        self._netns: str | None = None
        if netns is not None:
            # Pin the netns now, as an in-process context's socket would: a name could be
            # reused, and a /proc/PID/ns/net path (attach) could name another netns once
            # PID is gone and reused. The worker enters it through our descriptor.
            try:
                self._fd = os.open(netns_path(netns), os.O_RDONLY | os.O_CLOEXEC)
            except OSError as exc:
                raise SandboxError(f"netns {netns}: {exc.strerror}") from None
            self._netns = fd_path(self._fd)
            # A handle dropped without close() must not keep the netns (and its veth)
            # alive for as long as egressd runs.
            self._finalizer = weakref.finalize(self, os.close, self._fd)

    def dup_netns(self) -> int | None:
        """A copy of the pinned descriptor (None: the worker's own netns). Under the
        lock a close takes: a descriptor number closed meanwhile is reused at once."""
        with self._lock:
            if self._closed:
                raise SandboxError("netns handle closed")
            return None if self._fd is None else os.dup(self._fd)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            if self._fd is not None:
                self._finalizer()  # closes it, once
                self._fd = None

    def set_json_output(self, flag: bool) -> None:
        self._flags.json = flag

    def set_dry_run(self, flag: bool) -> None:
        self._flags.dry = flag

    def cmd(self, text: str) -> tuple[int, str, str]:
        as_json = getattr(self._flags, "json", False)
        dry = getattr(self._flags, "dry", False)
        return self._worker.cmd(self._netns, text, as_json, dry)


class NftHandle:
    """One libnftables context whose netlink socket lives in one netns (or, after
    ``use_worker()``, the same calls carried out by the worker process)."""

    def __init__(self, nft: Any, netns: str | None) -> None:
        self._nft: Any = nft
        self.netns = netns
        self.label = netns  # what messages call the netns (``open``'s ``label``)

    @classmethod
    def open(
        cls, netns: str | None = None, worker: NftWorker | None = None, label: str | None = None
    ) -> NftHandle:
        """A handle acting on netns (a name or /proc/PID/ns/net path; None = current),
        through ``worker`` if given or ``use_worker()`` was called, else in-process.
        ``label``: the netns's name in messages, where ``netns`` is a descriptor's path."""
        worker = worker or _worker
        if worker is not None:
            handle = cls(_WorkerContext(worker, netns), netns)
        else:
            with in_netns(netns):
                try:
                    nft = nftables.Nftables()
                except OSError as exc:
                    raise DatapathError(f"cannot load libnftables: {exc}") from exc
            nft.set_json_output(False)
            handle = cls(nft, netns)
        handle.label = label or netns
        return handle

    def netns_fd(self) -> int | None:
        """A descriptor of this handle's netns, the caller's to close (None: the current
        netns). Through the worker, a copy of the one it pinned at open: a name or a
        /proc/PID path could name another netns by now."""
        if isinstance(self._nft, _WorkerContext):
            return self._nft.dup_netns()
        if self.netns is None:
            return None
        try:
            return os.open(netns_path(self.netns), os.O_RDONLY | os.O_CLOEXEC)
        except OSError as exc:
            raise SandboxError(f"netns {self.netns}: {exc.strerror}") from None

    def close(self) -> None:
        """Free the context; CPython frees it (and its socket) when the last ref goes."""
        if isinstance(self._nft, _WorkerContext):
            self._nft.close()
        self._nft = None

    def __enter__(self) -> NftHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- raw commands -------------------------------------------------------------

    def _ctx(self) -> Any:
        if self._nft is None:
            raise DatapathError("nft handle is closed")
        return self._nft

    def _run(self, text: str) -> str:
        rc, out, err = self._ctx().cmd(text)
        if rc != 0:
            raise DatapathError(f"nft failed in {self.label or 'current netns'}: {err.strip()}")
        return str(out)

    def _run_json(self, text: str) -> list[dict[str, Any]]:
        ctx = self._ctx()
        ctx.set_json_output(True)
        try:
            out = self._run(text)
        finally:
            ctx.set_json_output(False)
        try:
            items = json.loads(out)["nftables"] if out.strip() else []
        except (ValueError, KeyError) as exc:
            raise DatapathError(f"unexpected nft JSON output: {out[:200]!r}") from exc
        return [i for i in items if "metainfo" not in i]

    def load(self, ruleset_text: str) -> None:
        """Apply a whole ruleset text as one atomic transaction: all of it or nothing."""
        self._run(ruleset_text)

    def check(self, ruleset_text: str) -> None:
        """Validate ruleset text against the kernel's current state without applying it."""
        ctx = self._ctx()
        ctx.set_dry_run(True)
        try:
            self._run(ruleset_text)
        finally:
            ctx.set_dry_run(False)

    # ---- sets ---------------------------------------------------------------------

    def _set_ref(self, family: str, table: str, set_name: str) -> str:
        return f"{_family(family)} {_name('table', table)} {_name('set', set_name)}"

    def add_elements(
        self,
        family: str,
        table: str,
        set_name: str,
        elements: list[str],
        timeout_s: float | None = None,
    ) -> None:
        """Add elements in one transaction; re-adding one refreshes its timeout."""
        if not elements:
            return
        suffix = f" timeout {_timeout(timeout_s)}" if timeout_s is not None else ""
        body = ", ".join(_element(e) + suffix for e in elements)
        self._run(f"add element {self._set_ref(family, table, set_name)} {{ {body} }}")

    def delete_elements(
        self,
        family: str,
        table: str,
        set_name: str,
        elements: list[str],
        missing_ok: bool = False,
    ) -> None:
        """Delete elements in one transaction. One absent element fails the whole batch
        (ENOENT); with missing_ok the batch is retried one element at a time instead."""
        if not elements:
            return
        ref = self._set_ref(family, table, set_name)
        body = ", ".join(_element(e) for e in elements)
        try:
            self._run(f"delete element {ref} {{ {body} }}")
        except DatapathError as exc:
            if not missing_ok or "No such file or directory" not in str(exc):
                raise
            self._delete_each(ref, elements)

    def _delete_each(self, ref: str, elements: list[str]) -> None:
        for e in elements:
            try:
                self._run(f"delete element {ref} {{ {_element(e)} }}")
            except DatapathError as exc:
                if "No such file or directory" not in str(exc):
                    raise

    def flush_set(self, family: str, table: str, set_name: str) -> None:
        self._run(f"flush set {self._set_ref(family, table, set_name)}")

    def list_set(self, family: str, table: str, set_name: str) -> list[dict[str, Any]]:
        """Elements as dicts: ``key`` (nft text, as add_elements takes it), ``value``
        (nft's JSON form), ``timeout`` and ``expires`` (seconds, None without timeout)."""
        items = self._run_json(f"list set {self._set_ref(family, table, set_name)}")
        sets = [i["set"] for i in items if "set" in i]
        if not sets:
            return []
        return [_parse_element(e) for e in sets[0].get("elem", [])]

    def allowed_elements(self) -> list[tuple[str, int]]:
        """(key, seconds left; 0 without a timeout) of every element in the sandbox's
        allow sets (``allow4``, ``allow6``); a set that is not there adds nothing."""
        out = []
        for set_name in c.ALLOW_SETS:
            try:
                elements = self.list_set("inet", c.TABLE, set_name)
            except EgressError:
                continue
            out += [(str(e["key"]), int(e["expires"] or 0)) for e in elements]
        return out

    # ---- counters and tables ------------------------------------------------------

    def counter(self, family: str, table: str, name: str) -> Counter:
        """The packets and bytes of a named counter object."""
        ref = f"{_family(family)} {_name('table', table)} {_name('counter', name)}"
        for item in self._run_json(f"list counter {ref}"):
            if "counter" in item:
                return Counter(int(item["counter"]["packets"]), int(item["counter"]["bytes"]))
        raise DatapathError(f"counter {ref} not found")

    def table_exists(self, family: str, table: str) -> bool:
        _name("table", table)
        for item in self._run_json(f"list tables {_family(family)}"):
            if item.get("table", {}).get("name") == table:
                return True
        return False

    def chain_exists(self, family: str, table: str, chain: str) -> bool:
        _name("table", table)
        _name("chain", chain)
        for item in self._run_json(f"list chains {_family(family)}"):
            found = item.get("chain", {})
            if found.get("table") == table and found.get("name") == chain:
                return True
        return False

    def create_table(self, family: str, table: str) -> bool:
        """Make an empty table; False if it is there already. The kernel decides, in one
        transaction: of two callers at once, one gets True."""
        try:
            self._run(f"create table {_family(family)} {_name('table', table)}")
        except DatapathError:
            # EEXIST, whatever the message's words. (A worker that died after the kernel
            # made the table leaves it, empty, and the next attach is told it is taken:
            # `nft delete table inet egress` in that netns clears it.)
            if self.table_exists(family, table):
                return False
            raise
        return True

    def delete_table(self, family: str, table: str) -> None:
        """Delete a table with everything in it; nothing to do if it is absent."""
        try:
            self._run(f"delete table {_family(family)} {_name('table', table)}")
        except DatapathError as exc:
            if "No such file or directory" not in str(exc):
                raise


def _parse_element(raw: Any) -> dict[str, Any]:
    timeout = expires = None
    if isinstance(raw, dict) and "elem" in raw:
        timeout, expires = raw["elem"].get("timeout"), raw["elem"].get("expires")
        raw = raw["elem"]["val"]
    return {"key": _render(raw), "value": raw, "timeout": timeout, "expires": expires}


def _render(value: Any) -> str:
    """nft JSON value → the text form nft accepts (concat, prefix and range aware)."""
    if isinstance(value, dict):
        if "concat" in value:
            return " . ".join(_render(v) for v in value["concat"])
        if "prefix" in value:
            return f"{value['prefix']['addr']}/{value['prefix']['len']}"
        if "range" in value:
            low, high = value["range"]
            return f"{_render(low)}-{_render(high)}"
    return str(value)

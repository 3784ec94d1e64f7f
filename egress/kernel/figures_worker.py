"""egressd's /metrics kernel figures (``nft_figures.Reader``), read in a process of their own.

At 1,000 sandboxes the reads for one scrape take 0.4-0.7 s, mostly Python between system
calls. In a thread of egressd they held the GIL against its event loop, and every answer
of every sandbox waited behind them; a child spawned per scrape was no better, as the
spawn (a fork of egressd) held the loop for 45-230 ms each time. So egressd starts this
worker once, at its own start, and asks it at each scrape over a socket pair, the
sandboxes' netns descriptors passed along (SCM_RIGHTS): a name could name another netns
by now, a descriptor cannot. It runs at nice 10, in a session of its own: its figures can
wait, egressd's answers (nice -10) cannot.

Protocol, one datagram each way (SOCK_SEQPACKET) per request of at most CHUNK sandboxes:
the request is JSON ``{"seq": int, "table": str, "sets": [str], "counter": str, "ids":
[str], "own": [str]}`` with one descriptor per id of ``ids``, in order (``own``:
sandboxes in the worker's own netns, no descriptor); the answer is JSON ``{"seq": int,
"figures": {id: {"sets": {name: int}, "dropped": int|null}}}``, what could be read of
each (a sandbox deleted meanwhile has fewer figures or none), or ``{"error": str}``. The
parent reads only the answer whose seq is its request's. End of the socket (egressd
gone) ends the worker.
"""

from __future__ import annotations

import array
import contextlib
import json
import os
import socket
import subprocess
import sys
import time
from typing import Any

from egress.errors import DatapathError, EgressError
from egress.kernel.nft_figures import Reader

CHUNK = 250  # sandboxes per request: SCM_RIGHTS carries at most 253 descriptors
MAX_MESSAGE = 1 << 20  # an answer of CHUNK sandboxes is ~20 KB
CHILD_NICE = 10
RESTART_AFTER_S = 5.0  # the soonest a failed worker is started again

Figures = tuple[dict[str, int], int | None]  # set sizes by name, the counter's packets


class FiguresWorker:
    """The parent's end: the worker process and its socket (non-blocking, for a loop).

    Nothing here waits for a process on the caller's thread while egressd serves: a
    worker killed is reaped when it has ended (``poll``, at the next start or kill), as
    one stuck in the kernel ends only when its system call returns. Only ``close``, at
    egressd's end, waits (a few seconds at most)."""

    def __init__(self, restart_after_s: float = RESTART_AFTER_S) -> None:
        self._proc: subprocess.Popen[bytes] | None = None
        self._sock: socket.socket | None = None
        self._dying: list[subprocess.Popen[bytes]] = []  # killed, not yet reaped
        self._started_at: float | None = None
        self.restart_after_s = restart_after_s
        self.starts = 0
        self.closed = False

    def socket(self) -> socket.socket:
        """The worker's socket, started first if it is not running. A start spawns a
        process (blocking, ~0.1 s): egressd does it at its own start, and again only
        after a failure, at most once every ``restart_after_s`` (a worker that dies at
        each request must not cost a spawn at each scrape). DatapathError if it cannot."""
        if self.closed:
            raise DatapathError("kernel figures: egressd is stopping")
        if self._proc is not None and self._proc.poll() is None and self._sock is not None:
            return self._sock
        self.kill()
        now = time.monotonic()
        if self._started_at is not None and now - self._started_at < self.restart_after_s:
            wait = self.restart_after_s - (now - self._started_at)
            raise DatapathError(f"kernel figures: their reader failed; started again in "
                                f"{wait:.0f} s")  # fmt: skip
        self._started_at = now
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            # -P: root must not import from whatever directory egressd was started in.
            self._proc = subprocess.Popen(
                [sys.executable, "-P", "-m", "egress.kernel.figures_worker",
                 str(theirs.fileno())],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                pass_fds=[theirs.fileno()],
                # Not egressd's session, whose nice egressd raises (kernel/sched.py):
                # there its own nice 10 would weigh only against egressd.
                start_new_session=True,
            )  # fmt: skip
        except OSError as exc:
            ours.close()
            raise DatapathError(f"kernel figures: cannot start their reader: {exc}") from None
        finally:
            theirs.close()
        ours.setblocking(False)
        self._sock = ours
        self.starts += 1
        return ours

    def kill(self) -> None:
        """End the worker now (by its PID; a request it was answering is abandoned, and
        no answer on its socket is read again: the socket goes with it)."""
        sock, self._sock = self._sock, None
        if sock is not None:
            sock.close()
        proc, self._proc = self._proc, None
        if proc is not None:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            self._dying.append(proc)
        self._dying = [p for p in self._dying if p.poll() is None]

    def close(self, wait_s: float = 5.0) -> None:
        """No more workers: the running one killed, and every one killed reaped (waited
        for up to ``wait_s`` in all; one that outlasts it is left to init)."""
        self.closed = True
        self.kill()
        deadline = time.monotonic() + wait_s
        for proc in self._dying:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(max(0.0, deadline - time.monotonic()))
        self._dying = [p for p in self._dying if p.poll() is None]


def request(
    seq: int, table: str, sets: tuple[str, ...], counter: str,
    chunk: list[tuple[str, int | None]],
) -> tuple[bytes, list[int]]:  # fmt: skip
    """Request ``seq``'s datagram and the descriptors to pass with it, in order."""
    ids = [sid for sid, fd in chunk if fd is not None]
    own = [sid for sid, fd in chunk if fd is None]
    body = {"seq": seq, "table": table, "sets": list(sets), "counter": counter, "ids": ids,
            "own": own}  # fmt: skip
    return json.dumps(body).encode(), [fd for _, fd in chunk if fd is not None]


def send(sock: socket.socket, data: bytes, fds: list[int]) -> None:
    """Send one request; OSError if the worker cannot take it now (its socket is full:
    it is stuck) or is gone."""
    rights = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
    sock.sendmsg([data], rights)


def answer(data: bytes) -> tuple[int, dict[str, Figures]]:
    """The request an answer is to (its ``seq``) and its figures; DatapathError if it is
    an error or malformed."""
    try:
        got = json.loads(data)
        if "error" in got:
            raise DatapathError(f"kernel figures: their reader failed: {got['error']}")
        return int(got["seq"]), {
            str(sid): ({str(k): int(v) for k, v in one["sets"].items()},
                       None if one["dropped"] is None else int(one["dropped"]))
            for sid, one in got["figures"].items()
        }  # fmt: skip
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        raise DatapathError(f"kernel figures: their reader's answer is malformed: {exc}") from None


def read_all(body: dict[str, Any], fds: list[int]) -> dict[str, dict[str, Any]]:
    """What one request asks (``fds``: its descriptors, in the order of its ids)."""
    table, counter = str(body["table"]), str(body["counter"])
    ids: list[str] = [str(sid) for sid in body["ids"]]
    if len(ids) != len(fds):
        raise ValueError(f"{len(ids)} sandboxes but {len(fds)} descriptors")
    wanted: list[tuple[str, str | None]] = [
        (sid, f"/proc/self/fd/{fd}") for sid, fd in zip(ids, fds, strict=True)
    ]
    wanted += [(str(sid), None) for sid in body["own"]]
    out: dict[str, dict[str, Any]] = {}
    for sid, netns in wanted:
        sets: dict[str, int] = {}
        dropped = None
        # A sandbox gone meanwhile, or its table: fewer figures or none.
        with contextlib.suppress(EgressError), Reader(netns, table) as kernel:
            for set_name in body["sets"]:
                sets[str(set_name)] = kernel.set_size(str(set_name))
            dropped = kernel.counter_packets(counter)
        out[sid] = {"sets": sets, "dropped": dropped}
    return out


def serve(fd: int) -> int:
    """The worker's life: a request in, its answer out, until egressd's end closes."""
    with contextlib.suppress(OSError):  # started at egressd's nice -10: give that up
        os.setpriority(os.PRIO_PROCESS, 0, max(os.getpriority(os.PRIO_PROCESS, 0), CHILD_NICE))
    sock = socket.socket(fileno=fd)
    while True:
        try:
            data, fds, _, _ = socket.recv_fds(sock, MAX_MESSAGE, CHUNK)
        except OSError:
            return 1
        if not data:
            return 0
        try:
            body = json.loads(data)
            reply: dict[str, Any] = {"seq": body["seq"], "figures": read_all(body, fds)}
        except (ValueError, TypeError, KeyError) as exc:
            reply = {"error": f"a request it could not read: {exc}"}
        finally:
            for got in fds:
                os.close(got)
        try:
            sock.send(json.dumps(reply).encode())
        except OSError:
            return 1


if __name__ == "__main__":
    sys.exit(serve(int(sys.argv[1])))

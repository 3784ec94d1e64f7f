"""dnsperf inside a sandbox, for as long as a test needs, and its summary parsed.

A fixed ``-l`` is a guess at how long the test's actions (handovers, policy swaps) take,
and on a busy machine they take longer: dnsperf then ends before they do. So ``Dnsperf``
feeds the queries through dnsperf's stdin from a thread instead, for as long as the test
runs, and ``finish`` closes it: dnsperf sends what it was given, waits for every answer
(or its ``-t`` timeout) and reports, so "completed == sent" holds whatever the duration.
"""

from __future__ import annotations

import fcntl
import itertools
import re
import subprocess
import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager, suppress
from typing import Any

RESOLVER = "127.0.0.53"
# Queries fed ahead of what dnsperf has sent: one page of pipe, ~100 lines, so it stops
# about when it is told to (the default 64 KiB pipe holds 2 s of queries at 1,000/s).
PIPE_BYTES = 4096
BATCH = 50


def figures(text: str) -> dict[str, Any]:
    """Queries sent, completed and lost, and the response codes with their counts."""
    out: dict[str, Any] = {}
    for key, pattern in (("sent", r"Queries sent:\s+(\d+)"),
                         ("completed", r"Queries completed:\s+(\d+)"),
                         ("lost", r"Queries lost:\s+(\d+)")):  # fmt: skip
        m = re.search(pattern, text)
        assert m is not None, text
        out[key] = int(m.group(1))
    m = re.search(r"Response codes:\s+(.*)", text)
    out["rcodes"] = dict(re.findall(r"(\w+) (\d+) \(", m.group(1))) if m else {}
    return out


class Dnsperf:
    """``dnsperf -s 127.0.0.53 OPTIONS`` in ``netns``, asking the ``lines`` ("NAME TYPE",
    an endless iterator is fine) until ``finish``."""

    def __init__(self, netns: str, lines: Iterable[str], *options: str) -> None:
        argv = ["ip", "netns", "exec", netns, "dnsperf", "-s", RESOLVER, *options]
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, bufsize=0)  # fmt: skip
        assert self.proc.stdin is not None
        self.stdin = self.proc.stdin
        self.proc.stdin = None  # written by the feeder alone; communicate() leaves it be
        with suppress(OSError):
            fcntl.fcntl(self.stdin.fileno(), fcntl.F_SETPIPE_SZ, PIPE_BYTES)
        self.written = 0  # lines handed to dnsperf: it sends every one before it ends
        self._stop = threading.Event()
        self._feeder = threading.Thread(target=self._feed, args=(iter(lines),), daemon=True)
        self._feeder.start()

    def _feed(self, lines: Iterator[str]) -> None:
        try:
            while not self._stop.is_set():
                batch = list(itertools.islice(lines, BATCH))
                if not batch:
                    break
                self.stdin.write("".join(f"{line}\n" for line in batch).encode())
                self.written += len(batch)
        except OSError:
            pass  # dnsperf is gone (killed): nothing left to feed
        finally:
            with suppress(OSError):
                self.stdin.close()

    def running(self) -> bool:
        return self.proc.poll() is None

    def finish(self, at_least: int = 0, timeout: float = 60.0) -> str:
        """Feed until ``at_least`` lines went in, stop, and return dnsperf's report once
        it has ended (within ``timeout`` s of the stop)."""
        while self.written < at_least and self._feeder.is_alive():
            time.sleep(0.01)
        self._stop.set()
        self._feeder.join(timeout)
        out, _ = self.proc.communicate(timeout=timeout)
        return bytes(out).decode(errors="replace")

    def kill(self) -> None:
        """Stop it now (it is ours: by its PID), if it still runs."""
        self._stop.set()
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)
        self._feeder.join(10)
        if self.proc.stdout is not None:
            self.proc.stdout.close()


@contextmanager
def dnsperf(netns: str, lines: Iterable[str], *options: str) -> Iterator[Dnsperf]:
    """A running ``Dnsperf``, killed on the way out unless the body finished it."""
    perf = Dnsperf(netns, lines, *options)
    try:
        yield perf
    finally:
        perf.kill()

"""The kernel's figures for a /metrics scrape, asked of egressd's figures worker
(kernel/figures_worker.py) without holding the loop: each request is sent at once and its
answer awaited as the loop serves DNS meanwhile."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os

from egress.datapath import constants as c
from egress.errors import DatapathError, EgressError
from egress.kernel import figures_worker as fw

from .metrics import Kernel
from .registry import Served

# For all of a scrape's requests: at 1,000 sandboxes they take 0.25-0.5 s. Under
# Prometheus' default scrape_timeout (10 s), so the scraper still gets the rest, with
# egress_kernel_figures 0, from a worker that hangs.
TIMEOUT_S = 8.0


class KernelFigures:
    """egressd's figures worker, asked one scrape at a time."""

    def __init__(self, timeout_s: float = TIMEOUT_S) -> None:
        self.worker = fw.FiguresWorker()
        self.timeout_s = timeout_s
        self._lock = asyncio.Lock()  # one scrape's requests at a time
        self._seq = itertools.count(1)

    def start(self) -> None:
        """Start the worker now, not in the first scrape (a spawn holds the loop)."""
        self.worker.socket()

    def close(self) -> None:
        """At egressd's end, once no scrape can come: the worker ended and reaped."""
        self.worker.close()

    async def read(self, served: list[Served]) -> dict[str, Kernel]:
        """Each sandbox's set sizes and drop counter. DatapathError if the worker fails or
        does not answer in time; it is ended then (so is it if this read is cancelled),
        and started again at a later scrape."""
        async with self._lock:
            try:
                async with asyncio.timeout(self.timeout_s):
                    return await self._read(served)
            except TimeoutError:
                self.worker.kill()
                raise DatapathError(
                    f"kernel figures: no answer within {self.timeout_s:g} s"
                ) from None
            except OSError as exc:
                self.worker.kill()
                raise DatapathError(f"kernel figures: their reader is gone: {exc}") from None
            except BaseException:  # its error, or cancelled: nothing is left half-asked
                self.worker.kill()
                raise

    async def _read(self, served: list[Served]) -> dict[str, Kernel]:
        loop = asyncio.get_running_loop()
        sock = self.worker.socket()
        out: dict[str, Kernel] = {}
        for start in range(0, len(served), fw.CHUNK):
            chunk: list[tuple[str, int | None]] = []
            try:
                for s in served[start : start + fw.CHUNK]:
                    with contextlib.suppress(EgressError):  # deleted meanwhile: no figures
                        # Its own copy: a delete may close the handle's meanwhile.
                        chunk.append((s.id, s.sb.nft.netns_fd()))
                seq = next(self._seq)
                data, fds = fw.request(seq, c.TABLE, c.ALLOW_SETS, "dropped", chunk)
                fw.send(sock, data, fds)  # the kernel holds its own references from here
            finally:
                for _, fd in chunk:
                    if fd is not None:
                        os.close(fd)
            while True:  # an answer to another request is never taken for this one's
                got = await loop.sock_recv(sock, fw.MAX_MESSAGE)
                if not got:
                    raise DatapathError("kernel figures: their reader ended")
                answered, figures = fw.answer(got)
                if answered == seq:
                    break
            for sid, (sets, dropped) in figures.items():
                out[sid] = Kernel(sets, dropped)
        return out

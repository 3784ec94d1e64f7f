"""The kernel's figures for a /metrics scrape, asked of egressd's figures worker
(kernel/figures_worker.py) without holding the loop: each request is sent at once and its
answer awaited as the loop serves DNS meanwhile."""

from __future__ import annotations

import asyncio
import contextlib
import os

from egress.datapath import constants as c
from egress.errors import DatapathError, EgressError
from egress.kernel import figures_worker as fw

from .metrics import Kernel
from .registry import Served

TIMEOUT_S = 30.0  # for all of a scrape's requests: at 1,000 sandboxes they take ~0.5 s


class KernelFigures:
    """egressd's figures worker, asked one scrape at a time."""

    def __init__(self) -> None:
        self.worker = fw.FiguresWorker()
        self._lock = asyncio.Lock()  # two scrapes at once must not mix their answers

    def start(self) -> None:
        """Start the worker now, not in the first scrape (a spawn holds the loop)."""
        self.worker.socket()

    def close(self) -> None:
        self.worker.kill()

    async def read(self, served: list[Served]) -> dict[str, Kernel]:
        """Each sandbox's set sizes and drop counter. DatapathError if the worker fails or
        does not answer in time; it is ended then, and started again at the next scrape."""
        async with self._lock:
            try:
                async with asyncio.timeout(TIMEOUT_S):
                    return await self._read(served)
            except TimeoutError:
                self.worker.kill()
                raise DatapathError(f"kernel figures: no answer within {TIMEOUT_S:g} s") from None
            except (OSError, EgressError) as exc:
                self.worker.kill()
                if isinstance(exc, EgressError):
                    raise
                raise DatapathError(f"kernel figures: their reader is gone: {exc}") from None

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
                data, fds = fw.request(c.TABLE, c.ALLOW_SETS, "dropped", chunk)
                fw.send(sock, data, fds)  # the kernel holds its own references from here
            finally:
                for _, fd in chunk:
                    if fd is not None:
                        os.close(fd)
            got = await loop.sock_recv(sock, fw.MAX_MESSAGE)
            if not got:
                raise DatapathError("kernel figures: their reader ended")
            for sid, (sets, dropped) in fw.answer(got).items():
                out[sid] = Kernel(sets, dropped)
        return out

"""The resolver's writes to the kernel's allow sets: each add acked, or it failed.

The core plans the adds (``ExpiryBook``: which elements, which timeouts); this carries
them out on egress's own netlink socket in the sandbox's netns (``kernel.nft_sets``, one
nf_tables batch per add), falling back to libnftables for elements that writer does not
understand, and says how many the kernel acked and whether the last ack came too late to
trust (``SET_UPDATE_DEADLINE_S``). The core decides what follows.
"""

from __future__ import annotations

import contextlib
import struct
import time
from dataclasses import dataclass
from typing import NamedTuple

from egress.datapath import constants as c
from egress.datapath.elements import SetAdd, SetUpdate
from egress.errors import EgressError
from egress.kernel.nft import NftHandle
from egress.kernel.nft_sets import SET_UPDATE_DEADLINE_S, NetlinkSets


@dataclass
class SetStats:
    updates: int = 0
    failures: int = 0
    slow: int = 0
    last_ms: float = 0.0


class Applied(NamedTuple):
    acked: int  # how many adds, in order, the kernel acked
    late: bool  # the last ack came after SET_UPDATE_DEADLINE_S


class SetWriter:
    def __init__(self, nft: NftHandle) -> None:
        self.nft = nft
        self.stats = SetStats()
        self._sets: NetlinkSets | None = None

    def open(self) -> None:
        self._sets = _open_sets(self.nft)

    def close(self) -> None:
        if self._sets is not None:
            self._sets.close()
            self._sets = None

    def apply(self, adds: tuple[SetAdd, ...]) -> Applied:
        start = time.monotonic()
        acked = 0
        try:
            for add in adds:
                self._add(add.set_name, add.elements, add.timeout_s)
                acked += 1
        except (EgressError, OSError, ValueError, struct.error):  # any failure: SERVFAIL
            self.stats.failures += 1
            return Applied(acked, False)
        elapsed = time.monotonic() - start
        self.stats.updates += 1
        self.stats.last_ms = elapsed * 1000
        late = elapsed > SET_UPDATE_DEADLINE_S  # too late to trust: SERVFAIL, and revoked
        self.stats.slow += late
        return Applied(acked, late)

    def revoke(self, update: SetUpdate) -> None:
        """Best effort: what cannot be deleted expires with its timeout."""
        with contextlib.suppress(EgressError):
            self._revoke(update)

    def _add(self, family_set: str, elements: tuple[str, ...], timeout_s: int) -> None:
        if self._sets is not None:
            try:
                self._sets.add(family_set, elements, timeout_s)
                return
            except (ValueError, KeyError):
                pass  # not elements this writer understands: libnftables knows more
        self.nft.add_elements("inet", c.TABLE, family_set, list(elements), timeout_s)

    def _revoke(self, update: SetUpdate) -> None:
        for family_set, elements in update.by_set():
            if not elements:
                continue
            if self._sets is not None:
                try:
                    self._sets.delete(family_set, elements)
                    continue
                except (ValueError, KeyError, OSError):
                    pass  # libnftables says why, or skips the ones already gone
            self.nft.delete_elements("inet", c.TABLE, family_set, list(elements), missing_ok=True)


def _open_sets(nft: NftHandle) -> NetlinkSets | None:
    """A netlink writer in the netns of the sandbox's nft handle (None: use libnftables)."""
    try:
        return NetlinkSets(nft.netns)
    except (OSError, EgressError, AttributeError):
        return None

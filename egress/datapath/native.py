"""The NFLOG copies' walk compiled by mypyc, used when a build matches the sources
(``egress.native``). The observer runs it on every DNS query and answer it is copied."""

from __future__ import annotations

from pathlib import Path

from egress.native import Native

NATIVE = Native("egress.datapath", Path(__file__).resolve().parent, ("nflog_wire",))

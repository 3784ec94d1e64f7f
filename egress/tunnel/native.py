"""The scorer's modules compiled by mypyc, used when a build matches the sources.

Scoring a new name runs a few hundred bytecodes per label (tables, windows, Bloom
filters, label statistics); mypyc compiles the same typed modules to C, which makes
scoring a new name 3-4.5x cheaper (``bench/bench_tunnel.py`` prints both). The modules
are written for it: Final constants, hashes cut to 62 bits, lists where an array would
be indexed through a call, methods called as such. The Python sources stay the truth:

- ``python -m egress.cli.native_build`` (``make setup`` runs it) compiles ``MODULES`` into
  ``_native/`` next to this file, with ``SOURCES``: the interpreter, the sha256 of each
  source it compiled and of each file it built;
- on import, ``egress.tunnel`` calls ``activate``: if every source still has the hash it
  was built from, ``_native/`` goes first on the package's search path and the compiled
  modules are the ones imported; otherwise (a source edited since, no build, another
  Python) the sources are, unchanged and only slower. ``EGRESS_NATIVE=0`` asks for the
  sources whatever is built.

``in_use()`` says which; ``bench/bench_tunnel.py`` prints it, and its figures for both.
"""

from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
BUILD = HERE / "_native"
STAMP = BUILD / "SOURCES"
GROUP = "egress.tunnel.native_core"  # the shared library every compiled module uses
# The hot path of a new name, and what it calls. Not __init__ (it decides) nor this file.
MODULES = (
    "entropy",
    "features",
    "labels",
    "overrides",
    "scorer",
    "verdict",
    "vocab",
    "window",
    "zone",
)


def digests(root: Path | None = None) -> str:
    """The first lines of the stamp a build of the sources under ``root`` (this package)
    carries: the interpreter, then one line per module."""
    root = root or HERE
    lines = [f"{sys.implementation.cache_tag}"]
    for name in MODULES:
        data = (root / f"{name}.py").read_bytes()
        lines.append(f"{hashlib.sha256(data).hexdigest()}  {name}.py")
    return "\n".join(lines) + "\n"


def fresh() -> bool:
    """A build exists, was made from exactly these sources for this interpreter, every file
    it lists is there as built, and only root or this user could have put it there."""
    try:
        st = BUILD.stat()
        if st.st_uid not in (0, os.getuid()) or st.st_mode & 0o022:
            return False
        stamp = STAMP.read_text(encoding="ascii")
        sources = digests()
        if not stamp.startswith(sources):
            return False
        built = [line.split("  ", 1) for line in stamp[len(sources) :].splitlines()]
        if len(built) != len(MODULES) + 1:  # each module and the group's shared library
            return False
        return all(
            len(entry) == 2
            and hashlib.sha256((BUILD / entry[1]).read_bytes()).hexdigest() == entry[0]
            for entry in built
        )
    except (OSError, UnicodeDecodeError):
        return False


def activate(path: list[str]) -> bool:
    """Put a fresh build first on ``path`` (``egress.tunnel.__path__``); True if it is."""
    if os.environ.get("EGRESS_NATIVE", "1") == "0" or not fresh():
        return False
    path.insert(0, str(BUILD))
    return True


def in_use() -> str:
    """ "compiled (mypyc)" or "Python sources", as the scorer's modules were imported."""
    from egress.tunnel import scorer

    return "compiled (mypyc)" if Path(scorer.__file__).parent == BUILD else "Python sources"

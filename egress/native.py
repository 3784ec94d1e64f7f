"""Hot modules compiled by mypyc, used only while a build matches their sources.

Three packages have modules compiled by mypyc (typed, ``Final`` constants, loops over
bytes and ints that compile to C): the tunnel scorer (``egress.tunnel.native``: scoring a
new name), the NFLOG copies' walk (``egress.datapath.native``: the observer's look at
every DNS packet) and the resolver core (``egress.resolver.native``: every query's parse,
judgement, replay, and a miss's answer). Each package names its modules in a ``Native``;
the Python sources stay the truth:

- ``python -m egress.cli.native_build`` (``make setup`` runs it) compiles each package's
  modules into ``_native/`` next to them, with ``SOURCES``: the interpreter, the sha256
  of each source it compiled and of each file it built;
- on import, the package's ``__init__`` calls ``activate``: if every source still has the
  hash it was built from, ``_native/`` goes first on the package's search path and the
  compiled modules are the ones imported; otherwise (a source edited since, no build,
  another Python) the sources are, unchanged and only slower. ``EGRESS_NATIVE=0`` asks for
  the sources whatever is built.

``in_use()`` says which; the benches print it.
"""

from __future__ import annotations

import hashlib
import importlib
import os
import sys
from dataclasses import dataclass
from pathlib import Path


@dataclass
class Native:
    """The compiled build of ``modules`` of ``package`` (whose directory is ``here``)."""

    package: str  # "egress.tunnel"
    here: Path
    modules: tuple[str, ...]  # the hot path: not __init__ (it decides) nor its native.py

    @property
    def build(self) -> Path:
        return self.here / "_native"

    @property
    def stamp(self) -> Path:
        return self.build / "SOURCES"

    @property
    def group(self) -> str:
        """The shared library every compiled module of the package uses."""
        return f"{self.package}.native_core"

    def digests(self, root: Path | None = None) -> str:
        """The first lines of the stamp a build of the sources under ``root`` (the
        package's directory) carries: the interpreter, then one line per module."""
        root = root or self.here
        lines = [f"{sys.implementation.cache_tag}"]
        for name in self.modules:
            data = (root / f"{name}.py").read_bytes()
            lines.append(f"{hashlib.sha256(data).hexdigest()}  {name}.py")
        return "\n".join(lines) + "\n"

    def fresh(self) -> bool:
        """A build exists, was made from exactly these sources for this interpreter, every
        file it lists is there as built, and only root or this user could have put it
        there."""
        try:
            st = self.build.stat()
            if st.st_uid not in (0, os.getuid()) or st.st_mode & 0o022:
                return False
            stamp = self.stamp.read_text(encoding="ascii")
            sources = self.digests()
            if not stamp.startswith(sources):
                return False
            built = [line.split("  ", 1) for line in stamp[len(sources) :].splitlines()]
            if len(built) != len(self.modules) + 1:  # each module and the shared library
                return False
            return all(
                len(entry) == 2
                and hashlib.sha256((self.build / entry[1]).read_bytes()).hexdigest() == entry[0]
                for entry in built
            )
        except (OSError, UnicodeDecodeError):
            return False

    def activate(self, path: list[str]) -> bool:
        """Put a fresh build first on ``path`` (the package's ``__path__``); True if it is."""
        if os.environ.get("EGRESS_NATIVE", "1") == "0" or not self.fresh():
            return False
        path.insert(0, str(self.build))
        return True

    def in_use(self) -> str:
        """ "compiled (mypyc)" or "Python sources", as the package's modules were imported."""
        first = importlib.import_module(f"{self.package}.{self.modules[0]}")
        # Under the build: a module imported by another of its group has a __file__ of
        # _native/egress/<package>/..., not _native/...
        compiled = Path(first.__file__ or "").is_relative_to(self.build)
        return "compiled (mypyc)" if compiled else "Python sources"

"""Hot modules compiled by mypyc, used only while a build matches their sources.

Four packages have modules compiled by mypyc (typed; loops over bytes and ints, and
the tunnel's ``Final`` constants, compile to C): the tunnel scorer
(``egress.tunnel.native``: scoring a new name), the NFLOG copies' walk
(``egress.datapath.native``: the observer's look at every DNS packet), the resolver
core (``egress.resolver.native``: every query's parse, judgement, replay, and a miss's
answer) and the observer's sift (``egress.observer.native``: the copies of repeated
queries and of answers it deals with before making events). Each package names its
modules in a ``Native``; the Python sources stay the truth:

- ``python -m egress.cli.native_build`` (``make setup`` runs it) compiles each package's
  modules into ``_native/`` next to them, with ``SOURCES``: the interpreter, the sha256
  of each source it compiled and of each file it built;
- on import, the package's ``__init__`` calls ``activate``: if every source still has the
  hash it was built from, ``_native/`` goes first on the package's search path and the
  compiled modules are the ones imported; otherwise (a source edited since, no build,
  another Python) the sources are, unchanged and only slower. ``EGRESS_NATIVE=0`` asks for
  the sources whatever is built.

A build is also stale once a module of egress the compiled ones import has changed
(``dependencies``, in the stamp): compiled code checks the values it gets against the
declarations it was compiled with.

Compiled classes differ from the sources' in what egress never does with them, so keep
it so: a frozen dataclass cannot be copied or pickled (``FrozenInstanceError``), an
instance takes no attribute its class does not declare, a module function replaced at
run time is not what compiled callers call, and a ``bytes`` parameter refuses a
``bytearray`` (mypy's strict bytes catches that in egress/, not in tests).

``in_use()`` says which; the benches print it.
"""

from __future__ import annotations

import ast
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

    def digests(self, root: Path | None = None, deps: tuple[str, ...] = ()) -> str:
        """The first lines of the stamp a build of the sources under ``root`` (the
        package's directory) carries: the interpreter, one line per module, then one per
        module of egress they import (``deps``, paths under egress/, ``dependencies``).

        The compiled code holds what it was compiled against of those: a function's
        declared types, a class's fields. One edited since, it would check its callers'
        values against the old declarations (a TypeError), so the build is stale too."""
        root = root or self.here
        lines = [f"{sys.implementation.cache_tag}"]
        for name in self.modules:
            data = (root / f"{name}.py").read_bytes()
            lines.append(f"{hashlib.sha256(data).hexdigest()}  {name}.py")
        for dep in deps:
            try:
                digest = hashlib.sha256((root.parent / dep).read_bytes()).hexdigest()
            except FileNotFoundError:
                digest = "missing"
            lines.append(f"{digest}  {_DEP}{dep}")
        return "\n".join(lines) + "\n"

    def dependencies(self, root: Path | None = None) -> tuple[str, ...]:
        """Every other module of egress the modules under ``root`` import, directly or
        through one another (their packages' ``__init__`` too), as paths under egress/:
        what the build looks at besides the modules. Read from the sources' import
        statements (those under ``TYPE_CHECKING`` too), at build time only."""
        root = root or self.here
        top = root.parent  # egress/
        own = {root / f"{name}.py" for name in self.modules}
        seen: set[Path] = set()
        todo = sorted(own)
        while todo:
            path = todo.pop()
            for found in _imported(path, top):
                if found not in seen and found not in own:
                    seen.add(found)
                    todo.append(found)
        return tuple(sorted(str(p.relative_to(top)) for p in seen))

    def fresh(self) -> bool:
        """A build exists, was made from exactly these sources for this interpreter, every
        file it lists is there as built, and only root or this user could have put it
        there."""
        try:
            st = self.build.stat()
            if st.st_uid not in (0, os.getuid()) or st.st_mode & 0o022:
                return False
            stamp = self.stamp.read_text(encoding="ascii")
            deps = tuple(
                line.split(f"  {_DEP}", 1)[1] for line in stamp.splitlines() if f"  {_DEP}" in line
            )
            sources = self.digests(deps=deps)
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


_DEP = "dep "  # a stamp line of a module the compiled ones import: "<sha256>  dep <path>"


def _imported(path: Path, top: Path) -> set[Path]:
    """The files of egress (under ``top``) that ``path``'s import statements load: each
    named module, a name that is itself a module (``from egress.x import y``), and the
    packages' ``__init__`` on the way."""
    tree = ast.parse(path.read_bytes(), str(path))
    package = list(path.relative_to(top.parent).parent.parts)  # ["egress", "resolver"]
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            # "from . import x" in egress/a/b.py is egress.a.x; "from ..c import y", egress.c.y
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join([*base, *([node.module] if node.module else [])])
            names.add(module)
            names.update(f"{module}.{alias.name}" for alias in node.names)
    out: set[Path] = set()
    for name in names:
        parts = name.split(".")
        if parts[0] != top.name:
            continue
        for depth in range(1, len(parts) + 1):
            where = top.parent.joinpath(*parts[:depth])
            for candidate in (where / "__init__.py", where.with_suffix(".py")):
                if candidate.is_file():
                    out.add(candidate)
    return out

"""The scorer's modules compiled by mypyc, used when a build matches the sources.

Scoring a new name runs a few hundred bytecodes per label (tables, windows, Bloom
filters, label statistics); mypyc compiles the same typed modules to C, which makes
scoring a new name 1.4-1.9x cheaper (``bench/bench_tunnel.py`` prints both). The Python
sources stay the truth:

- ``native.build()`` (``make setup`` runs it) compiles ``MODULES`` into ``_native/`` next
  to this file, with ``SOURCES``: the interpreter and the sha256 of each source;
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


def digests() -> str:
    """The stamp a build of the current sources carries: one line per module, and the
    interpreter it was built for."""
    lines = [f"{sys.implementation.cache_tag}"]
    for name in MODULES:
        data = (HERE / f"{name}.py").read_bytes()
        lines.append(f"{hashlib.sha256(data).hexdigest()}  {name}.py")
    return "\n".join(lines) + "\n"


def fresh() -> bool:
    """A build exists and was made from exactly these sources, for this interpreter."""
    try:
        return STAMP.read_text(encoding="ascii") == digests()
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


def build() -> None:
    """Compile ``MODULES`` into ``_native/`` and stamp it. Needs mypy (mypyc) and a C
    compiler with Python's headers (Debian: gcc, python3-dev)."""
    import shutil
    import tempfile

    from mypyc.build import mypycify
    from setuptools import Distribution  # type: ignore[import-untyped,unused-ignore]

    root = HERE.parent.parent  # mypyc names modules by their path: egress/tunnel/x.py
    sources = [str(Path("egress") / "tunnel" / f"{name}.py") for name in MODULES]
    stamp = digests()
    with tempfile.TemporaryDirectory(prefix="egress-native-") as tmp:
        cwd = Path.cwd()
        os.chdir(root)
        try:
            extensions = mypycify(
                sources, opt_level="3", group_name=GROUP, target_dir=str(Path(tmp) / "c")
            )
            dist = Distribution({"name": "egress-native", "ext_modules": extensions})
            cmd = dist.get_command_obj("build_ext")
            cmd.build_lib = str(Path(tmp) / "lib")  # type: ignore[attr-defined,unused-ignore]
            cmd.build_temp = str(Path(tmp) / "obj")  # type: ignore[attr-defined,unused-ignore]
            dist.run_command("build_ext")
        finally:
            os.chdir(cwd)
        built = sorted((Path(tmp) / "lib" / "egress" / "tunnel").glob("*.so"))
        if len(built) != len(MODULES) + 1:
            raise SystemExit(f"mypyc built {len(built)} modules, expected {len(MODULES) + 1}")
        staging = Path(tempfile.mkdtemp(prefix="_native.", dir=HERE))
        for so in built:
            shutil.copy2(so, staging / so.name)
        (staging / "SOURCES").write_text(stamp, encoding="ascii")
        # Replace the old build in one rename, so no import sees half of each.
        old = HERE / f"_native.old.{os.getpid()}"
        if BUILD.exists():
            BUILD.rename(old)
        staging.rename(BUILD)
        shutil.rmtree(old, ignore_errors=True)
    print(f"compiled {len(MODULES)} modules into {BUILD}")

"""``python -m egress.cli.native_build``: compile egress's hot modules with mypyc.

``make setup`` runs it. For each package with a ``Native`` (``PACKAGES``: the tunnel
scorer, the NFLOG copies' walk, the resolver core, the observer's sift) it compiles the
package's modules from a copy of egress (so the stamp describes exactly the bytes
compiled, even if a source is edited meanwhile), with the project's mypy settings, and
replaces the package's ``_native/`` in one rename, under a lock, so no import sees half
of an old and half of a new build. Needs mypy (mypyc), setuptools, and a C compiler with
Python's headers (Debian: gcc, python3-dev).
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import sys
import tempfile
from pathlib import Path

from egress.datapath.native import NATIVE as DATAPATH
from egress.native import Native
from egress.observer.native import NATIVE as OBSERVER
from egress.resolver.native import NATIVE as RESOLVER
from egress.tunnel.native import NATIVE as TUNNEL

PACKAGES = (TUNNEL, DATAPATH, RESOLVER, OBSERVER)


def build(native: Native) -> Path:
    from mypyc.build import mypycify
    from setuptools import Distribution  # type: ignore[import-untyped,unused-ignore]

    package = native.here.parent  # egress/
    sub = native.package.split(".", 1)[1]  # "tunnel"
    with (native.here / ".native.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        with tempfile.TemporaryDirectory(prefix="egress-native-") as tmp:
            work = Path(tmp)
            shutil.copytree(
                package,
                work / "egress",
                ignore=shutil.ignore_patterns("_native*", "__pycache__", "*.so", ".native.lock"),
            )
            # mypy's settings (dnslib has no stubs), as `make lint` checks the same modules;
            # none beside an installed egress: the compiled modules import no dnslib
            if (package.parent / "pyproject.toml").is_file():
                shutil.copy2(package.parent / "pyproject.toml", work / "pyproject.toml")
            sources = native.digests(
                work / "egress" / sub, native.dependencies(work / "egress" / sub)
            )
            cwd = Path.cwd()
            os.chdir(work)  # mypyc names modules by their path: egress/tunnel/x.py
            try:
                extensions = mypycify(
                    [f"egress/{sub}/{name}.py" for name in native.modules],
                    opt_level="3",
                    group_name=native.group,
                    target_dir=str(work / "c"),
                )
                dist = Distribution({"name": "egress-native", "ext_modules": extensions})
                cmd = dist.get_command_obj("build_ext")
                cmd.build_lib = str(work / "lib")  # type: ignore[attr-defined,unused-ignore]
                cmd.build_temp = str(work / "obj")  # type: ignore[attr-defined,unused-ignore]
                dist.run_command("build_ext")
            finally:
                os.chdir(cwd)
            built = sorted((work / "lib" / "egress" / sub).glob("*.so"))
            if len(built) != len(native.modules) + 1:
                raise SystemExit(
                    f"mypyc built {len(built)} modules of {native.package}, "
                    f"expected {len(native.modules) + 1}"
                )
            staging = Path(tempfile.mkdtemp(prefix="_native.", dir=native.here))
            staging.chmod(0o755)  # as the sources: readable by whoever runs them
            lines = [sources]
            for so in built:
                shutil.copy2(so, staging / so.name)
                lines.append(f"{hashlib.sha256(so.read_bytes()).hexdigest()}  {so.name}\n")
            (staging / "SOURCES").write_text("".join(lines), encoding="ascii")
        old = native.here / f"_native.old.{os.getpid()}"
        if native.build.exists():
            native.build.rename(old)
        staging.rename(native.build)
        shutil.rmtree(old, ignore_errors=True)
    return native.build


def main() -> None:
    stale = False
    for native in PACKAGES:
        where = build(native)
        fresh = "in use" if native.fresh() else "NOT in use: a source changed while it was built"
        count = f"{len(native.modules)} module{'s' if len(native.modules) > 1 else ''}"
        print(f"compiled {count} of {native.package} into {where} ({fresh})")
        stale = stale or not native.fresh()
    if stale:
        sys.exit(1)


if __name__ == "__main__":
    main()

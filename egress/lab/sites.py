"""The lab's sites: what real developer tools fetch, made at ``lab up`` from nothing.

pip, npm and git must be shown to work inside a sandbox, and the lab has no route to
PyPI, npmjs or GitHub, so it carries small stand-ins, served by the lab web server
(web.py) to requests whose Host names them. Everything is built here from bytes in this
file, with no network and no build tools: a wheel is a zip with three metadata files, an
npm package a gzipped tar, a git repository four plumbing commands. Fixed timestamps
make each build byte-identical, so tests can compare digests and commit ids::

    RUN_DIR/sites/
      pypi.lab.test/simple/index.html                      PEP 503 project list
      pypi.lab.test/simple/egress-lab-hello/index.html     its files, each with #sha256=
      pypi.lab.test/packages/egress_lab_hello-1.0.0-py3-none-any.whl
      npm.lab.test/egress-lab-hello/index.json             the packument (GET /egress-lab-hello)
      npm.lab.test/egress-lab-hello/-/egress-lab-hello-1.0.0.tgz
      git.lab.test/hello.git/                              bare repository, dumb HTTP
    RUN_DIR/tls/ca.pem server.pem server.key               a CA made for this lab alone

The CA's key is deleted once the server certificate is signed: nothing else can be
issued under it. The certificate covers lab.test and *.lab.test. Without ``git`` the git
site is left out; without ``openssl`` there is no TLS (port 443 stays plain HTTP).
"""

from __future__ import annotations

import base64
import gzip
import hashlib
import io
import json
import os
import secrets
import shutil
import subprocess
import tarfile
import zipfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from egress.errors import LabError

PYPI_SITE, NPM_SITE, GIT_SITE = "pypi.lab.test", "npm.lab.test", "git.lab.test"
PACKAGE, VERSION = "egress-lab-hello", "1.0.0"
MODULE = "egress_lab_hello"
GREETING = "hello from the egress lab"
WHEEL = f"{MODULE}-{VERSION}-py3-none-any.whl"
TARBALL = f"{PACKAGE}-{VERSION}.tgz"
REPO = "hello.git"
GIT_FILES = {
    "README.md": "# hello\n\nA repository served by the egress lab, over dumb HTTP.\n",
    "hello.txt": f"{GREETING}, over git\n",
}
TLS_NAMES = ("lab.test", "*.lab.test")
TOOL_SECONDS = 20.0
_EPOCH = 1577836800  # 2020-01-01T00:00:00Z: every timestamp in what is built here


@dataclass(frozen=True)
class Sites:
    """What ``build`` made: the sites' root (one directory per Host name) and TLS files."""

    root: str
    names: tuple[str, ...]
    ca_file: str = ""  # empty: no openssl, no TLS
    cert_file: str = ""
    key_file: str = ""
    git_commit: str = ""


def build(run_dir: str | Path) -> Sites:
    """Build every site under ``run_dir``; LabError when a tool fails."""
    root = Path(run_dir) / "sites"
    root.mkdir(mode=0o755)
    build_pypi(root / PYPI_SITE)
    build_npm(root / NPM_SITE)
    names = [PYPI_SITE, NPM_SITE]
    commit = ""
    if shutil.which("git"):
        commit = build_git(root / GIT_SITE / REPO)
        names.append(GIT_SITE)
    if not shutil.which("openssl"):
        return Sites(str(root), tuple(names), git_commit=commit)
    ca, cert, key = make_tls(Path(run_dir) / "tls", TLS_NAMES)
    return Sites(str(root), tuple(names), str(ca), str(cert), str(key), commit)


def _write(path: Path, data: bytes | str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data.encode() if isinstance(data, str) else data)


def _b64(data: bytes, urlsafe: bool = False) -> str:
    text = base64.urlsafe_b64encode(data) if urlsafe else base64.b64encode(data)
    return text.decode().rstrip("=") if urlsafe else text.decode()


# -- a PEP 503 simple index with one wheel ----------------------------------------------


def wheel_bytes() -> bytes:
    """A pure-Python wheel (PEP 427): the module, METADATA, WHEEL and RECORD."""
    info = f"{MODULE}-{VERSION}.dist-info"
    files = {
        f"{MODULE}/__init__.py": f'"""Served by the egress lab."""\n\nGREETING = "{GREETING}"\n',
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {PACKAGE}\nVersion: {VERSION}\n"
        "Summary: A package served by the egress lab's index\n",
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: egress.lab\nRoot-Is-Purelib: true\n"
        "Tag: py3-none-any\n",
    }
    lines = []
    for name, text in files.items():
        digest = _b64(hashlib.sha256(text.encode()).digest(), urlsafe=True)
        lines.append(f"{name},sha256={digest},{len(text.encode())}")
    files[f"{info}/RECORD"] = "\n".join([*lines, f"{info}/RECORD,,"]) + "\n"
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as whl:
        for name, text in files.items():
            entry = zipfile.ZipInfo(name, date_time=(2020, 1, 1, 0, 0, 0))
            entry.external_attr = 0o644 << 16
            entry.compress_type = zipfile.ZIP_DEFLATED
            whl.writestr(entry, text)
    return buf.getvalue()


def _links_page(title: str, links: Mapping[str, str]) -> str:
    body = "".join(f'<a href="{href}">{text}</a><br>\n' for text, href in links.items())
    return (
        '<!DOCTYPE html>\n<html><head><meta name="pypi:repository-version" content="1.0">'
        f"<title>{title}</title></head>\n<body><h1>{title}</h1>\n{body}</body></html>\n"
    )


def build_pypi(site: Path) -> None:
    wheel = wheel_bytes()
    _write(site / "packages" / WHEEL, wheel)
    href = f"../../packages/{WHEEL}#sha256={hashlib.sha256(wheel).hexdigest()}"
    _write(
        site / "simple" / PACKAGE / "index.html", _links_page(f"Links for {PACKAGE}", {WHEEL: href})
    )
    _write(site / "simple" / "index.html", _links_page("Simple index", {PACKAGE: f"{PACKAGE}/"}))


# -- an npm registry with one package ---------------------------------------------------


def package_json() -> dict[str, str]:
    return {
        "name": PACKAGE,
        "version": VERSION,
        "description": "A package served by the egress lab's registry",
        "main": "index.js",
        "license": "Apache-2.0",
    }


def tarball_bytes() -> bytes:
    """What `npm pack` makes: package/... in a gzipped tar."""
    files = {
        "package/package.json": json.dumps(package_json(), indent=2) + "\n",
        "package/index.js": f'module.exports = "{GREETING}";\n',
    }
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for name, text in files.items():
            data = text.encode()
            member = tarfile.TarInfo(name)
            member.size, member.mode, member.mtime = len(data), 0o644, _EPOCH
            tar.addfile(member, io.BytesIO(data))
    return gzip.compress(raw.getvalue(), mtime=_EPOCH)


def packument(tarball: bytes) -> dict[str, object]:
    """The registry's document for the package (GET /NAME), as npm expects it."""
    dist = {
        "tarball": f"http://{NPM_SITE}/{PACKAGE}/-/{TARBALL}",
        "shasum": hashlib.sha1(tarball).hexdigest(),
        "integrity": "sha512-" + _b64(hashlib.sha512(tarball).digest()),
    }
    version = {**package_json(), "_id": f"{PACKAGE}@{VERSION}", "dist": dist}
    return {"name": PACKAGE, "dist-tags": {"latest": VERSION}, "versions": {VERSION: version}}


def build_npm(site: Path) -> None:
    tarball = tarball_bytes()
    _write(site / PACKAGE / "-" / TARBALL, tarball)
    _write(site / PACKAGE / "index.json", json.dumps(packument(tarball), indent=2) + "\n")


# -- a git repository for dumb HTTP -----------------------------------------------------


def _git_env(home: Path) -> dict[str, str]:
    """Only what the commands below need: no user's or system's git config applies."""
    who = {"NAME": "egress lab", "EMAIL": "lab@lab.test", "DATE": f"{_EPOCH} +0000"}
    env = {f"GIT_{role}_{k}": v for role in ("AUTHOR", "COMMITTER") for k, v in who.items()}
    return {
        **env,
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(home),
        "GIT_CONFIG_NOSYSTEM": "1",
        "GIT_CONFIG_GLOBAL": os.devnull,
        "LC_ALL": "C",
    }


def _git(repo: Path, args: Sequence[str], stdin: str = "") -> str:
    argv = ["git", "--git-dir", str(repo), *args]
    try:
        done = subprocess.run(
            argv, input=stdin, capture_output=True, text=True, timeout=TOOL_SECONDS,
            env=_git_env(repo.parent), check=False,
        )  # fmt: skip
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise LabError(f"{' '.join(argv)}: {exc}") from exc
    if done.returncode != 0:
        raise LabError(f"{' '.join(argv)}: {done.stderr.strip() or f'exit {done.returncode}'}")
    return done.stdout.strip()


def build_git(repo: Path) -> str:
    """A bare repository with one commit of GIT_FILES on main; returns the commit id."""
    repo.parent.mkdir(parents=True, exist_ok=True)
    _git(repo, ["init", "--quiet", "--bare", "--template=", "--initial-branch=main"])
    tree = "".join(
        f"100644 blob {_git(repo, ['hash-object', '-w', '--stdin'], text)}\t{name}\n"
        for name, text in sorted(GIT_FILES.items())
    )
    commit = _git(repo, ["commit-tree", _git(repo, ["mktree"], tree), "-m", "hello"])
    _git(repo, ["update-ref", "refs/heads/main", commit])
    _git(repo, ["update-server-info"])  # info/refs and objects/info/packs, for dumb HTTP
    return commit


# -- TLS: a CA for this lab and one server certificate ----------------------------------


def _openssl(args: Sequence[str]) -> None:
    argv = ["openssl", *args]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=TOOL_SECONDS)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise LabError(f"openssl {args[0]}: {exc}") from exc
    if done.returncode != 0:
        raise LabError(f"openssl {args[0]}: {done.stderr.strip() or f'exit {done.returncode}'}")


_EC = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes"]
_SERVER_EXTENSIONS = (
    "basicConstraints=critical,CA:FALSE\nkeyUsage=critical,digitalSignature\n"
    "extendedKeyUsage=serverAuth\nsubjectKeyIdentifier=hash\nauthorityKeyIdentifier=keyid\n"
)


def make_tls(directory: Path, names: Sequence[str]) -> tuple[Path, Path, Path]:
    """(ca.pem, server.pem, server.key): a fresh CA, valid 30 days, and a certificate
    for ``names`` signed by it."""
    directory.mkdir(mode=0o755)
    ca, ca_key = directory / "ca.pem", directory / "ca.key"
    cert, key = directory / "server.pem", directory / "server.key"
    csr, ext = directory / "server.csr", directory / "server.ext"
    _openssl(["req", "-x509", *_EC, "-keyout", str(ca_key), "-out", str(ca), "-days", "30",
              "-subj", f"/CN=egress lab CA {secrets.token_hex(4)}",
              "-addext", "basicConstraints=critical,CA:TRUE",
              "-addext", "keyUsage=critical,keyCertSign,cRLSign"])  # fmt: skip
    _openssl(
        ["req", "-new", *_EC, "-keyout", str(key), "-out", str(csr), "-subj", f"/CN={names[0]}"]
    )
    sans = ",".join(f"DNS:{n}" for n in names)
    ext.write_text(f"{_SERVER_EXTENSIONS}subjectAltName={sans}\n", encoding="utf-8")
    _openssl(["x509", "-req", "-in", str(csr), "-CA", str(ca), "-CAkey", str(ca_key),
              "-set_serial", str(secrets.randbits(63)), "-days", "30",
              "-extfile", str(ext), "-out", str(cert)])  # fmt: skip
    for done in (ca_key, csr, ext):
        done.unlink()
    key.chmod(0o600)
    ca.chmod(0o644)
    return ca, cert, key

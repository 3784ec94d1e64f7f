"""Where egress keeps runtime state, who may read it, and where it finds its nft templates.

egress's own files (the run dir and everything egress puts under it, the state dir and the
journal) are root's and the ``egress`` group's only: directories at most 0750, files at
most 0640, group ``egress`` when that group exists, else root's. A claim names a sandbox's
netns and addresses, a record holds its whole policy, the journal what it tried: none of
that is the workload's business. Modes are only ever narrowed (an administrator's 0700
stays 0700), so a directory an older egress made 0755 is tightened the next time egress
opens it.
"""

from __future__ import annotations

import contextlib
import errno
import grp
import os
import stat
import sys
import tempfile
from pathlib import Path

import egress
from egress.datapath.constants import NETNS_DIR  # where kernel.netns pins sandboxes' netns
from egress.errors import EgressError

DEFAULT_RUN_DIR = "/run/egress"
DEFAULT_STATE_DIR = "/var/lib/egress"
DEFAULT_WORKLOADS_DIR = "/var/lib/egress/workloads"
EGRESS_GROUP = "egress"
DIR_MODE = 0o750
FILE_MODE = 0o640


def netns_name(sandbox_id: str) -> str:
    """The sandbox's netns name: the host's, shared by every run dir."""
    return f"egress-{sandbox_id}"


def netns_pin(netns: str) -> str:
    """Where the netns named ``netns`` is pinned."""
    return f"{NETNS_DIR}/{netns}"


def sandbox_pin(sandbox_id: str) -> str:
    """Where the sandbox's netns is pinned, for its whole life (gone with it, and with a
    reboot): what the claims and the uid ledger both look for."""
    return netns_pin(netns_name(sandbox_id))


def run_dir() -> Path:
    """Volatile state (claims, egressd's records): EGRESS_RUN_DIR, default /run/egress."""
    return Path(os.environ.get("EGRESS_RUN_DIR", DEFAULT_RUN_DIR))


def workloads_dir() -> Path:
    """Per-sandbox workload files (private $HOME, mount points): EGRESS_WORKLOADS_DIR,
    default /var/lib/egress/workloads. On disk, not under /run: a $HOME holds caches
    (pip, npm) that must not fill the host's /run tmpfs."""
    return Path(os.environ.get("EGRESS_WORKLOADS_DIR", DEFAULT_WORKLOADS_DIR))


def default_state_dir() -> Path:
    """Durable state (the journal): $EGRESS_STATE_DIR, else /var/lib/egress."""
    return Path(os.environ.get("EGRESS_STATE_DIR") or DEFAULT_STATE_DIR)


def state_dir(option: str | Path | None = None) -> Path:
    """``--state-dir`` if given, else $EGRESS_STATE_DIR, else /var/lib/egress."""
    return Path(option) if option else default_state_dir()


def egress_gid() -> int:
    """The group that may read egress's files: ``egress`` if it exists, else root's (0)."""
    try:
        return grp.getgrnam(EGRESS_GROUP).gr_gid
    except KeyError:
        return 0


def private_dir(path: Path) -> Path:
    """Make ``path`` (DIR_MODE, egress's group), or tighten it if it exists; when it lies
    under the run dir, every directory from the run dir down to it too. OSError as is."""
    chain = _chain(Path(path))
    chain[0].parent.mkdir(parents=True, exist_ok=True)  # /run, /var/lib: not ours
    for directory in chain:
        try:
            os.mkdir(directory, 0o700)  # nobody else sees it before its mode is set
            made = True
        except FileExistsError:
            made = False
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            _own(fd, DIR_MODE, made)
        finally:
            os.close(fd)
    return Path(path)


def _chain(path: Path) -> list[Path]:
    root = run_dir()
    try:
        parts = path.relative_to(root).parts
    except ValueError:
        return [path]  # e.g. the state dir, or a --run-dir elsewhere
    chain = [root]
    for part in parts:
        chain.append(chain[-1] / part)
    return chain


def tighten(path: Path) -> None:
    """Narrow an existing file of egress's to FILE_MODE and egress's group (a symlink or
    a missing file is left alone)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENXIO):  # a symlink; a socket
            return
        raise
    try:
        _own(fd, FILE_MODE, made=False)
    finally:
        os.close(fd)


def new_private_file(path: Path) -> bool:
    """Create an empty ``path``, FILE_MODE and egress's group; False if it exists."""
    try:
        fd = os.open(
            path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600
        )
    except FileExistsError:
        return False
    try:
        _own(fd, FILE_MODE, made=True)
    finally:
        os.close(fd)
    return True


def write_whole(path: Path, data: bytes, mode: int = 0o644) -> None:
    """``path`` holds ``data`` whole, or what it held before: a temporary file beside it,
    fsync'd, then renamed over it (an operator's file: a learned or converted policy, a
    node's CNI plugin and conflist)."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def write_private(path: Path, data: bytes, *, durable: bool = False) -> None:
    """Replace ``path`` atomically with ``data``, FILE_MODE and egress's group from the
    first byte; ``durable``: fsync'd before it takes the name."""
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        _own(fd, FILE_MODE, made=True)  # also a crash's leftover, with whatever mode it had
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        if durable:
            os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)


def _own(fd: int, mode: int, made: bool) -> None:
    """Narrow to ``mode`` and give egress's group (and, if just ``made``, set ``mode``
    exactly). The mode first: egress's group never holds more than ``mode`` allows.
    Only root changes the group; the owner (or root) the mode."""
    st = os.fstat(fd)
    euid = os.geteuid()
    now = stat.S_IMODE(st.st_mode)
    narrowed = now & mode
    if narrowed != now and euid in (0, st.st_uid):
        os.fchmod(fd, narrowed)
    gid = egress_gid()
    if st.st_gid != gid and euid == 0:
        os.fchown(fd, -1, gid)
    if made and narrowed != mode:
        os.fchmod(fd, mode)


def template_dir() -> Path:
    """nft-templates/: $EGRESS_TEMPLATES, the source tree, or the installed data files."""
    candidates = [
        os.environ.get("EGRESS_TEMPLATES", ""),
        str(Path(egress.__file__).resolve().parent.parent / "nft-templates"),
        str(Path(sys.prefix) / "share" / "egress" / "nft-templates"),
    ]
    for cand in candidates:
        if cand and (Path(cand) / "sandbox.nft").is_file():
            return Path(cand)
    raise EgressError("nft-templates/ not found; set EGRESS_TEMPLATES to its directory")


def read_template(name: str) -> str:
    path = template_dir() / name
    try:
        return path.read_text(encoding="utf-8")
    except OSError as exc:
        raise EgressError(f"{path}: cannot read template: {exc.strerror}") from None

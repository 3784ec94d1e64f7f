"""The workload's view of the host: a root it is given, not the host's.

bubblewrap builds it in a new mount namespace from an empty tmpfs root:

    /usr /bin /sbin /lib*   read-only, the host's (its tools and libraries)
    /etc                    read-only, the host's, with the sandbox's resolv.conf and
                            nsswitch.conf, and passwd/group that name the workload's user
    /proc                   its own (the PID namespace's): only the sandbox's processes
    /dev                    minimal: null zero full random urandom tty, its own pts
    /tmp /var/tmp /dev/shm  private tmpfs (1777); /run a private empty tmpfs
    $HOME                   private and writable: <workloads dir>/<id>/home, kept for the
                            sandbox's life, shared by its execs, removed at teardown
    the working directory   read-write (--workdir, default the current directory)
    --ro-bind / --bind      exactly the paths they name, nothing else

A Unix socket, a secret or a tool anywhere else on the host is simply not there.

Ownership: the working directory and every bind are idmapped mounts (kernel/idmap.py)
that show the invoking user's files (``SUDO_UID``, else root) as the workload's and store
what the workload writes as the invoking user's. Files it leaves behind need no chown:
they already belong to whoever ran the command. (An ACL would leave the user's tree
edited; a chown at teardown would walk the tree and fail on a crash.) The set-uid bits
that would make this dangerous are refused by the seccomp filter (kernel/confine.py).
"""

from __future__ import annotations

import contextlib
import os
import pwd
import re
import secrets
import stat
import subprocess
from collections.abc import Container, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from egress.errors import SandboxError, UsageError
from egress.kernel import idmap
from egress.store import claims
from egress.store.paths import DEFAULT_STATE_DIR, run_dir, workloads_dir
from egress.store.walk import walk

ETC_NETNS = Path("/etc/netns")
# Where the host keeps its programs and libraries; symlinks (merged /usr) are kept as
# symlinks.
SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
PRIVATE_TMP = ("/tmp", "/var/tmp", "/dev/shm")
_ETC_MASKED = ("/etc/netns", "/etc/egress")
# A bind may not cover the parts of the view egress builds itself.
_RESERVED = ("/", "/proc", "/dev", "/etc/resolv.conf", "/etc/nsswitch.conf")
_OCTAL = re.compile(r"\\([0-7]{3})")  # mountinfo writes space, tab, newline, \ as \ooo


@dataclass(frozen=True)
class Bind:
    """--ro-bind / --bind PATH[:DEST]: a host path the workload may see (and write)."""

    source: str
    dest: str
    writable: bool

    @classmethod
    def parse(cls, spec: str, writable: bool) -> Bind:
        flag = "--bind" if writable else "--ro-bind"
        path, sep, dest = spec.partition(":")
        if not path:
            raise UsageError(f"{flag} {spec!r}: give PATH or PATH:DEST")
        source = os.path.realpath(path)
        if not os.path.exists(source):
            raise UsageError(f"{flag} {spec}: {path}: no such file or directory")
        dest = dest if sep else source
        if not dest.startswith("/") or "\0" in dest:
            raise UsageError(f"{flag} {spec}: DEST must be an absolute path")
        dest = os.path.normpath(dest)
        if dest in _RESERVED:
            raise UsageError(f"{flag} {spec}: {dest} is part of the view egress builds")
        return cls(source, dest, writable)


@dataclass(frozen=True)
class Identity:
    """Who the workload runs as, and what it is called inside."""

    name: str
    uid: int
    gid: int
    home: str  # the path of $HOME inside the view
    allocated: bool  # a uid of egress's range (no passwd entry on the host)


def invoking_user() -> tuple[int, int]:
    """The person behind the command: sudo's SUDO_UID/SUDO_GID, else our own ids."""
    try:
        uid, gid = int(os.environ["SUDO_UID"]), int(os.environ["SUDO_GID"])
    except (KeyError, ValueError):
        return os.getuid(), os.getgid()
    return uid, gid


# A working directory is read-write for the workload: never a place whose files run as
# someone else, or egress's own.
_NOT_WORKDIRS = ("/usr", "/etc", "/boot", "/proc", "/sys", "/dev", "/run", DEFAULT_STATE_DIR,
                 *SYSTEM_DIRS)  # fmt: skip


def _within(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def check_workdir(workdir: str, owner_home: str | None) -> str:
    """The working directory, resolved, or UsageError: the workload may write all of it,
    so it may not be (or hold) the invoking user's home (~/.bashrc, ~/.ssh, ~/.aws run
    or open things as that user), the root, or a system or egress directory."""
    real = os.path.realpath(workdir)
    if not os.path.isdir(real):
        raise UsageError(f"--workdir {workdir}: not a directory")
    if real == "/" or any(_within(real, d) for d in _NOT_WORKDIRS):
        raise UsageError(
            f"--workdir {real}: a system directory; give the workload a project directory"
        )
    for ours in (str(workloads_dir()), DEFAULT_STATE_DIR, str(run_dir())):
        if _within(ours, real):
            raise UsageError(f"--workdir {real}: it holds egress's own files ({ours}); "
                             "give the workload a project directory")  # fmt: skip
    if owner_home and _within(os.path.realpath(owner_home), real):
        raise UsageError(
            f"--workdir {real}: it is or holds your home directory ({owner_home}), whose "
            "dotfiles and keys the workload could read and rewrite; give it a project "
            "directory (cd into one, or --workdir DIR)"
        )
    return real


def planted_symlinks(path: str, suspects: Container[int]) -> list[str]:
    """Symlinks on the way to ``path`` (as given, then through each link's target) that
    ``suspects`` own: a sandbox's workload may have made them. Its writes in a working
    directory are stored as the invoking user's, or (without sudo) as its own uid's, so
    a link they own may point the next run wherever an earlier workload chose."""
    found: list[str] = []

    def visit(_dir: str, _dir_st: os.stat_result, entry: str, st: os.stat_result) -> None:
        if stat.S_ISLNK(st.st_mode) and st.st_uid in suspects:
            found.append(f"{entry} -> {os.readlink(entry)}")

    with contextlib.suppress(OSError):  # the rest does not exist: whoever opens it says so
        walk(path, visit)
    return found


def check_operator_path(flag: str, path: str, suspects: Container[int]) -> None:
    """UsageError if the operator's ``path`` goes through a symlink a workload could have
    planted (see ``planted_symlinks``)."""
    links = planted_symlinks(path, suspects)
    if links:
        raise UsageError(
            f"{flag} {path}: goes through the symlink {links[0]}, which a sandbox's "
            f"workload could have made; give the real path ({os.path.realpath(path)}) "
            "if that is what you mean"
        )


def check_operator_paths(
    *,
    workdir: str | None,
    binds: Sequence[str],
    env_files: Sequence[str],
    report: str | None,
    uid_range: range,
) -> None:
    """Every path the operator gave, checked for planted symlinks before any is used.
    Without --workdir, the current directory as the shell reached it ($PWD)."""
    suspects = suspect_uids(invoking_user()[0], uid_range)
    if workdir is not None:
        check_operator_path("--workdir", workdir, suspects)
    else:
        logical = os.environ.get("PWD", "")
        if logical and os.path.realpath(logical) == os.getcwd():
            check_operator_path("the current directory", logical, suspects)
    for spec in binds:
        check_operator_path("--bind", spec.partition(":")[0], suspects)
    for path in env_files:
        check_operator_path("--env-file", path, suspects)
    if report:
        check_operator_path("--report", os.path.dirname(os.path.abspath(report)), suspects)


def suspect_uids(invoker_uid: int, uid_range: range) -> _Suspects:
    return _Suspects(invoker_uid, uid_range)


@dataclass(frozen=True)
class _Suspects:
    """The owners a planted symlink would have: the invoking user (not root: root's are
    the system's) and every uid egress gives workloads."""

    invoker: int
    egress: range

    def __contains__(self, uid: object) -> bool:
        return isinstance(uid, int) and ((uid == self.invoker and uid != 0) or uid in self.egress)


def home_of(uid: int) -> str | None:
    try:
        return pwd.getpwuid(uid).pw_dir or None
    except KeyError:
        return None


def check_policy_location(policy: str, workdir: str, binds: Sequence[Bind]) -> None:
    """UsageError if the workload could rewrite the policy file through its view: the
    working directory and --bind paths are writable to it (as the invoking user)."""
    real = os.path.realpath(policy)
    for root in [workdir, *(b.source for b in binds if b.writable)]:
        if _within(real, os.path.realpath(root)):
            raise UsageError(
                f"{policy}: inside {root}, which the workload may write (the next run would "
                "read what it wrote); keep the policy outside it, e.g. in /etc/egress/"
            )


def sandbox_passwd(who: Identity, host_lines: Sequence[str]) -> str:
    """The host's passwd with the workload's entry added (or its home pointed inside)."""
    out = []
    for line in host_lines:
        parts = line.split(":")
        if len(parts) == 7 and parts[2] == str(who.uid):
            if who.allocated:
                continue  # an account the range check missed; ours wins inside
            parts[5] = who.home
            line = ":".join(parts)
        out.append(line)
    if who.allocated:
        out.append(f"{who.name}:x:{who.uid}:{who.gid}:egress sandbox:{who.home}:/bin/sh")
    return "\n".join(out) + "\n"


def sandbox_group(who: Identity, host_lines: Sequence[str]) -> str:
    ours = str(who.gid)
    out = [ln for ln in host_lines if not (who.allocated and ln.split(":")[2:3] == [ours])]
    if who.allocated:
        out.append(f"{who.name}:x:{who.gid}:")
    return "\n".join(out) + "\n"


def hostname(sandbox_id: str) -> str:
    """The UTS name the workload sees (bwrap --hostname)."""
    return f"egress-{sandbox_id}"


def sandbox_hosts(name: str, host_lines: Sequence[str]) -> str:
    """The host's /etc/hosts plus the sandbox's own name, as Debian lists a host's name
    (and on ::1, so an AAAA lookup finds it too):
    tools that look themselves up (git's default author, Java, sudo) find it in the file
    and never ask DNS, where the name would be a denied query and, under a freeze policy,
    a freeze."""
    return "\n".join([*host_lines, f"127.0.1.1\t{name}", f"::1\t{name}"]) + "\n"


def _lines(path: str) -> list[str]:
    try:
        return Path(path).read_text().splitlines()
    except OSError:
        return []


def _etc_target(name: str) -> str:
    """Where the view's copy of /etc/NAME goes: through a host symlink (resolv.conf often
    points into /run), to the path it resolves to."""
    host = f"/etc/{name}"
    return os.path.realpath(host) if os.path.islink(host) else host


def root_args() -> list[str]:
    """The read-only system part of the view and the private scratch places."""
    args: list[str] = []
    for d in SYSTEM_DIRS:
        if os.path.islink(d):
            args += ["--symlink", os.readlink(d), d]
        elif os.path.isdir(d):
            args += ["--ro-bind", d, d]
    args += ["--ro-bind", "/etc", "/etc", "--proc", "/proc", "--dev", "/dev"]
    # Of /etc, what is egress's: other sandboxes' resolv.conf (their ids), the operator's
    # policies.
    for mine in _ETC_MASKED:
        if os.path.isdir(mine):
            args += ["--perms", "0755", "--tmpfs", mine]
    args += ["--perms", "0755", "--dir", "/var"]
    for d in PRIVATE_TMP:
        args += ["--perms", "1777", "--tmpfs", d]
    args += ["--perms", "0755", "--tmpfs", "/run"]
    return args


# What root_args already made; every other directory on the way to a mount point is made
# explicitly, 0755: bubblewrap would make it 0700 (root's), and the workload could not
# reach what is mounted below.
_MADE = frozenset({"/", "/usr", "/etc", "/proc", "/dev", "/var", "/run", *PRIVATE_TMP})


def parents_args(dest: str, made: set[str]) -> list[str]:
    """``--dir`` for each directory above ``dest`` the view does not have yet."""
    args: list[str] = []
    parts = dest.strip("/").split("/")[:-1]
    for i in range(1, len(parts) + 1):
        path = "/" + "/".join(parts[:i])
        if path in made or path in _MADE or any(path.startswith(d + "/") for d in SYSTEM_DIRS):
            continue
        made.add(path)
        args += ["--perms", "0755", "--dir", path]
    return args


@dataclass
class View:
    """One exec's view, prepared on the host; ``close`` undoes this exec's part."""

    args: list[str]
    workdir: str
    home: str
    _mounts: list[str] = field(default_factory=list)
    _exec_dir: Path | None = None  # mnt/<pid>-<token>, its mount points' directory

    def close(self) -> None:
        """Unmount and remove this exec's mount points (never what they showed: a point
        still mounted stays, EBUSY, for the sandbox's teardown)."""
        for target in reversed(self._mounts):
            with contextlib.suppress(SandboxError):
                idmap.unmount(target)
            with contextlib.suppress(OSError):
                if os.path.isdir(target):
                    os.rmdir(target)
                else:
                    os.unlink(target)
        self._mounts.clear()
        if self._exec_dir is not None:
            with contextlib.suppress(OSError):
                self._exec_dir.rmdir()


def prepare(
    sandbox_id: str,
    netns: str,
    who: Identity,
    workdir: str,
    binds: Sequence[Bind],
    owner: tuple[int, int] | None = None,
) -> View:
    """Make the host-side pieces of the view and the bwrap arguments that assemble it."""
    owner = owner or invoking_user()
    workdir = check_workdir(workdir, home_of(owner[0]))
    base = workloads_dir() / sandbox_id
    try:
        base.parent.mkdir(mode=0o711, parents=True, exist_ok=True)
    except OSError as exc:
        raise SandboxError(f"{base.parent}: {exc.strerror}") from None
    _private_dir(base.parent, 0o711, 0, 0)
    _private_dir(base, 0o711, 0, 0)
    sweep_dead_execs(sandbox_id)
    # One home per identity: an exec with --user never takes over the sandbox's own.
    homes = base / "homes"
    _private_dir(homes, 0o711, 0, 0)
    home = homes / str(who.uid)
    _private_dir(home, 0o700, who.uid, who.gid)
    etc = base / "etc"
    _private_dir(etc, 0o755, 0, 0)
    _write(etc / "passwd", sandbox_passwd(who, _lines("/etc/passwd")))
    _write(etc / "group", sandbox_group(who, _lines("/etc/group")))
    _write(etc / "hosts", sandbox_hosts(hostname(sandbox_id), _lines("/etc/hosts")))

    args = root_args()
    made: set[str] = set()
    netns_etc = ETC_NETNS / netns
    for name in ("resolv.conf", "nsswitch.conf"):
        target = _etc_target(name)
        args += [*parents_args(target, made), "--ro-bind", str(netns_etc / name), target]
    for name in ("passwd", "group", "hosts"):
        args += ["--ro-bind", str(etc / name), _etc_target(name)]
    args += [*parents_args(who.home, made), "--bind", str(home), who.home]

    mnt = base / "mnt" / f"{os.getpid()}-{secrets.token_hex(3)}"
    view = View(args, workdir, who.home, _exec_dir=mnt)
    try:
        mapping = idmap.IdMap(owner[0], owner[1], who.uid, who.gid)
        # Never root's files: mapped, they would be the workload's to rewrite (and any
        # path a planted symlink leads to would be). Run as root without sudo, the tree
        # is bound as it is, and the workload writes where its own uid may.
        needs_idmap = owner[0] != 0 and (owner[0], owner[1]) != (who.uid, who.gid)
        for n, bind in enumerate([Bind(workdir, workdir, True), *binds]):
            source = bind.source
            if needs_idmap:
                source = _idmapped(mnt, n, bind, mapping, view)
            view.args += parents_args(bind.dest, made)
            view.args += ["--bind" if bind.writable else "--ro-bind", source, bind.dest]
    except BaseException:
        view.close()
        raise
    view.args += ["--chdir", workdir]
    return view


def _idmapped(mnt: Path, n: int, bind: Bind, mapping: idmap.IdMap, view: View) -> str:
    _private_dir(mnt.parent, 0o700, 0, 0)
    _private_dir(mnt, 0o700, 0, 0)
    target = mnt / str(n)
    if os.path.isdir(bind.source):
        target.mkdir(mode=0o700)
    else:
        target.touch(mode=0o600)
    view._mounts.append(str(target))
    attrs = idmap.MOUNT_ATTR_NOSUID | idmap.MOUNT_ATTR_NODEV
    if not bind.writable:
        attrs |= idmap.MOUNT_ATTR_RDONLY
    idmap.mount_idmapped(bind.source, str(target), mapping, attrs)
    return str(target)


def _private_dir(path: Path, mode: int, uid: int, gid: int) -> None:
    try:
        path.mkdir(mode=mode, exist_ok=True)
        st = os.lstat(path)
        if not stat.S_ISDIR(st.st_mode):
            raise SandboxError(f"{path}: exists and is not a directory")
        if (st.st_uid, st.st_gid) != (uid, gid):
            os.chown(path, uid, gid, follow_symlinks=False)
        os.chmod(path, mode)
    except OSError as exc:
        raise SandboxError(f"{path}: {exc.strerror}") from None


def _write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(text)
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)


# -- teardown ------------------------------------------------------------------------------


def _mounts_under(root: str) -> list[str]:
    """Mount points at or below ``root``. Fails closed: without mountinfo nothing can be
    shown to be unmounted, so nothing may be deleted."""
    found = []
    try:
        with open("/proc/self/mountinfo", "rb") as f:
            lines = f.read().splitlines()
    except OSError as exc:
        raise SandboxError(f"cannot read /proc/self/mountinfo: {exc.strerror}") from None
    for line in lines:
        point = _OCTAL.sub(lambda m: chr(int(m.group(1), 8)), line.split()[4].decode())
        if point == root or point.startswith(root + "/"):
            found.append(point)
    return found


def _unmount_all(root: str) -> None:
    for point in sorted(_mounts_under(root), key=len, reverse=True):
        idmap.unmount(point)


def remove(sandbox_id: str) -> None:
    """Remove a sandbox's workload files, never a byte of what was mounted in them.

    Mount points live only under ``mnt/`` and are removed with rmdir/unlink of the empty
    point alone, which fails (EBUSY, ENOTEMPTY) rather than delete through a mount that is
    still attached. The homes, where nothing is ever mounted, are removed by ``rm -rf
    --one-file-system``: iterative, so no depth or path length the workload chose stops
    it, and it follows no symlink the workload planted.
    """
    base = workloads_dir() / sandbox_id
    if not os.path.lexists(base):
        return
    _unmount_all(str(base))
    left = _mounts_under(str(base))
    if left:
        raise SandboxError(f"{base}: still mounted at {left[0]}; not removing it")
    mnt = base / "mnt"
    if mnt.is_dir() and not mnt.is_symlink():
        for exec_dir in list(os.scandir(mnt)):
            _remove_points(exec_dir.path)
    # Recursively only where nothing is ever mounted: an exec attaching its mount under
    # mnt/ meanwhile makes the rmdir below fail, never deletes through it.
    for tree in ("homes", "etc"):
        rm = subprocess.run(
            ["rm", "-rf", "--one-file-system", "--", str(base / tree)],
            capture_output=True, text=True, check=False,
        )  # fmt: skip
        if rm.returncode != 0:
            raise SandboxError(f"{base / tree}: {rm.stderr.strip() or 'rm failed'}")
    try:
        with contextlib.suppress(FileNotFoundError):
            mnt.rmdir()
        for entry in list(os.scandir(base)):
            if not entry.is_dir(follow_symlinks=False):
                os.unlink(entry.path)
        base.rmdir()
    except OSError as exc:
        raise SandboxError(f"{base}: {exc.strerror}; not removing it") from None


def _remove_points(exec_dir: str) -> None:
    """One exec's mount points: empty directories and files, removed one by one."""
    try:
        names = os.listdir(exec_dir)
    except NotADirectoryError:
        names = None
    except FileNotFoundError:
        return
    try:
        for name in names or []:
            path = os.path.join(exec_dir, name)
            if os.path.isdir(path) and not os.path.islink(path):
                os.rmdir(path)  # ENOTEMPTY/EBUSY if anything is still there: stop
            else:
                os.unlink(path)
        if names is None:
            os.unlink(exec_dir)
        else:
            os.rmdir(exec_dir)
    except OSError as exc:
        raise SandboxError(f"{exec_dir}: {exc.strerror}; not removing it") from None


def sweep_dead_execs(sandbox_id: str) -> None:
    """Mounts a SIGKILLed `sandbox exec` left (``mnt/<pid>-*`` of a pid no longer alive)."""
    mnt = workloads_dir() / sandbox_id / "mnt"
    try:
        entries = list(os.scandir(mnt))
    except OSError:
        return
    for entry in entries:
        pid = entry.name.partition("-")[0]
        if not pid.isdigit() or claims.alive(int(pid)):
            continue
        with contextlib.suppress(SandboxError):
            _unmount_all(entry.path)
            _remove_points(entry.path)

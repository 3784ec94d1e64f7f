"""Start the user's command inside a sandbox, unprivileged.

The child joins the sandbox's cgroup before it execs anything (so nothing it forks can be
born outside), then ``ip netns exec`` enters the netns and gives it a private mount
namespace with the sandbox's resolv.conf, and ``setpriv`` drops to the workload user with
no capabilities (bounding, inheritable, ambient) and no_new_privs, so no setuid binary
can win them back.
"""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass

from egress.errors import SandboxError


@dataclass(frozen=True)
class User:
    name: str
    uid: int
    gid: int
    home: str


def resolve_user(spec: str | None) -> User:
    """--user NAME|UID; default: the invoking sudo user, else nobody. Never root."""
    if spec is None:
        sudo_user = os.environ.get("SUDO_USER")
        spec = sudo_user if sudo_user and sudo_user != "root" else "nobody"
    try:
        entry = pwd.getpwuid(int(spec)) if spec.isdigit() else pwd.getpwnam(spec)
    except (KeyError, ValueError):
        raise SandboxError(f"--user {spec}: no such user") from None
    if entry.pw_uid == 0:
        raise SandboxError("--user: the workload never runs as root; pick another user")
    return User(entry.pw_name, entry.pw_uid, entry.pw_gid, entry.pw_dir)


# A netns does not separate Unix sockets that live at filesystem paths: through them a
# host service (systemd-resolved, nscd, avahi, D-Bus, a user's session bus) would resolve
# names or open connections from the host's own network. Each of these directories, where
# it exists, is covered by an empty read-only tmpfs in the workload's mount namespace.
MASKED_DIRS = (
    "/run/dbus", "/run/systemd/resolve", "/run/nscd", "/run/avahi-daemon", "/run/user",
    "/var/run/dbus", "/var/run/nscd", "/var/run/avahi-daemon",
)  # fmt: skip
_MASK_SCRIPT = (
    'while [ "$1" != -- ]; do '
    'if [ -d "$1" ] && [ ! -L "$1" ]; then '
    'mount -t tmpfs -o ro,nosuid,nodev,noexec,size=4k egress-masked "$1" || exit 126; fi; '
    'shift; done; shift; exec "$@"'
)


def command_line(netns: str, user: User, argv: Sequence[str]) -> list[str]:
    ip = shutil.which("ip") or "/usr/sbin/ip"
    setpriv = shutil.which("setpriv") or "/usr/bin/setpriv"
    return [
        ip, "netns", "exec", netns,
        "/bin/sh", "-c", _MASK_SCRIPT, "egress-mask", *MASKED_DIRS, "--",
        setpriv, f"--reuid={user.uid}", f"--regid={user.gid}", "--clear-groups",
        "--inh-caps=-all", "--ambient-caps=-all", "--bounding-set=-all", "--no-new-privs",
        "--", *argv,
    ]  # fmt: skip


def join_cgroups(procs_files: list[str]) -> None:
    # Runs in the child between fork and exec: only open/write, nothing that allocates locks.
    pid = str(os.getpid()).encode()
    for path in procs_files:
        fd = os.open(path, os.O_WRONLY)
        try:
            os.write(fd, pid)
        finally:
            os.close(fd)


def spawn(
    netns: str, user: User, argv: Sequence[str], procs_files: list[str]
) -> subprocess.Popen[bytes]:
    """Start argv in the sandbox; stdin/stdout/stderr are the caller's own."""
    env = dict(os.environ, HOME=user.home, USER=user.name, LOGNAME=user.name)
    try:
        return subprocess.Popen(
            command_line(netns, user, argv),
            env=env,
            preexec_fn=lambda: join_cgroups(procs_files),
            # Its own session: no controlling terminal, so it can neither push input into
            # the shell egressctl was started from (TIOCSTI) nor take the terminal over.
            start_new_session=True,
        )
    except (OSError, subprocess.SubprocessError) as exc:  # e.g. its cgroup is gone
        raise SandboxError(f"cannot start the workload: {exc}") from None

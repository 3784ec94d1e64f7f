"""Start the user's command inside a sandbox: its own uid, PID namespace and view.

    egressctl (root) ─fork─▶ join the sandbox's cgroup(s), normal scheduling and
        priority (RLIMIT_RTPRIO and RLIMIT_NICE 0), enter the Landlock domain
        ─exec─▶ nsenter --net=<the sandbox's netns>
        ─exec─▶ bwrap: new mount, PID, IPC, UTS (and cgroup) namespaces; the view
                (sandbox/view.py); the seccomp filter (kernel/confine.py)
        ─exec─▶ setpriv: the workload's uid and gid, no supplementary groups, no
                capabilities (bounding, inheritable, ambient), no_new_privs
        ─exec─▶ tini, PID 1 of the namespace: reaps orphans, passes signals on to CMD's
                process group (-g: Ctrl-C reaches a whole pipeline, as in a shell),
                exits with CMD's status (128+N when a signal N ended it)
        ─fork+exec─▶ CMD

The child joins the cgroup before it execs anything, so nothing it forks is born outside.
bubblewrap's own process stays outside the PID namespace as root, waits for PID 1 and
exits with its status; signals for the command go to PID 1 (``Workload.init_pid``, which
bwrap reports on --info-fd), never to bwrap, which would die of them and leave the
command running. Inside, ``kill -9 -1`` reaches only the sandbox's own processes: the
namespace holds nothing else, and PID 1 is immune to it.

Only an allowlist of the caller's environment reaches CMD: PATH, LANG, LC_*, TERM and TZ,
plus HOME, USER and LOGNAME set for the sandbox, plus what --env and --env-file name.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import re
import resource
import select
import shutil
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from egress.errors import SandboxError, UsageError
from egress.kernel import confine, oom, sched
from egress.kernel.netns import netns_path
from egress.sandbox.view import Identity, View, hostname
from egress.store import uids

TOOLS = {"bwrap": "bubblewrap", "nsenter": "util-linux", "setpriv": "util-linux"}
TINI = "/usr/bin/tini"  # inside the view; /usr is the host's
SETPRIV = "/usr/bin/setpriv"
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
PASSED = ("PATH", "LANG", "TERM", "TZ")  # and every LC_*
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
INFO_TIMEOUT_S = 10.0  # bwrap writes its info at once; a busy host may delay it a little


# -- who ----------------------------------------------------------------------------------


def named_user(spec: str) -> Identity:
    """--user NAME|UID: an existing account, never root."""
    try:
        entry = pwd.getpwuid(int(spec)) if spec.isdigit() else pwd.getpwnam(spec)
    except (KeyError, ValueError, OverflowError):
        raise UsageError(
            f"--user {spec}: no such user; name an existing account, or leave --user out "
            "to give the workload a uid of its own"
        ) from None
    if entry.pw_uid == 0:
        raise UsageError("--user: the workload never runs as root; pick another user")
    return Identity(entry.pw_name, entry.pw_uid, entry.pw_gid, f"/home/{entry.pw_name}", False)


def allocated_user(sandbox_id: str, uid: int) -> Identity:
    """The uid egress allocated for the sandbox (gid = uid), named after it inside."""
    name = f"egress-{sandbox_id}"
    return Identity(name, uid, uid, f"/home/{name}", True)


def shared_user_warning(who: Identity) -> str | None:
    if who.allocated:
        return None
    pids = uids.live_processes(range(who.uid, who.uid + 1)).get(who.uid, [])
    if not pids:
        return None
    return (
        f"egressctl: warning: --user {who.name} also runs {len(pids)} process(es) outside "
        f"the sandbox (e.g. pid {pids[0]}); they are not confined, and the sandbox shares "
        "files and IPC with them. Leave --user out to give the workload a uid of its own."
    )


# -- environment --------------------------------------------------------------------------


def parse_env_file(path: str) -> list[str]:
    """NAME=VALUE or NAME per line; blank lines and # comments skipped."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError as exc:
        raise UsageError(f"--env-file {path}: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise UsageError(f"--env-file {path}: not UTF-8 text") from None
    out = []
    for n, line in enumerate(lines, 1):
        text = line.strip()
        if not text or text.startswith("#"):
            continue
        name = text.partition("=")[0]
        if not _NAME.match(name):
            raise UsageError(f"{path}:{n}: {name!r} is not a variable name "
                             "([A-Za-z_][A-Za-z0-9_]*)")  # fmt: skip
        out.append(text)
    return out


def resolve_env(passed: Sequence[str], caller: Mapping[str, str]) -> dict[str, str]:
    """--env NAME=VALUE / NAME (the caller's value) → {NAME: VALUE}, checked, in order."""
    out: dict[str, str] = {}
    for item in passed:
        name, sep, value = item.partition("=")
        if not _NAME.match(name):
            raise UsageError(
                f"--env {item!r}: {name!r} is not a variable name ([A-Za-z_][A-Za-z0-9_]*)"
            )
        if not sep:
            if name not in caller:
                raise UsageError(f"--env {name}: not set in egressctl's environment; "
                                 f"give a value with --env {name}=VALUE")  # fmt: skip
            value = caller[name]
        out[name] = value
    return out


def build_env(who: Identity, extra: Mapping[str, str], caller: Mapping[str, str]) -> dict[str, str]:
    """CMD's environment: the allowlist, the sandbox's identity, then --env."""
    env = {k: v for k, v in caller.items() if k in PASSED or k.startswith("LC_")}
    env.setdefault("PATH", DEFAULT_PATH)
    env.update(HOME=who.home, USER=who.name, LOGNAME=who.name)
    env.update(extra)
    return env


# -- the command line ---------------------------------------------------------------------


def tool(name: str) -> str:
    path = shutil.which(name) or shutil.which(name, path="/usr/sbin:/usr/bin:/sbin:/bin")
    if path is None:
        raise SandboxError(f"{name} not found; install {TOOLS[name]} (`make setup` does)")
    return path


def command_line(
    netns: str,
    who: Identity,
    argv: Sequence[str],
    view: View,
    sandbox_id: str,
    seccomp_fd: int,
    info_fd: int,
) -> list[str]:
    return [
        tool("nsenter"), f"--net={netns_path(netns)}", "--",
        tool("bwrap"),
        "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try",
        "--hostname", hostname(sandbox_id), "--as-pid-1", "--new-session",
        *view.args,
        "--seccomp", str(seccomp_fd), "--info-fd", str(info_fd),
        "--",
        SETPRIV, f"--reuid={who.uid}", f"--regid={who.gid}", "--clear-groups",
        "--inh-caps=-all", "--ambient-caps=-all", "--bounding-set=-all", "--no-new-privs",
        "--",
        TINI, "-g", "--", *argv,
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


def no_priority_above_normal() -> None:
    """The workload starts under the normal scheduler, at nice 0 or lower priority, and may
    not raise its priority from there, whatever the caller had (``chrt``, ``nice -n -10``,
    or ``ulimit -r`` / ``-e`` in the shell egressctl was started from, all of which pass on
    through bwrap and setpriv): a real-time or favoured busy loop on every CPU would keep
    the layers that must freeze it off them (see kernel/sched.py). Hard limits: it can't
    raise them back. Runs in the child, still root, between fork and exec, as
    join_cgroups does: plain syscalls only."""
    if os.sched_getscheduler(0) & ~os.SCHED_RESET_ON_FORK in sched.REALTIME:
        os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
    if os.getpriority(os.PRIO_PROCESS, 0) < 0:
        os.setpriority(os.PRIO_PROCESS, 0, 0)
    resource.setrlimit(resource.RLIMIT_RTPRIO, (0, 0))
    resource.setrlimit(resource.RLIMIT_NICE, (0, 0))


@dataclass
class Workload:
    """A started command: ``pid`` is bwrap (wait on it), ``init_pid`` PID 1 (signal it)."""

    pid: int
    init_pid: int
    popen: subprocess.Popen[bytes]


def spawn(
    sandbox_id: str,
    netns: str,
    who: Identity,
    argv: Sequence[str],
    view: View,
    env: Mapping[str, str],
    procs_files: list[str],
) -> Workload:
    """Start argv in the sandbox; stdin/stdout/stderr are the caller's own."""
    if not os.path.exists(TINI):
        raise SandboxError(f"{TINI} not found; install tini (`make setup` does)")
    scope = confine.landlock_scoper()

    def in_child() -> None:
        # Normal first: a real-time task can't join a cpu cgroup that has no real-time
        # runtime of its own (kernels with RT group scheduling refuse it, EINVAL).
        no_priority_above_normal()
        oom.unshelter()
        join_cgroups(procs_files)
        if scope is not None:
            scope()

    seccomp_fd = confine.seccomp_fd()
    info_r, info_w = os.pipe()
    try:
        cmd = command_line(netns, who, argv, view, sandbox_id, seccomp_fd, info_w)
        try:
            proc = subprocess.Popen(
                cmd,
                env=dict(env),
                preexec_fn=in_child,
                pass_fds=(seccomp_fd, info_w),
                # Its own session: no controlling terminal, so it can neither push input
                # into the shell egressctl was started from (TIOCSTI) nor take it over.
                start_new_session=True,
            )
        except (OSError, subprocess.SubprocessError) as exc:  # e.g. its cgroup is gone
            raise SandboxError(f"cannot start the workload: {exc}") from None
        os.close(info_w)
        info_w = -1
        init_pid = _read_init_pid(info_r, proc)
    finally:
        os.close(seccomp_fd)
        if info_w >= 0:
            os.close(info_w)
        os.close(info_r)
    return Workload(proc.pid, init_pid, proc)


def _read_init_pid(fd: int, proc: subprocess.Popen[bytes]) -> int:
    """bwrap's --info-fd JSON names PID 1's host pid; EOF first means bwrap failed (its
    own message is on stderr already)."""
    import json

    data = b""
    while True:
        ready, _, _ = select.select([fd], [], [], INFO_TIMEOUT_S)
        if not ready:
            _kill(proc)
            raise SandboxError(f"the sandbox did not start within {INFO_TIMEOUT_S:.0f} s")
        chunk = os.read(fd, 4096)
        if not chunk:
            break
        data += chunk
        with contextlib.suppress(ValueError):
            return int(json.loads(data)["child-pid"])
    code = proc.wait()
    raise SandboxError(f"bubblewrap could not build the sandbox (exit {code}); see above")


def _kill(proc: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError):
        proc.kill()
    proc.wait()


def signal_forwarder(workload: Workload) -> Callable[[int], None]:
    def forward(sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(workload.init_pid, sig)

    return forward


def print_warning(text: str | None) -> None:
    if text:
        print(text, file=sys.stderr, flush=True)

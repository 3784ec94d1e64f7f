"""The workload's own identity, PID namespace and view of the host: attacks from inside.

Each test is an attack an agent could run as the workload, and checks what reached the
target (a process still alive, a socket nobody connected to, a file nobody wrote), not
only what egress reported. The invoking user is uid 1000 (SUDO_UID/SUDO_GID, as sudo sets
them); victims run as that user, in a concurrent `egressctl run`, and in egressd's
sandboxes.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import threading
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager, suppress
from pathlib import Path
from typing import Any

import pytest

from egress.datapath.addressing import Pools
from egress.errors import DaemonError
from egress.kernel import confine
from egress.kernel.cgroup import Cgroup
from egress.lab import Lab
from egress.store import claims, uids
from egress.store.journal import Journal
from egress.store.paths import workloads_dir
from tests.support import SYSTEM_PYTHON
from tests.support.egressd import Egressd, Lines, egressd
from tests.support.sandboxes import (
    EGRESSCTL,
    cleanup,
    env,
    leftovers,
    refused,
)

pytestmark = [pytest.mark.privileged, pytest.mark.usefixtures("require_root")]

POLICY = """
apiVersion: egress/v1
kind: Policy
metadata: {name: isolation}
spec:
  dns:
    upstreams: ["198.51.100.53"]
    allow: [allowed.lab.test]
  connect:
    allow:
      - {cidr: 203.0.113.10/32, ports: [80], proto: tcp}
  violations: {blocked_connect: block, foreign_dns: block}
"""
LINE_S = 60.0  # a line from a sandboxed process: seconds at worst on a busy 2-vCPU host
EGRESS_UIDS = uids.parse_range(None)


# The person who ran sudo: a uid no account and no egress range holds, so the tests need
# no account of the machine's and touch nobody's files (sudo sets these three).
INVOKER = (1990000000, 1990000000)
NOBODY = pwd.getpwnam("nobody")


def invoker() -> tuple[int, int]:
    return INVOKER


def sudo_env(**extra: str) -> dict[str, str]:
    uid, gid = INVOKER
    return {**env(), "SUDO_UID": str(uid), "SUDO_GID": str(gid), "SUDO_USER": "someone",
            **extra}  # fmt: skip


@contextmanager
def project(owner: tuple[int, int] | None = None) -> Iterator[Path]:
    """A working directory owned by the invoking user; the policy sits beside it, in the
    operator's directory (egressctl refuses one the invoking user's dir holds in /tmp)."""
    base = Path(tempfile.mkdtemp(prefix="egress-iso-"))
    try:
        base.chmod(0o755)
        (base / "policy.yaml").write_text(POLICY)
        path = base / "work"
        path.mkdir(mode=0o755)
        uid, gid = owner or invoker()
        os.chown(path, uid, gid)
        yield path
    finally:
        shutil.rmtree(base, ignore_errors=True)


class Running:
    """A sandboxed command that prints lines and waits on stdin between steps."""

    def __init__(self, argv: list[str], environ: dict[str, str]) -> None:
        self.proc = subprocess.Popen(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            env=environ,
        )  # fmt: skip
        assert self.proc.stdout is not None
        self.out = Lines(self.proc.stdout.fileno())

    def line(self) -> str:
        got = self.out.next(LINE_S)
        if not got:
            raise AssertionError(f"no line from the sandbox; stderr: {self.stderr()}")
        return got

    def send(self, text: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(text.encode() + b"\n")
        self.proc.stdin.flush()

    def finish(self, timeout: float = LINE_S) -> int:
        with suppress(BrokenPipeError, OSError):
            assert self.proc.stdin is not None
            self.proc.stdin.close()
        return self.proc.wait(timeout=timeout)

    def stderr(self) -> str:
        if self.proc.poll() is None or self.proc.stderr is None:
            return "(still running)"
        return self.proc.stderr.read().decode(errors="replace")

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=LINE_S)
        for pipe in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            with suppress(OSError):
                if pipe is not None:
                    pipe.close()


def run_argv(lab: Lab, d: Path, *options: str) -> list[str]:
    return [*EGRESSCTL, "run", "--workdir", str(d), "--policy", str(d.parent / "policy.yaml"),
            "--uplink-netns", lab.uplink_netns, *options]  # fmt: skip


def run(lab: Lab, d: Path, *args: str, environ: dict[str, str] | None = None, **kw: Any):
    options, sep, cmd = list(args), [], []
    if "--" in options:
        i = options.index("--")
        options, sep, cmd = options[:i], ["--"], options[i + 1 :]
    return subprocess.run(
        [*run_argv(lab, d, *options), *sep, *cmd], capture_output=True, text=True,
        env=environ or sudo_env(), timeout=120, **kw,
    )  # fmt: skip


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with suppress(OSError):
        return "zombie" not in Path(f"/proc/{pid}/status").read_text()
    return False


WAITER = "echo ready; read x; echo alive"


@pytest.fixture(scope="module")
def daemon(lab: Lab, state_dir: Path) -> Iterator[Egressd]:
    with egressd(state_dir) as d:
        yield d


def drop(daemon: Egressd, sandbox_id: str) -> None:
    """Delete a sandbox unless the test already did."""
    with suppress(DaemonError):
        daemon.delete(sandbox_id)


def exec_argv(daemon: Egressd, sandbox_id: str, d: Path, *options: str) -> list[str]:
    return [*EGRESSCTL, "sandbox", "exec", "--daemon", daemon.socket, "--workdir", str(d),
            *options, sandbox_id, "--"]  # fmt: skip


# -- kill -9 -1 ---------------------------------------------------------------------------


@pytest.mark.parametrize("via", ["run", "run --user", "sandbox exec"])
def test_kill_minus_one_ends_only_the_sandboxs_own_processes(
    lab: Lab, daemon: Egressd, via: str
) -> None:
    """`kill -9 -1` inside: the invoking user's process outside, a concurrent `egressctl
    run`, two egressd sandboxes, another exec of the attacker's own sandbox (same uid)
    and egress's own processes survive; the attacker's own child dies. With `--user`
    naming an account that also runs a process outside, that
    process survives too (the PID namespace, not the uid, is what protects it)."""
    uid, gid = invoker()
    with ExitStack() as stack:
        d = stack.enter_context(project())
        outside = subprocess.Popen(["setpriv", f"--reuid={uid}", f"--regid={gid}",
                                    "--clear-groups", "sleep", "600"])  # fmt: skip
        stack.callback(lambda: (outside.kill(), outside.wait()))
        same_uid = subprocess.Popen(["setpriv", f"--reuid={NOBODY.pw_uid}",
                                     f"--regid={NOBODY.pw_gid}", "--clear-groups",
                                     "sleep", "600"])  # fmt: skip
        stack.callback(lambda: (same_uid.kill(), same_uid.wait()))
        other = Running(run_argv(lab, d, "--", "/bin/sh", "-c", WAITER), sudo_env())
        stack.callback(other.kill)
        assert other.line() == "ready"
        boxes = [daemon.create(POLICY, lab.uplink_netns) for _ in range(2)]
        for box in boxes:
            stack.callback(drop, daemon, box["id"])
        execs = [Running([*exec_argv(daemon, b["id"], d), "/bin/sh", "-c", WAITER], sudo_env())
                 for b in boxes]  # fmt: skip
        for e in execs:
            stack.callback(e.kill)
            assert e.line() == "ready"
        attack = ["/bin/sh", "-c", 'sleep 600 & child=$!; kill -9 -1; wait $child; echo "child=$?"']
        if via == "sandbox exec":
            box = daemon.create(POLICY, lab.uplink_netns)
            stack.callback(drop, daemon, box["id"])
            # A victim of the attacker's own uid: another exec of the same sandbox, in a
            # PID namespace of its own. Only the namespace keeps it out of reach.
            sibling = Running([*exec_argv(daemon, box["id"], d), "/bin/sh", "-c", WAITER],
                              sudo_env())  # fmt: skip
            stack.callback(sibling.kill)
            assert sibling.line() == "ready"
            execs.append(sibling)
            done = subprocess.run([*exec_argv(daemon, box["id"], d), *attack], capture_output=True,
                                  text=True, env=sudo_env(), timeout=120)  # fmt: skip
        elif via == "run --user":
            done = run(lab, d, "--user", "nobody", "--", *attack)
            assert "warning: --user" in done.stderr and "outside the sandbox" in done.stderr
        else:
            done = run(lab, d, "--", *attack)
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip() == "child=137", done  # its own child died of it
        assert alive(outside.pid), "the invoking user's process outside was killed"
        assert alive(same_uid.pid), "a process of --user's account outside was killed"
        assert alive(daemon.pid) and alive(other.proc.pid)
        for r in (other, *execs):
            r.send("go")
            assert r.line() == "alive"
            assert r.finish() == 0


# -- processes outside ----------------------------------------------------------------------

INSPECT = r"""
import ctypes, json, os, sys
libc = ctypes.CDLL(None, use_errno=True)
class IOV(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]
out = {}
for pid in map(int, sys.argv[1:]):
    r = {}
    try: os.kill(pid, 0); r["kill"] = "ok"
    except OSError as e: r["kill"] = e.errno
    try: os.close(os.pidfd_open(pid)); r["pidfd"] = "ok"
    except OSError as e: r["pidfd"] = e.errno
    r["ptrace"] = "ok" if libc.ptrace(16, pid, None, None) == 0 else ctypes.get_errno()
    buf = ctypes.create_string_buffer(8)
    local, remote = IOV(ctypes.addressof(buf), 8), IOV(0x400000, 8)
    n = libc.process_vm_readv(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
    r["vm_readv"] = "ok" if n >= 0 else ctypes.get_errno()
    out[pid] = r
out["proc"] = sorted(int(p) for p in os.listdir("/proc") if p.isdigit())
print(json.dumps(out), flush=True)
input()
"""


def test_no_process_outside_can_be_signalled_traced_or_read(lab: Lab) -> None:
    """kill, pidfd_open, ptrace and process_vm_readv on pids outside all fail, and /proc
    lists exactly the sandbox's processes (what its cgroup holds, less bwrap's monitor)."""
    uid, gid = invoker()
    with project() as d:
        outside = subprocess.Popen(["setpriv", f"--reuid={uid}", f"--regid={gid}",
                                    "--clear-groups", "sleep", "600"])  # fmt: skip
        targets = [str(p) for p in (outside.pid, os.getpid(), os.getppid())]
        (d / "inspect.py").write_text(INSPECT)
        r = Running(run_argv(lab, d, "--", SYSTEM_PYTHON, str(d / "inspect.py"), *targets),
                    sudo_env())  # fmt: skip
        try:
            seen = json.loads(r.line())
            [claim] = [c for c in claims.load_all() if c.owner_pid == r.proc.pid]
            in_cgroup = Cgroup.open(claim.id).pids()
            r.send("")
            assert r.finish() == 0, r.stderr()
        finally:
            r.kill()
            outside.kill()
            outside.wait()
    for pid in (outside.pid, os.getpid(), os.getppid()):
        assert all(v != "ok" for v in seen[str(pid)].values()), (pid, seen[str(pid)])
    # Inside, pid 1 is the sandbox's own init, not the host's: same uid, so visible, but
    # it is tini, not systemd or the test.
    assert len(seen["proc"]) == len(in_cgroup) - 1, (seen["proc"], in_cgroup)
    assert max(seen["proc"]) < 100 and outside.pid not in seen["proc"]


# -- the view -------------------------------------------------------------------------------

CONNECT = r"""
import json, socket, sys
out = {}
for path in sys.argv[1:]:
    s = socket.socket(socket.AF_UNIX)
    try:
        s.connect(path)
        out[path] = "connected"
    except OSError as e:
        out[path] = e.errno
    s.close()
print(json.dumps(out))
"""


class Proxies:
    """What connected to the proxies (by path), and ``settle``: wait until every
    connection made before it was called has been taken off its listen queue."""

    def __init__(self) -> None:
        self.got: list[str] = []
        self.sweeps = 0  # full passes over every socket's queue
        self.changed = threading.Condition()

    def settle(self, timeout: float = 10.0) -> None:
        with self.changed:
            target = self.sweeps + 2  # one may have begun before the connections
            assert self.changed.wait_for(lambda: self.sweeps >= target, timeout), "no sweep"


@contextmanager
def unix_proxies(paths: list[Path]) -> Iterator[Proxies]:
    """A 0777 listening socket at each path; yields what connected."""
    proxies = Proxies()
    socks = []
    made_dirs = []
    try:
        for path in paths:
            if not path.parent.exists():
                path.parent.mkdir(parents=True)
                made_dirs.append(path.parent)
            s = socket.socket(socket.AF_UNIX)
            s.bind(str(path))
            os.chmod(path, 0o777)
            s.listen(8)
            s.setblocking(False)
            socks.append((str(path), s))
        stop = threading.Event()

        def serve() -> None:
            # Every queue drained in turn, then a sweep counted: a connection made before
            # a sweep began is in ``got`` once it ends.
            while not stop.is_set():
                for name, s in socks:
                    while True:
                        try:
                            conn, _ = s.accept()
                        except OSError:
                            break
                        proxies.got.append(name)
                        conn.close()
                with proxies.changed:
                    proxies.sweeps += 1
                    proxies.changed.notify_all()
                stop.wait(0.02)

        t = threading.Thread(target=serve, daemon=True)
        t.start()
        yield proxies
        stop.set()
        t.join(timeout=10)
    finally:
        for name, s in socks:
            s.close()
            with suppress(OSError):
                os.unlink(name)
        for directory in reversed(made_dirs):
            shutil.rmtree(directory, ignore_errors=True)


def test_host_unix_sockets_and_files_outside_the_view_are_not_there(lab: Lab) -> None:
    uid, _ = invoker()
    tag = f"egress-iso-{os.getpid()}"
    paths = [
        Path(p)
        for p in (
            f"/tmp/{tag}.sock", f"/var/tmp/{tag}.sock", f"/dev/shm/{tag}.sock",
            f"/run/user/{uid}/{tag}.sock", f"/var/lib/{tag}/proxy.sock", f"/srv/{tag}/proxy.sock",
        )
    ]  # fmt: skip
    with project() as d, unix_proxies(paths) as proxies:
        # Control: the same connect from the host reaches every proxy.
        host = subprocess.run([SYSTEM_PYTHON, "-c", CONNECT, *map(str, paths)],
                              capture_output=True, text=True, timeout=30)  # fmt: skip
        assert set(json.loads(host.stdout).values()) == {"connected"}, host
        proxies.settle()  # the control's connections taken, not counted for the sandbox
        assert sorted(proxies.got) == sorted(map(str, paths)), proxies.got
        proxies.got.clear()
        (d / "connect.py").write_text(CONNECT)
        secret = Path(f"/srv/{tag}/secret.txt")
        secret.write_text("s3cret")
        done = run(lab, d, "--", SYSTEM_PYTHON, str(d / "connect.py"), *map(str, paths))
        assert done.returncode == 0, done.stderr
        inside = json.loads(done.stdout)
        assert all(v == 2 for v in inside.values()), inside  # ENOENT: not there at all
        proxies.settle()
        assert proxies.got == [], proxies.got  # and nothing reached any proxy
        done = run(lab, d, "--", "/bin/cat", str(secret))
        assert done.returncode == 1 and "No such file" in done.stderr
        # Neither are egress's own files, nor the host's sockets directories.
        done = run(lab, d, "--", "/bin/sh", "-c",
                   "ls /run /var/lib /srv /home 2>&1; ls /run/egress 2>&1 || true")  # fmt: skip
        assert done.returncode == 0, done.stderr
        assert tag not in done.stdout and "sandboxes" not in done.stdout, done.stdout
        assert "No such file" in done.stdout  # /run/egress, /var/lib, /srv are not there


def test_ro_bind_and_bind_expose_exactly_what_they_name(lab: Lab) -> None:
    uid, gid = invoker()
    base = Path(tempfile.mkdtemp(prefix="egress-iso-binds-", dir="/srv"))
    try:
        for sub in ("ro", "rw", "hidden"):
            (base / sub).mkdir()
            (base / sub / "f.txt").write_text(sub)
            os.chown(base / sub, uid, gid)
            os.chown(base / sub / "f.txt", uid, gid)
        with project() as d:
            script = (
                "cat /data/ro/f.txt; echo; cat /data/rw/f.txt; echo;"
                " touch /data/ro/new 2>/dev/null; echo ro_write=$?;"
                " echo made > /data/rw/new; echo rw_write=$?;"
                f" ls {base}/hidden 2>/dev/null; echo hidden=$?; ls /data"
            )
            binds = ["--ro-bind", f"{base / 'ro'}:/data/ro", "--bind", f"{base / 'rw'}:/data/rw"]
            done = run(lab, d, *binds, "--", "/bin/sh", "-c", script)
        assert done.returncode == 0, done.stderr
        assert done.stdout.split() == ["ro", "rw", "ro_write=1", "rw_write=0", "hidden=2",
                                       "ro", "rw"], done.stdout  # fmt: skip
        made = base / "rw" / "new"
        assert made.read_text() == "made\n" and (made.stat().st_uid, made.stat().st_gid) == (
            uid,
            gid,
        )
        assert not (base / "ro" / "new").exists()
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_files_written_in_the_workdir_belong_to_the_invoking_user(lab: Lab) -> None:
    """Afterwards the invoking user reads, changes and removes them without sudo; the
    workload can't leave a set-uid or set-gid file behind (on disk it would be theirs)."""
    uid, gid = invoker()
    script = (
        "mkdir -p a/b && echo one > a/b/f && chmod 600 a/b/f && echo two > top"
        " && cp /bin/true prog && chmod 755 prog;"
        " chmod u+s prog; echo suid=$?; chmod g+s prog; echo sgid=$?;"
        " install -m 4755 /bin/true prog2; echo install=$?;"
        " python3 -c 'import os; os.open(\"p3\", os.O_CREAT | os.O_WRONLY, 0o6755)'; echo open=$?"
    )
    with project() as d:
        done = run(lab, d, "--", "/bin/sh", "-c", script)
        assert done.returncode == 0, done.stderr
        assert done.stdout.split() == ["suid=1", "sgid=1", "install=1", "open=1"], done.stdout
        # install made prog2 and then failed to set its mode: there, with no bit set.
        for path in [d / "a", d / "a/b", d / "a/b/f", d / "top", d / "prog", d / "prog2"]:
            st = path.stat()
            assert (st.st_uid, st.st_gid) == (uid, gid), path
            assert not st.st_mode & 0o6000, (path, oct(st.st_mode))
        edit = f"cd {d} && cat a/b/f && echo changed >> a/b/f && rm -rf a top prog prog2 && ls"
        as_user = ["setpriv", f"--reuid={uid}", f"--regid={gid}", "--clear-groups",
                   "/bin/sh", "-c", edit]  # fmt: skip
        after = subprocess.run(as_user, capture_output=True, text=True, timeout=30)
        assert after.returncode == 0, after.stderr
        assert after.stdout.split() == ["one"], after.stdout


# -- environment -----------------------------------------------------------------------------


def test_only_the_allowlist_and_env_flags_reach_the_command(lab: Lab) -> None:
    secret = "egress-secret-" + os.urandom(6).hex()
    environ = sudo_env(AWS_SECRET_ACCESS_KEY=secret, FROM_CALLER="caller-value", LC_TIME="C")
    with project() as d:
        (d / "vars.env").write_text("# a comment\n\nFROM_FILE=file-value\nFROM_CALLER\n")
        report = d / "report.json"
        done = run(lab, d, "--report", str(report), "--env", "GIVEN=given-value",
                   "--env-file", str(d / "vars.env"), "--", SYSTEM_PYTHON, "-c",
                   "import json, os; print(json.dumps(dict(os.environ)))",
                   environ=environ)  # fmt: skip
        assert done.returncode == 0, done.stderr
        inside = json.loads(done.stdout)
        text = report.read_text()
    assert secret not in done.stdout and "AWS_SECRET_ACCESS_KEY" not in inside
    assert inside["GIVEN"] == "given-value" and inside["FROM_FILE"] == "file-value"
    assert inside["FROM_CALLER"] == "caller-value" and inside["LC_TIME"] == "C"
    user = inside["USER"]
    assert user.startswith("egress-") and inside["LOGNAME"] == user
    assert inside["HOME"] == f"/home/{user}" and "SUDO_USER" not in inside
    expected = {"PATH", "LANG", "TERM", "TZ", "HOME", "USER", "LOGNAME", "PWD", "GIVEN",
                "FROM_FILE", "FROM_CALLER", "LC_TIME", "LC_ALL", "LC_CTYPE"}  # fmt: skip
    extra = set(inside) - expected
    assert not extra, extra
    data = json.loads(text)
    assert data["env"] == ["FROM_CALLER", "FROM_FILE", "GIVEN"]
    assert "given-value" not in text and "file-value" not in text and secret not in text


# -- uids ------------------------------------------------------------------------------------


def test_concurrent_runs_and_egressd_sandboxes_get_distinct_uids_freed_at_teardown(
    lab: Lab, daemon: Egressd
) -> None:
    with ExitStack() as stack:
        d = stack.enter_context(project())
        runs = [Running(run_argv(lab, d, "--", "/bin/sh", "-c", "id -u; read x; true"), sudo_env())
                for _ in range(2)]  # fmt: skip
        for r in runs:
            stack.callback(r.kill)
        run_uids = [int(r.line()) for r in runs]
        ids = [c.id for r in runs for c in claims.load_all() if c.owner_pid == r.proc.pid]
        boxes = []
        for _ in range(50):
            box = daemon.create(POLICY, lab.uplink_netns)
            stack.callback(drop, daemon, box["id"])
            boxes.append(box)
        box_uids = [b["uid"] for b in daemon.client.call("GET", "/v1/sandboxes") if b["id"] in
                    {x["id"] for x in boxes}]  # fmt: skip
        every = run_uids + box_uids
        assert len(every) == 52 and len(set(every)) == 52, every
        assert all(u in EGRESS_UIDS for u in every)
        # An exec of an egressd sandbox runs as that sandbox's uid.
        argv = [*exec_argv(daemon, boxes[0]["id"], d), "id", "-u"]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=60, env=sudo_env())
        assert done.stdout.strip() == str(boxes[0]["uid"]), done
        # The exec's idmapped mount and its mount point went with it.
        mnt = workloads_dir() / boxes[0]["id"] / "mnt"
        assert not list(mnt.iterdir()) if mnt.exists() else True
        assert str(mnt) not in Path("/proc/self/mountinfo").read_text()
        for r in runs:
            assert r.finish() == 0
        for b in boxes:
            daemon.delete(b["id"])
    # Freed: no claim holds them and the host-wide ledger names none of them. (Whether
    # another run on this machine has taken one since is not ours to assert.)
    ids += [b["id"] for b in boxes]
    assert len(ids) == 52
    assert not [c.id for c in claims.load_all() if c.id in ids]
    assert not [i for i in ids if (workloads_dir() / i).exists()]


def test_a_killed_runs_uid_is_reclaimed_by_gc_and_an_exhausted_range_refused(lab: Lab) -> None:
    """With a one-uid range: a second run is refused (exit 2, nothing made) while the
    first holds it, also after the first `egressctl run` was SIGKILLed (its workload still
    lives); `egressctl gc` ends the workload and frees the uid; a process of that uid
    outside any sandbox also keeps it from being handed out."""
    one = "2000100000-2000100000"
    environ = sudo_env(EGRESS_UID_RANGE=one)
    with project() as d:
        first = Running(run_argv(lab, d, "--", "/bin/sh", "-c", "id -u; read x; true"), environ)
        try:
            assert first.line() == "2000100000"
            [claim] = [c for c in claims.load_all() if c.owner_pid == first.proc.pid]
            first.proc.kill()
            first.proc.wait(timeout=LINE_S)
            assert uids.live_uids(range(2000100000, 2000100001)) == {2000100000}
            # A uid a claim holds is not looked for: its processes are not read.
            assert uids.live_uids(range(2000100000, 2000100001), known={2000100000}) == set()
            code, err, left = refused([*run_argv(lab, d), "--", "true"], environ)
            assert code == 2 and "no free uid" in err and left == [], (code, err, left)
            gc = subprocess.run([*EGRESSCTL, "gc"], capture_output=True, text=True,
                                env=environ, timeout=120)  # fmt: skip
            assert gc.returncode == 0, gc.stderr
            assert leftovers(claim.id, lab.uplink_netns) == []
            assert not (workloads_dir() / claim.id).exists()
            assert uids.live_uids(range(2000100000, 2000100001)) == set()
            again = run(lab, d, "--", "id", "-u", environ=environ)
            assert again.returncode == 0 and again.stdout.strip() == "2000100000", again
            squatter = subprocess.Popen(["setpriv", "--reuid=2000100000", "--regid=2000100000",
                                         "--clear-groups", "sleep", "600"])  # fmt: skip
            try:
                code, err, left = refused([*run_argv(lab, d), "--", "true"], environ)
                assert code == 2 and "no free uid" in err and left == [], (code, err, left)
            finally:
                squatter.kill()
                squatter.wait()
        finally:
            first.kill()
            cleanup(claim.id) if "claim" in locals() else None


def test_gc_removes_workload_files_left_behind_when_asked_never_a_live_or_busy_ones(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A reboot empties /run (the claims, the netns pins) and keeps
    /var/lib/egress/workloads (the homes). `egressctl gc` lists such files, and removes
    them with --orphans: not one whose uid still runs a process, nor one of a sandbox the
    journal says is frozen unless named, never the files of a sandbox whose claim lives
    (another run dir's) or whose netns is still pinned. Their uids are not handed out
    again until the files go. Claims made as a create makes them; the removed run dir
    and an unpinned netns path are the reboot."""
    where = {"EGRESS_WORKLOADS_DIR": str(tmp_path / "workloads"),
             "EGRESS_STATE_DIR": str(tmp_path / "state")}  # fmt: skip
    for key, value in where.items():
        monkeypatch.setenv(key, value)
    ids = range(2000200000, 2000200010)
    pools = Pools.parse(None)
    made = {}
    for run, sandbox_id in (("gone", "orphan-a"), ("gone", "orphan-b"), ("gone", "frozen-f"),
                            ("gone", "unknown-u"), ("kept", "live-c")):  # fmt: skip
        monkeypatch.setenv("EGRESS_RUN_DIR", str(tmp_path / run))
        made[sandbox_id] = claims.claim(sandbox_id, pools, None, ids).uid
        home = workloads_dir() / sandbox_id / "homes" / "agent"
        home.mkdir(parents=True)
        (home / "notes").write_text("what the agent kept")
        os.chown(home / "notes", made[sandbox_id], made[sandbox_id])
    assert sorted(made.values()) == list(ids[:5])
    with Journal.open(tmp_path / "state") as journal:  # as their creates journaled them
        for sandbox_id in ("orphan-a", "orphan-b", "live-c"):
            journal.record_sandbox(sandbox_id, "p")
        journal.record_sandbox("frozen-f", "p", state="frozen")  # unknown-u: another journal's
    shutil.rmtree(tmp_path / "gone")  # the reboot: these claims are gone (no netns pinned)
    b = made["orphan-b"]
    squatter = subprocess.Popen(["setpriv", f"--reuid={b}", f"--regid={b}", "--clear-groups",
                                 "sh", "-c", "echo up; exec sleep 600"],
                                stdout=subprocess.PIPE, text=True)  # fmt: skip
    assert squatter.stdout is not None and squatter.stdout.readline() == "up\n"
    environ = {**env(), **where, "EGRESS_RUN_DIR": str(tmp_path / "kept")}

    def gc(*args: str) -> str:
        done = subprocess.run([*EGRESSCTL, "gc", *args], capture_output=True, text=True,
                              env=environ, timeout=120)  # fmt: skip
        assert done.returncode == 0, done
        return done.stdout

    def left() -> set[str]:
        return {p.name for p in workloads_dir().iterdir() if not p.name.startswith(".")}

    try:
        out = gc()  # listed only
        assert "workload files of orphan-a" in out and "gc --orphans removes them" in out
        assert f"still run (pids {squatter.pid})" in out and "journal says it is frozen" in out
        assert "live-c" not in out and left() == set(made)
        with claims.locked(), uids.locked():  # the orphans' uids are still theirs
            assert uids.pick(ids, set()) == ids[5]
        out = gc("--orphans", "--dry-run")
        assert "workload files of orphan-a (uid" in out and "would be removed" in out, out
        assert left() == set(made)
        out = gc("--orphans")
        assert f"workload files of orphan-a (uid {made['orphan-a']}) removed" in out, out
        assert "unknown-u" in out and "has no record of it" in out, out
        assert left() == {"orphan-b", "frozen-f", "unknown-u", "live-c"}
        assert (workloads_dir() / "orphan-b" / "homes" / "agent" / "notes").exists()
        assert f"workload files of frozen-f (uid {made['frozen-f']}) removed" in gc("frozen-f")
        assert "workload files of unknown-u" in gc("unknown-u")
        squatter.kill()
        squatter.wait()
        assert "workload files of orphan-b" in gc("--orphans")
        assert left() == {"live-c"}
        assert (workloads_dir() / "live-c" / "homes" / "agent" / "notes").exists()
        assert gc("--orphans").strip() == "nothing to remove"
        with claims.locked(), uids.locked():  # free again; the live claim's is not
            assert uids.pick(ids, set()) == min(made["orphan-a"], made["orphan-b"],
                                               made["frozen-f"], made["unknown-u"])  # fmt: skip
        with Journal.open(tmp_path / "state") as journal:
            row = journal.sandbox("frozen-f")
            assert row is not None and row["state"] == "exited"
    finally:
        squatter.kill()
        squatter.wait()
        squatter.stdout.close()
        claims.release("live-c")
        shutil.rmtree(tmp_path / "workloads", ignore_errors=True)


# -- bad input -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "options, message",
    [
        (["--user", "root"], "never runs as root"),
        (["--user", "0"], "never runs as root"),
        (["--user", "no-such-user-egress"], "no such user"),
        (["--env", "1BAD=x"], "not a variable name"),
        (["--env", "NOT_SET_ANYWHERE_EGRESS"], "not set in egressctl's environment"),
        (["--uid-range", "5-1"], "uid range"),
        (["--bind", "/no/such/path"], "no such file or directory"),
        (["--workdir", "/no/such/dir"], "--workdir"),
        (["--workdir", "/etc"], "a system directory"),
        (["--workdir", "/var/lib/egress"], "a system directory"),
        (["--workdir", "/var"], "it holds egress's own files"),
    ],
)
def test_bad_input_exits_2_and_makes_nothing(lab: Lab, options: list[str], message: str) -> None:
    with project() as d:
        code, err, left = refused([*run_argv(lab, d, *options), "--", "true"], sudo_env())
        assert code == 2 and message in err, (code, err)
        assert left == []


def test_a_policy_the_workload_could_rewrite_through_its_view_is_refused(lab: Lab) -> None:
    """The working directory and --bind paths are writable to the workload (as you): a
    policy there is refused before anything is made, so no run reads what an agent
    wrote into it. A --ro-bind of it is fine."""
    with project() as d:
        inside = d / "policy.yaml"
        inside.write_text(POLICY)
        code, err, left = refused([*EGRESSCTL, "run", "--workdir", str(d), "--policy",
                                   str(inside), "--uplink-netns", lab.uplink_netns, "--",
                                   "true"], sudo_env())  # fmt: skip
        assert code == 2 and "which the workload may write" in err and left == [], err
        elsewhere = d.parent / "other"
        elsewhere.mkdir()
        (elsewhere / "p.yaml").write_text(POLICY)
        argv = [*EGRESSCTL, "run", "--workdir", str(d), "--bind", str(elsewhere),
                "--policy", str(elsewhere / "p.yaml"), "--uplink-netns", lab.uplink_netns,
                "--", "true"]  # fmt: skip
        code, err, left = refused(argv, sudo_env())
        assert code == 2 and f"inside {elsewhere}" in err and left == [], err
        argv[argv.index("--bind")] = "--ro-bind"
        ok = subprocess.run(argv, capture_output=True, text=True, env=sudo_env(), timeout=120)
        assert ok.returncode == 0, ok.stderr


def test_the_home_directory_is_never_the_working_directory(lab: Lab) -> None:
    """Run as root without sudo from /root (or with --workdir /root): refused, since the
    workload could plant ~/.bashrc or read ~/.ssh of the person who ran it."""
    root_env = {k: v for k, v in env().items() if not k.startswith("SUDO_")}
    with project() as d:
        code, err, left = refused([*run_argv(lab, d, "--workdir", "/root"), "--", "true"],
                                  root_env)  # fmt: skip
    assert code == 2 and "your home directory" in err and left == [], err


# -- no privilege back -----------------------------------------------------------------------


def test_no_user_namespace_and_no_capability_inside(lab: Lab) -> None:
    script = (
        "unshare -r true 2>/dev/null; echo userns=$?;"
        " unshare -U true 2>/dev/null; echo userns_only=$?;"
        " grep CapEff /proc/self/status; grep NoNewPrivs /proc/self/status"
    )
    with project() as d:
        done = run(lab, d, "--", "/bin/sh", "-c", script)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["userns=1", "userns_only=1", "CapEff:", "0" * 16,
                                   "NoNewPrivs:", "1"], done.stdout  # fmt: skip


def test_landlock_scope_alone_stops_signals_to_processes_outside() -> None:
    """The second wall, without the PID namespace: a process in egress's Landlock domain
    cannot signal a process outside it, even one of its own uid."""
    scope = confine.landlock_scoper()
    if scope is None:
        pytest.skip("this kernel has no Landlock signal scoping (Linux 6.12+)")
    victim = subprocess.Popen(["sleep", "600"])
    try:
        done = subprocess.run(["/bin/sh", "-c", f"kill -9 {victim.pid}"], preexec_fn=scope,
                              capture_output=True, text=True, timeout=30)  # fmt: skip
        assert done.returncode != 0 and "not permitted" in done.stderr, done
        assert victim.poll() is None
    finally:
        victim.kill()
        victim.wait()


def test_nothing_is_left_of_the_view_even_of_a_home_built_to_resist(lab: Lab) -> None:
    """The workload leaves 1,500 nested directories and 255-byte names in $HOME, and
    its working directory bound a second time: teardown removes its whole workload
    directory (homes, mount points, the uid's ledger entry), unmounts every idmapped
    mount, and leaves the user's own files where they were."""
    deep = (
        'cd "$HOME" && python3 -c "import os\n'
        "for i in range(1500): os.mkdir('d'); os.chdir('d')\n"
        "open('x' * 255, 'w').close()\" && echo x > /data/y && echo built"
    )
    with project() as d:
        (d / "mine.txt").write_text("the user's")
        report = d.parent / "r.json"
        done = run(lab, d, "--report", str(report), "--bind", f"{d}:/data", "--",
                   "/bin/sh", "-c", deep)  # fmt: skip
        assert done.returncode == 0 and done.stdout.strip() == "built", done
        sandbox_id = json.loads(report.read_text())["sandbox"]
        assert (d / "mine.txt").read_text() == "the user's" and (d / "y").read_text() == "x\n"
    assert not (workloads_dir() / sandbox_id).exists()
    mounts = Path("/proc/self/mountinfo").read_text()
    assert str(workloads_dir() / sandbox_id) not in mounts, "an idmapped mount outlived its run"
    assert leftovers(sandbox_id, lab.uplink_netns) == []


def test_the_sandbox_finds_its_own_name_without_asking_dns(lab: Lab) -> None:
    """git, Java and sudo look up the host's name; inside, that must not be a DNS query
    (denied, and under a freeze policy a freeze)."""
    with project() as d:
        report = d.parent / "r.json"
        done = run(lab, d, "--report", str(report), "--", "/bin/sh", "-c",
                   "getent hosts $(hostname); getent ahosts $(hostname) >/dev/null")  # fmt: skip
        assert done.returncode == 0, done.stderr
        data = json.loads(report.read_text())
    assert done.stdout.split()[1] == f"egress-{data['sandbox']}", done.stdout
    assert data["violations"] == [] and data["counters"]["dns_queries"] == 0, data["counters"]


def test_pid_1_reaps_orphans(lab: Lab) -> None:
    """An orphan's parent is PID 1 of the sandbox (tini), which reaps it when it exits:
    no zombie stays behind. The orphan is released through a FIFO, and the test waits for
    its /proc entry (a zombie keeps one) to go, with a deadline."""
    script = (
        "mkfifo f; p=$(sh -c 'head -c1 f >/dev/null & echo $!'); echo x > f;"
        " for i in $(seq 600); do [ -e /proc/$p ] || { echo reaped; exit 0; }; sleep 0.1; done;"
        " grep State /proc/$p/status; exit 1"
    )
    with project() as d:
        done = run(lab, d, "--", "/bin/sh", "-c", script)
    assert done.returncode == 0 and done.stdout.strip() == "reaped", done


@contextmanager
def victim_dir() -> Iterator[Path]:
    """A host directory no sandbox was given: root's files, one of them a secret."""
    path = Path(tempfile.mkdtemp(prefix="egress-iso-victim-", dir="/srv"))
    try:
        (path / "secret.env").write_text("DB_PASSWORD=not-for-the-agent\n")
        (path / "secret.env").chmod(0o600)
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.mark.parametrize("sudo", [True, False], ids=["sudo", "root"])
def test_a_symlink_an_earlier_workload_planted_leads_no_later_run_astray(
    lab: Lab, sudo: bool
) -> None:
    """Run 1 plants symlinks to a victim directory in its working directory; run 2 is
    pointed at them as an operator would (--workdir, --ro-bind, --env-file, or cd into
    the link): refused with exit 2 before anything is made. Without sudo the links are
    the workload's own uid's, with sudo the invoking user's (idmapped): both are
    suspects. Root's own symlinks (/lib, /var/run) are not."""
    environ = sudo_env() if sudo else {k: v for k, v in env().items() if not k.startswith("SUDO_")}
    with project() as d, victim_dir() as victim:
        if not sudo:
            d.chmod(0o777)  # root's tree, unmapped: the workload writes as its own uid
        plant = f"ln -s {victim} build && ln -s {victim} data && ln -s {victim}/secret.env p.env"
        done = run(lab, d, "--", "/bin/sh", "-c", plant, environ=environ)
        assert done.returncode == 0, done.stderr
        for options in (["--workdir", str(d / "build")], ["--ro-bind", f"{d / 'data'}:/data"],
                        ["--env-file", str(d / "p.env")]):  # fmt: skip
            argv = [*EGRESSCTL, "run", *options, "--policy", str(d.parent / "policy.yaml"),
                    "--uplink-netns", lab.uplink_netns, "--", "true"]  # fmt: skip
            code, err, left = refused(argv, environ)
            assert code == 2 and "which a sandbox's workload could have made" in err, err
            assert left == []
        # The shell cd'd through the link: the kernel's cwd is the victim, $PWD tells.
        argv = [*EGRESSCTL, "run", "--policy", str(d.parent / "policy.yaml"),
                "--uplink-netns", lab.uplink_netns, "--", "true"]  # fmt: skip
        proc = subprocess.run(argv, cwd=d / "build", env={**environ, "PWD": str(d / "build")},
                              capture_output=True, text=True, timeout=120)  # fmt: skip
        assert proc.returncode == 2 and "the current directory" in proc.stderr, proc.stderr
        assert sorted(p.name for p in victim.iterdir()) == ["secret.env"]
        # A root-owned system symlink is fine: /lib -> usr/lib on merged-/usr systems.
        if os.path.islink("/lib"):
            ok = run(lab, d, "--ro-bind", "/lib/os-release:/data/os-release", "--", "true",
                     environ=environ)  # fmt: skip
            assert ok.returncode == 0, ok.stderr


def test_without_sudo_the_workload_gets_no_root_owned_file_to_write(lab: Lab) -> None:
    """Run as root without sudo, the working directory is not idmapped: root's files stay
    root's (not the workload's), so it can't rewrite them."""
    root_env = {k: v for k, v in env().items() if not k.startswith("SUDO_")}
    with project((0, 0)) as d:
        (d / "roots.txt").write_text("root's\n")
        done = run(lab, d, "--", "/bin/sh", "-c",
                   "(echo more >> roots.txt) 2>/dev/null; echo append=$?; stat -c %u roots.txt",
                   environ=root_env)  # fmt: skip
        assert done.returncode == 0, done.stderr
        assert done.stdout.split() == ["append=2", "0"], done.stdout
        assert (d / "roots.txt").read_text() == "root's\n"


def test_the_report_goes_where_it_was_asked_even_if_the_workload_swaps_the_dir(
    lab: Lab,
) -> None:
    with project() as d, victim_dir() as victim:
        (d / "out").mkdir()
        os.chown(d / "out", *INVOKER)
        swap = f"rm -rf out && ln -s {victim} out"
        run(lab, d, "--report", str(d / "out" / "report.json"), "--", "/bin/sh", "-c", swap)
        assert sorted(p.name for p in victim.iterdir()) == ["secret.env"]

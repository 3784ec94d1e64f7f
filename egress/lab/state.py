"""What a running lab is made of, on disk, and how its processes are stopped safely.

``lab up`` and ``lab down`` are separate processes (or a pytest fixture and a CLI), so the
lab's facts live in ``/run/egress/lab/NAME.json`` (``$EGRESS_LAB_DIR`` overrides the
directory) with its logs, query and access logs, sites and TLS files under
``/run/egress/lab/NAME/``. /run is a tmpfs: state does not outlive a reboot, and neither do
network namespaces.

A PID on disk may have been recycled by the time ``down`` runs. A process is only signalled
when both its start time (/proc/PID/stat field 22) and its program still match what was
recorded when it was started.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from egress.errors import LabError

DEFAULT_LAB_DIR = Path("/run/egress/lab")
STATE_VERSION = 1
TERM_SECONDS = 3.0
KILL_SECONDS = 2.0


def lab_dir(override: str | Path | None = None) -> Path:
    """Where labs keep their state: ``override``, else $EGRESS_LAB_DIR, else /run/egress/lab."""
    return Path(override or os.environ.get("EGRESS_LAB_DIR") or DEFAULT_LAB_DIR)


@dataclass
class ProcRecord:
    """One process the lab started: enough to recognise it again, and nothing else."""

    role: str
    pid: int
    starttime: int
    argv: list[str]
    log: str = ""


@dataclass
class LabState:
    name: str
    uplink_netns: str
    inet_netns: str
    dns4: str
    dns6: str
    http4: list[str]
    http6: list[str]
    query_log: str
    zones_file: str
    run_dir: str
    dns_status_file: str
    processes: list[ProcRecord] = field(default_factory=list)
    created_at: float = 0.0
    version: int = STATE_VERSION
    # The web server's access log and its sites (sites.py); empty in older state files.
    access_log: str = ""
    sites_dir: str = ""
    sites: list[str] = field(default_factory=list)
    ca_file: str = ""
    tls_cert: str = ""
    tls_key: str = ""

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> LabState:
        fields = dict(data)
        fields["processes"] = [ProcRecord(**p) for p in fields.get("processes", [])]
        return cls(**fields)


def save_state(path: Path, state: LabState) -> None:
    """Atomic replace: a concurrent reader sees the old or the new state, never half."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(json.dumps(asdict(state), indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def load_state(path: Path) -> LabState | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        return LabState.from_json(data)
    except FileNotFoundError:
        return None
    except (OSError, ValueError, TypeError) as exc:
        raise LabError(f"unreadable lab state {path}: {exc}") from exc


@contextlib.contextmanager
def locked(directory: Path) -> Iterator[None]:
    """Serialise up/down on one state directory (two `lab up` at once would race)."""
    import fcntl  # Linux-only, like the rest of the lab

    directory.mkdir(parents=True, exist_ok=True, mode=0o755)
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


# -- processes ---------------------------------------------------------------------------


def proc_starttime(pid: int) -> int | None:
    """Start time in clock ticks since boot; None if gone or a zombie (already dead)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # comm (field 2) may hold spaces and parentheses: split after the last ')'.
    fields = stat.rpartition(")")[2].split()
    if not fields or fields[0] in ("Z", "X"):
        return None
    return int(fields[19])


def proc_cmdline(pid: int) -> list[str] | None:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return None
    return raw.decode(errors="replace").split("\0")[:-1]


def is_ours(record: ProcRecord) -> bool:
    """Still the process we started: same start time (PID plus start tick identify a
    process for the life of the system) and the same program. Only the program name is
    compared, because some programs rewrite the rest of their argv (iodine blanks its
    password); before ``ip netns exec`` has exec'd, the program is still ``ip``, and while
    it execs, the kernel shows an empty command line (the new image's arguments are not in
    place yet: a busy machine makes that window wide enough to hit)."""
    if proc_starttime(record.pid) != record.starttime:
        return False
    cmdline = proc_cmdline(record.pid)
    if cmdline is None:
        return False
    if not cmdline:
        return True  # mid-exec; the pid and start time already say it is the same process
    wrapped = record.argv[:3] == ["ip", "netns", "exec"] and len(record.argv) > 4
    return cmdline[0] == record.argv[0] or (wrapped and cmdline[0] == record.argv[4])


def record_process(role: str, popen: subprocess.Popen[Any], log: str = "") -> ProcRecord:
    starttime = proc_starttime(popen.pid)
    if starttime is None:
        raise LabError(f"{role} (pid {popen.pid}) exited at once; see {log or 'its output'}")
    return ProcRecord(role, popen.pid, starttime, [str(a) for a in popen.args], log)  # type: ignore[union-attr]


def stop_processes(
    records: Sequence[ProcRecord], popens: Mapping[int, subprocess.Popen[Any]] | None = None
) -> list[str]:
    """SIGTERM, then SIGKILL after a deadline, each process that is still ours.

    ``popens`` are children of this process: they are reaped, or they would linger as
    zombies. Returns problems (never raises) so teardown always finishes.
    """
    popens = popens or {}
    live = [r for r in records if is_ours(r)]
    problems: list[str] = []
    for sig, seconds in ((signal.SIGTERM, TERM_SECONDS), (signal.SIGKILL, KILL_SECONDS)):
        for record in live:
            _signal(record, sig)
        deadline = time.monotonic() + seconds
        while live and time.monotonic() < deadline:
            for pid in [r.pid for r in live]:
                if pid in popens:
                    popens[pid].poll()
            live = [r for r in live if is_ours(r)]
            if live:
                time.sleep(0.02)
        if not live:
            break
    problems += [f"{r.role} (pid {r.pid}) survived SIGKILL" for r in live]
    for popen in popens.values():
        with contextlib.suppress(subprocess.TimeoutExpired):
            popen.wait(timeout=0.5)
    return problems


def _signal(record: ProcRecord, sig: int) -> None:
    try:
        # Started with start_new_session: the group holds anything it forked, too.
        if os.getpgid(record.pid) == record.pid:
            os.killpg(record.pid, sig)
        else:
            os.kill(record.pid, sig)
    except ProcessLookupError:
        pass


def tail(path: str | Path, lines: int = 15) -> str:
    """The end of a log file, for error messages."""
    try:
        text = Path(path).read_text(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])

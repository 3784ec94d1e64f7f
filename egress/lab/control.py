"""``Lab``: bring a lab up, find it again, inspect it, tear it down.

The CLI (``egressctl lab``), the pytest fixture and the demo all go through this class, so
a lab made by one can be found and removed by another. ``up`` validates the zone file
before touching anything, records each resource in the state file as soon as it exists,
and on any failure removes exactly what it created, so a failed ``up`` leaves nothing
behind and a killed ``up`` leaves enough on disk for ``down`` to finish the job.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Any

import yaml

from egress.errors import LabError, LabExistsError
from egress.lab import nsutil, sites, state, topology
from egress.lab.accesslog import read_access_log
from egress.lab.querylog import read_query_log
from egress.lab.state import LabState, ProcRecord
from egress.lab.zones import DEFAULT_ZONES_FILE, fqdn, load_zones, parse_hostport

DEFAULT_NAME = "egresslab"
READY_SECONDS = 20.0
RELOAD_SECONDS = 5.0
PROBE_SECONDS = 0.5
_MODULE_MARK = "egress.lab."  # how lab server processes are recognised


class Lab:
    """A running lab: two netns, a DNS server, HTTP servers and the sites real tools fetch
    from (sites.py). See the package docstring."""

    def __init__(
        self,
        st: LabState,
        state_path: Path,
        popens: dict[int, subprocess.Popen[bytes]] | None = None,
    ) -> None:
        self._st = st
        self.state_path = state_path
        self._popens = popens if popens is not None else {}
        self.name = st.name
        self.uplink_netns = st.uplink_netns
        self.inet_netns = st.inet_netns
        self.dns4 = st.dns4
        self.dns6 = st.dns6
        self.http4 = list(st.http4)
        self.http6 = list(st.http6)
        self.query_log = st.query_log
        self.access_log = st.access_log
        self.zones_file = st.zones_file
        self.run_dir = st.run_dir
        self.sites = list(st.sites)  # Host names the web server answers from sites_dir
        self.sites_dir = st.sites_dir
        self.ca_file = st.ca_file  # the CA behind port 443's certificate; "" without TLS

    def __repr__(self) -> str:
        return f"<Lab {self.name} uplink={self.uplink_netns} dns={self.dns4}>"

    def __enter__(self) -> Lab:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.down()

    @property
    def processes(self) -> list[ProcRecord]:
        return list(self._st.processes)

    # -- lifecycle ---------------------------------------------------------------------

    @classmethod
    def up(
        cls,
        name: str = DEFAULT_NAME,
        zones: str | Path | None = None,
        *,
        state_dir: str | Path | None = None,
        timeout: float = READY_SECONDS,
    ) -> Lab:
        """Create the lab and return once its DNS and HTTP servers answer."""
        topology.validate_name(name)
        zones_path = Path(zones) if zones else DEFAULT_ZONES_FILE
        load_zones(zones_path)  # a bad zone file fails here, before anything is created
        if os.geteuid() != 0:
            raise LabError("lab up needs root: it creates network namespaces")
        directory = state.lab_dir(state_dir)
        with state.locked(directory):
            path = directory / f"{name}.json"
            if path.exists():
                raise LabExistsError(f"lab {name} is already up (state: {path})")
            return cls._build(name, zones_path, directory, path, timeout)

    @classmethod
    def _build(cls, name: str, zones: Path, directory: Path, path: Path, timeout: float) -> Lab:
        up_ns, inet_ns = topology.netns_names(name)
        run_dir = directory / name
        shutil.rmtree(run_dir, ignore_errors=True)  # debris of a lab whose state was lost
        run_dir.mkdir(mode=0o755)
        st = LabState(
            name=name,
            uplink_netns=up_ns,
            inet_netns=inet_ns,
            dns4=topology.DNS4,
            dns6=topology.DNS6,
            http4=list(topology.HTTP4),
            http6=list(topology.HTTP6),
            query_log=str(run_dir / "queries.jsonl"),
            zones_file=str(run_dir / "zones.yaml"),
            run_dir=str(run_dir),
            dns_status_file=str(run_dir / "dns-status.json"),
            created_at=time.time(),
            access_log=str(run_dir / "access.jsonl"),
        )
        lab = cls(st, path, {})
        created: list[str] = []
        try:
            for netns in (up_ns, inet_ns):
                if topology.netns_exists(netns):
                    raise LabExistsError(
                        f"netns {netns} already exists (try: egressctl lab down --name {name})"
                    )
            state.save_state(path, st)  # from here on, `lab down` can find and remove it
            topology.create(name, created)
            shutil.copyfile(zones, st.zones_file)
            Path(st.query_log).touch()
            Path(st.access_log).touch()
            lab._add_sites(sites.build(run_dir))
            lab._start_servers()
            lab._wait_ready(time.monotonic() + timeout)
            lab.clear_queries()  # the readiness probes are not the tests' queries
            lab.clear_requests()
            state.save_state(path, st)
            return lab
        except BaseException as exc:
            problems = lab._teardown(created)
            path.unlink(missing_ok=True)
            if isinstance(exc, LabError):
                extra = f" (cleanup: {'; '.join(problems)})" if problems else ""
                raise type(exc)(f"lab up {name} failed: {exc}{extra}") from exc
            raise

    def _add_sites(self, built: sites.Sites) -> None:
        st = self._st
        st.sites_dir, st.sites, st.ca_file = built.root, list(built.names), built.ca_file
        st.tls_cert, st.tls_key = built.cert_file, built.key_file
        self.sites, self.sites_dir, self.ca_file = list(st.sites), st.sites_dir, st.ca_file

    def _start_servers(self) -> None:
        st = self._st
        dns = [sys.executable, "-m", "egress.lab.dns", "--zones", st.zones_file]
        for addr in (st.dns4, st.dns6):
            dns += ["--listen", addr]
        dns += ["--query-log", st.query_log, "--status-file", st.dns_status_file]
        http = [sys.executable, "-m", "egress.lab.web"]
        http += ["--any-port", str(topology.ANY_PORT)]
        for addr in (*st.http4, *st.http6):
            http += ["--listen", addr]
        http += ["--access-log", st.access_log, "--sites", st.sites_dir]
        if st.tls_cert:
            http += ["--tls-cert", st.tls_cert, "--tls-key", st.tls_key]
        self.spawn(dns, role="dns", netns=st.inet_netns)
        self.spawn(http, role="http", netns=st.inet_netns)

    def spawn(
        self, argv: list[str], role: str, netns: str | None = None
    ) -> subprocess.Popen[bytes]:
        """Start a process in a lab netns (default: the internet one), e.g. iodined.

        It gets its own session, output to ``run_dir/ROLE.log``, and is recorded in the
        state file, so ``down`` stops it (by PID, after checking it is still the same
        process). Roles must be unique.
        """
        if any(p.role == role for p in self._st.processes):
            raise LabError(f"a process with role {role!r} already exists")
        log_path = Path(self.run_dir) / f"{role}.log"
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        # Children import egress from the same tree as this process, installed or not.
        root = str(Path(__file__).resolve().parents[2])  # the directory holding egress/
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
        with open(log_path, "ab") as log:  # Popen keeps its own copy of the fd
            popen = subprocess.Popen(
                nsutil.netns_exec_argv(netns or self.inet_netns, argv),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                close_fds=True,
                cwd="/",
                env=env,
            )
        self._popens[popen.pid] = popen
        self._st.processes.append(state.record_process(role, popen, str(log_path)))
        state.save_state(self.state_path, self._st)
        return popen

    def stop(self, role: str) -> None:
        """Stop a process started with ``spawn`` (SIGTERM, then SIGKILL) and forget it."""
        records = [p for p in self._st.processes if p.role == role]
        if not records:
            raise LabError(f"no lab process with role {role!r}")
        popens = {p.pid: self._popens.pop(p.pid) for p in records if p.pid in self._popens}
        problems = state.stop_processes(records, popens)
        self._st.processes = [p for p in self._st.processes if p.role != role]
        state.save_state(self.state_path, self._st)
        if problems:
            raise LabError("; ".join(problems))

    def _wait_ready(self, deadline: float) -> None:
        probes: dict[str, Callable[[], object]] = {
            f"dns {self.dns4}": lambda: self.dns_probe(self.dns4),
            f"dns {self.dns6}": lambda: self.dns_probe(self.dns6),
            f"http {self.http4[0]}": lambda: self.http_get(self.http4[0]),
            f"http {self.http6[0]}": lambda: self.http_get(self.http6[0]),
            f"http {self.http6[-1]}:443": lambda: self.http_get(self.http6[-1], 443),
        }
        errors: dict[str, str] = {}
        while probes:
            for label, probe in list(probes.items()):
                try:
                    probe()
                    del probes[label]
                except (OSError, LabError, ValueError) as exc:
                    errors[label] = str(exc) or type(exc).__name__
            if not probes:
                return
            self._check_alive()
            if time.monotonic() > deadline:
                waiting = "; ".join(f"{k}: {errors.get(k, '?')}" for k in probes)
                raise LabError(f"servers not answering in time ({waiting}){self._log_tails()}")
            time.sleep(0.05)

    def _check_alive(self) -> None:
        for record in self._st.processes:
            if not state.is_ours(record):
                raise LabError(f"{record.role} server exited{self._log_tails()}")

    def _log_tails(self) -> str:
        out = ""
        for record in self._st.processes:
            text = state.tail(record.log)
            if text:
                out += f"\n--- {record.log} ---\n{text}"
        return out

    def down(self) -> None:
        """Stop every recorded process, delete both netns, remove the state. Idempotent."""
        with state.locked(self.state_path.parent):
            problems = self._teardown([self.inet_netns, self.uplink_netns])
            self.state_path.unlink(missing_ok=True)
        if problems:
            raise LabError(f"lab down {self.name}: {'; '.join(problems)}")

    def _teardown(self, netns_list: list[str]) -> list[str]:
        problems = state.stop_processes(self._st.processes, self._popens)
        for netns in netns_list:
            strays = [p for p in netns_pids(netns) if p != os.getpid()]
            if strays:
                problems.append(f"processes not started by the lab still in {netns}: {strays}")
        problems += topology.destroy(list(reversed(netns_list)))
        shutil.rmtree(self.run_dir, ignore_errors=True)
        return problems

    @classmethod
    def load(cls, name: str = DEFAULT_NAME, *, state_dir: str | Path | None = None) -> Lab:
        """The lab ``name`` as recorded by whoever brought it up."""
        topology.validate_name(name)
        path = state.lab_dir(state_dir) / f"{name}.json"
        st = state.load_state(path)
        if st is None:
            raise LabError(f"lab {name} is not up (no state file {path})")
        return cls(st, path)

    @classmethod
    def down_by_name(cls, name: str = DEFAULT_NAME, *, state_dir: str | Path | None = None) -> bool:
        """Tear down lab ``name`` whether or not its state file survived; True if
        anything was found."""
        topology.validate_name(name)
        path = state.lab_dir(state_dir) / f"{name}.json"
        st = state.load_state(path)
        if st is not None:
            cls(st, path).down()
            return True
        with state.locked(path.parent):
            netns_list = [n for n in topology.netns_names(name) if topology.netns_exists(n)]
            if not netns_list:
                return False
            problems = _remove_orphans(netns_list)
        if problems:
            raise LabError(f"lab down {name}: {'; '.join(problems)}")
        return True

    # -- inspection --------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        """Health: netns present, recorded processes alive; ``state`` is up/degraded."""
        netns = {n: topology.netns_exists(n) for n in (self.uplink_netns, self.inet_netns)}
        procs = [
            {"role": p.role, "pid": p.pid, "alive": state.is_ours(p)} for p in self._st.processes
        ]
        healthy = all(netns.values()) and all(p["alive"] for p in procs)
        return {
            "name": self.name,
            "state": "up" if healthy else "degraded",
            "netns": netns,
            "processes": procs,
            **self.addresses(),
        }

    def addresses(self) -> dict[str, Any]:
        return {
            "uplink_netns": self.uplink_netns,
            "inet_netns": self.inet_netns,
            "dns": self.dns4,
            "dns6": self.dns6,
            "http": self.http4,
            "http6": self.http6,
            "sites": self.sites,
            "ca_file": self.ca_file,
            "query_log": self.query_log,
            "access_log": self.access_log,
            "state_file": str(self.state_path),
        }

    def queries(self) -> list[dict[str, Any]]:
        """Every query the lab DNS server has received since ``up`` (or ``clear_queries``)."""
        return read_query_log(self.query_log)

    def saw(self, name: str) -> bool:
        """Did a query for ``name`` (case-insensitive, trailing dot optional) arrive?"""
        want = fqdn(name)
        return any(q.get("qname") is not None and fqdn(q["qname"]) == want for q in self.queries())

    def clear_queries(self) -> None:
        # The server appends (O_APPEND), so truncating under it is safe.
        with open(self.query_log, "w", encoding="utf-8"):
            pass

    def requests(self) -> list[dict[str, Any]]:
        """Every request the lab web server has answered since ``up`` (or
        ``clear_requests``): see accesslog.py for the fields."""
        return read_access_log(self.access_log) if self.access_log else []

    def clear_requests(self) -> None:
        if self.access_log:
            with open(self.access_log, "w", encoding="utf-8"):
                pass

    # -- helpers for tests and the demo ------------------------------------------------

    def run(
        self, argv: list[str], netns: str | None = None, timeout: float = 30.0
    ) -> subprocess.CompletedProcess[str]:
        """Run a command in a lab netns (default: the uplink one) and capture its output."""
        return nsutil.run_in_netns(netns or self.uplink_netns, argv, timeout=timeout)

    def socket(
        self,
        family: int = socket.AF_INET,
        kind: int = socket.SOCK_STREAM,
        netns: str | None = None,
        proto: int = 0,
    ) -> socket.socket:
        """A socket in a lab netns (default: the uplink one)."""
        return nsutil.socket_in_netns(netns or self.uplink_netns, family, kind, proto)

    def dns_exchange(
        self,
        packet: bytes,
        server: str | None = None,
        *,
        tcp: bool = False,
        timeout: float = PROBE_SECONDS,
        netns: str | None = None,
    ) -> bytes:
        """Send raw DNS bytes to a lab DNS server (default: dns4) from a lab netns
        (default: the uplink one); return the raw reply."""
        return nsutil.dns_exchange(
            netns or self.uplink_netns, packet, server or self.dns4, tcp=tcp, timeout=timeout
        )

    def dns_probe(self, server: str) -> None:
        """One query from the uplink netns (any reply will do)."""
        nsutil.dns_probe(self.uplink_netns, server, PROBE_SECONDS)

    def http_get(
        self, addr: str, port: int = 80, path: str = "/", timeout: float = PROBE_SECONDS
    ) -> tuple[int, str]:
        """HTTP/1.0 GET from the uplink netns; (status, body)."""
        return nsutil.http_get(self.uplink_netns, addr, port, path, timeout)

    # -- zones at run time -------------------------------------------------------------

    def reload_zones(self, text: str | None = None) -> None:
        """Replace the lab's zones (or re-read them) and wait until the server uses them.

        A zone file the server rejects raises LabError and the old zones stay in force,
        both in the server and in the lab's copy of the file.
        """
        path = Path(self.zones_file)
        old = path.read_text(encoding="utf-8")
        if text is not None:
            path.write_text(text, encoding="utf-8")
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
        try:
            attempt = self._dns_status().get("attempt", 0)
            self._signal_dns(signal.SIGHUP)
            self._await_status(attempt, digest)
        except LabError:
            path.write_text(old, encoding="utf-8")
            raise

    def add_relay_target(self, zone: str, to: str) -> None:
        """Relay ``zone`` raw to ``to`` ('IP:PORT', e.g. a dns2tcpd started with ``spawn``).

        Replaces an existing relay for the same zone.
        """
        host, port = parse_hostport(to)
        if not host:
            raise LabError(f"relay target {to!r}: {port}")
        doc = yaml.safe_load(Path(self.zones_file).read_text(encoding="utf-8"))
        entries = [
            e
            for e in doc["zones"]
            if not ("relay" in e and fqdn(str(e["relay"].get("zone", ""))) == fqdn(zone))
        ]
        entries.append({"relay": {"zone": zone, "to": to}})
        doc["zones"] = entries
        self.reload_zones(yaml.safe_dump(doc, sort_keys=False))

    def _signal_dns(self, sig: int) -> None:
        for record in self._st.processes:
            if record.role == "dns" and state.is_ours(record):
                os.kill(record.pid, sig)
                return
        raise LabError(f"lab {self.name}: the DNS server is not running")

    def _dns_status(self) -> dict[str, Any]:
        try:
            status = json.loads(Path(self._st.dns_status_file).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return {}
        return status if isinstance(status, dict) else {}

    def _await_status(self, attempt: int, digest: str) -> None:
        deadline = time.monotonic() + RELOAD_SECONDS
        while time.monotonic() < deadline:
            status = self._dns_status()
            if status.get("attempt", 0) > attempt:
                if status.get("error"):
                    raise LabError(f"lab DNS server rejected the zones: {status['error']}")
                if status.get("zones_sha256") == digest:
                    return
            time.sleep(0.02)
        raise LabError(f"lab DNS server did not reload within {RELOAD_SECONDS:g} s")


def _remove_orphans(netns_list: list[str]) -> list[str]:
    """Without a state file, stop only what is recognisably a lab server in our netns."""
    problems: list[str] = []
    for netns in netns_list:
        for pid in netns_pids(netns):
            cmdline = state.proc_cmdline(pid) or []
            start = state.proc_starttime(pid)
            if start is not None and any(_MODULE_MARK in arg for arg in cmdline):
                problems += state.stop_processes([ProcRecord("orphan", pid, start, cmdline)])
    return problems + topology.destroy(netns_list)


def netns_pids(netns: str) -> list[int]:
    """PIDs of processes whose network namespace is ``netns``."""
    if not topology.netns_exists(netns):
        return []
    try:
        out = topology.run_ip(["netns", "pids", netns])
    except LabError:
        return []
    return [int(p) for p in out.split() if p.isdigit()]

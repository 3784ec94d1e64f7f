"""The lab itself: topology, DNS server, HTTP servers, lifecycle, CLI.

Everything else in tests/privileged stands on the lab, so these tests pin what the others
assume: which answers come back, that the query log sees every packet, that garbage does
not kill the DNS server, that the relay is byte-exact, and that `down` leaves nothing.
DNS is queried with dig from the uplink netns, where sandboxes will later attach.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from dnslib import DNSRecord

from egress.lab import Lab, LabExistsError, ZoneFileError, topology
from egress.lab.state import is_ours
from tests.support.probes import wait_until

pytestmark = [pytest.mark.privileged, pytest.mark.usefixtures("require_root")]

MakeLab = Callable[..., Lab]
needs_dig = pytest.mark.skipif(shutil.which("dig") is None, reason="dig (dnsutils) not installed")


def dig(lab: Lab, *args: str) -> str:
    done = lab.run(["dig", "+time=3", "+tries=1", *args])
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def short(lab: Lab, *args: str) -> list[str]:
    return dig(lab, f"@{lab.dns4}", "+short", *args).split()


def unique(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(4)}"


# -- topology -----------------------------------------------------------------------------


def test_uplink_has_only_lo_and_the_veth_and_default_routes_into_the_internet(lab: Lab) -> None:
    links = lab.run(["ip", "-o", "link"]).stdout
    names = sorted(line.split(":")[1].strip().split("@")[0] for line in links.splitlines())
    assert names == sorted(["lo", topology.UPLINK_IF])
    assert "default via 198.18.0.2" in lab.run(["ip", "route"]).stdout
    assert "default via 2001:db8:ffff::2" in lab.run(["ip", "-6", "route"]).stdout


def test_internet_routes_back_to_the_link_only(lab: Lab) -> None:
    v4 = lab.run(["ip", "route"], netns=lab.inet_netns).stdout
    v6 = lab.run(["ip", "-6", "route"], netns=lab.inet_netns).stdout
    assert "default" not in v4 and "default" not in v6
    assert "198.18.0.0/30 dev up0" in v4
    assert "2001:db8:ffff::/64 dev up0" in v6


@pytest.mark.parametrize("side", ["uplink", "inet"])
def test_forwarding_is_off(lab: Lab, side: str) -> None:
    netns = lab.uplink_netns if side == "uplink" else lab.inet_netns
    for key in ("net.ipv4.ip_forward", "net.ipv6.conf.all.forwarding"):
        assert lab.run(["sysctl", "-n", key], netns=netns).stdout.strip() == "0"


# -- DNS answers --------------------------------------------------------------------------


@needs_dig
def test_a_and_aaaa_over_v4_and_v6_transport(lab: Lab) -> None:
    assert short(lab, "allowed.lab.test", "A") == ["203.0.113.10"]
    out = dig(lab, f"@{lab.dns6}", "+short", "allowed.lab.test", "AAAA").split()
    assert out == ["2001:db8:80::10"]


@needs_dig
def test_cname_chain_is_followed_inside_the_lab_zones(lab: Lab) -> None:
    assert short(lab, "alias-chain.lab.test", "A") == [
        "alias-ok.lab.test.",
        "allowed.lab.test.",
        "203.0.113.10",
    ]
    assert short(lab, "alias-bad.lab.test") == ["denied.lab.test.", "198.51.100.12"]


@needs_dig
def test_nxdomain_carries_the_soa_with_the_negative_ttl(lab: Lab) -> None:
    reply = DNSRecord.parse(lab.dns_exchange(DNSRecord.question("nope.lab.test", "A").pack()))
    assert reply.header.rcode == 3 and reply.header.aa == 1
    assert [str(rr.rname) for rr in reply.auth] == ["lab.test."]
    assert reply.auth[0].rtype == 6 and reply.auth[0].ttl == 60
    out = dig(lab, f"@{lab.dns4}", "nope.lab.test")
    assert "status: NXDOMAIN" in out and "SOA" in out


def test_nodata_carries_the_soa(lab: Lab) -> None:
    reply = DNSRecord.parse(lab.dns_exchange(DNSRecord.question("allowed.lab.test", "MX").pack()))
    assert reply.header.rcode == 0 and not reply.rr
    assert reply.auth[0].rtype == 6


def test_names_outside_the_zones_are_refused(lab: Lab) -> None:
    reply = DNSRecord.parse(lab.dns_exchange(DNSRecord.question("example.com", "A").pack()))
    assert reply.header.rcode == 5 and reply.header.aa == 0


@needs_dig
def test_wildcard_and_second_zone(lab: Lab) -> None:
    assert short(lab, "x.y.wild.lab.test") == ["203.0.113.12"]
    assert short(lab, "allowed.lab.test.evil.test") == ["198.51.100.11"]


@needs_dig
def test_other_record_types_and_short_ttl(lab: Lab) -> None:
    assert short(lab, "txt.lab.test", "TXT") == ['"v=egresslab1', "hello", "from", "the",
                                                 "egress", 'lab"']  # fmt: skip
    assert short(lab, "mx.lab.test", "MX") == ["10", "mail.lab.test."]
    assert "alpn" in " ".join(short(lab, "https.lab.test", "HTTPS"))
    answer = dig(lab, f"@{lab.dns4}", "+noall", "+answer", "short-ttl.lab.test").split()
    assert answer[1] == "2" and answer[-1] == "203.0.113.11"
    assert short(lab, "mapped.lab.test", "AAAA") == ["::ffff:127.0.0.1"]


@needs_dig
def test_big_answer_is_truncated_over_udp_and_complete_over_tcp(lab: Lab) -> None:
    udp = dig(lab, f"@{lab.dns4}", "+noedns", "+notcp", "+ignore", "big.lab.test")
    flags = next(line for line in udp.splitlines() if line.startswith(";; flags:"))
    assert " tc" in flags.split(";")[2]
    lab.clear_queries()
    retried = dig(lab, f"@{lab.dns4}", "+noedns", "+short", "big.lab.test").split()
    assert len(retried) == 40
    protos = [q["proto"] for q in lab.queries() if q["qname"] == "big.lab.test"]
    assert protos == ["udp", "tcp"]  # dig retried over TCP after TC=1
    assert len(dig(lab, f"@{lab.dns6}", "+tcp", "+short", "big.lab.test", "TXT").splitlines()) == 4


@needs_dig
def test_slow_name_is_answered_late(lab: Lab) -> None:
    started = time.monotonic()
    assert dig(lab, f"@{lab.dns4}", "+time=6", "+short", "slow.lab.test").split() == [
        "203.0.113.10"
    ]
    assert time.monotonic() - started >= 2.5


# -- query log ----------------------------------------------------------------------------


def test_query_log_records_every_query_with_its_source(lab: Lab) -> None:
    name = unique("QLog") + ".Lab.Test"
    lab.dns_exchange(DNSRecord.question(name, "AAAA").pack())
    lab.dns_exchange(DNSRecord.question(name, "TXT").pack(), lab.dns6, tcp=True)
    entries = [q for q in lab.queries() if q["qname"] == name]  # exact case kept
    assert [(q["proto"], q["src"], q["qtype"]) for q in entries] == [
        ("udp", "198.18.0.1", "AAAA"),
        ("tcp", "2001:db8:ffff::1", "TXT"),
    ]
    assert all(q["bytes"] > 12 and q["ts"] > 0 for q in entries)
    assert lab.saw(name.lower()) and lab.saw(name + ".")
    assert not lab.saw(unique("never") + ".lab.test")


def test_query_log_keeps_non_ldh_bytes(lab: Lab) -> None:
    label = bytes(range(0x80, 0x80 + 40)) + b"A.b"
    packet = _query(b"\x07\x12", [label, b"lab", b"test"], qtype=16)
    reply = lab.dns_exchange(packet)
    assert reply[:2] == b"\x07\x12" and reply[2] & 0x80
    assert lab.saw(label.decode("latin-1") + ".lab.test")


# -- robustness and relay -----------------------------------------------------------------


def test_garbage_does_not_kill_the_dns_server(lab: Lab) -> None:
    dns = next(p for p in lab.processes if p.role == "dns")
    lab.clear_queries()
    garbage = [
        b"",
        b"\x00",
        b"garbage",
        os.urandom(700),
        b"\x12\x34\x01\x00\x00\x01\x00\x00\x00\x00\x00\x00\x3f" + b"x" * 10,  # label overruns
        b"\x12\x35\x01\x00\x00\x01\x00\x00\x00\x00\x00\x00\xc0\x0c\x00\x01\x00\x01",  # ptr loop
        b"\x12\x36\x81\x80\x00\x00\x00\x00\x00\x00\x00\x00",  # a response: never answered
    ]
    replies: dict[bytes, bytes] = {}
    with lab.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for packet in garbage:
            sock.sendto(packet, (lab.dns4, 53))
        sock.settimeout(1)
        with contextlib.suppress(TimeoutError):
            while True:
                reply = sock.recv(4096)
                replies[reply[:2]] = reply
    # Malformed but with a header: FORMERR, never silence. A response: never answered.
    assert DNSRecord.parse(replies[b"\x12\x34"]).header.rcode == 1
    assert DNSRecord.parse(replies[b"\x12\x35"]).header.rcode == 1
    assert b"\x12\x36" not in replies
    with lab.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.settimeout(2)
        sock.connect((lab.dns4, 53))
        sock.sendall(b"\x00\x05abc")  # promises 5 bytes, sends 3, hangs up
    reply = DNSRecord.parse(lab.dns_exchange(DNSRecord.question("allowed.lab.test").pack()))
    assert str(reply.a.rdata) == "203.0.113.10"
    assert is_ours(dns)
    unparsed = [q for q in lab.queries() if q["qname"] is None]
    assert len(unparsed) >= 5 and {q["bytes"] for q in unparsed} >= {0, 1, 7, 700}


RELAY_RESPONDER = """
import socket, sys
sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
sock.bind(("127.0.0.1", int(sys.argv[1])))
seen = open(sys.argv[2], "a")
while True:
    data, addr = sock.recvfrom(65535)
    seen.write(data.hex() + "\\n"); seen.flush()
    sock.sendto(data[:2] + bytes([data[2] | 0x80]) + data[3:] + b"RELAYED", addr)
"""


def test_relay_forwards_raw_bytes_both_ways(lab: Lab, tmp_path: Path) -> None:
    seen = tmp_path / "seen.hex"
    lab.spawn([sys.executable, "-c", RELAY_RESPONDER, "5353", str(seen)], role="relay-echo")
    try:
        # 63-byte labels of bytes no parser accepts, a 240+ byte name, a private qtype,
        # and mixed case in the relayed zone: all must arrive exactly as sent.
        labels = [bytes((i * 7 + j) % 256 or 1 for j in range(63)) for i in range(3)]
        packet = _query(b"\xab\xcd", [*labels, b"T", b"Lab", b"TEST"], qtype=65399)
        reply = _until(lambda: lab.dns_exchange(packet), lambda r: r.endswith(b"RELAYED"))
        assert reply == packet[:2] + bytes([packet[2] | 0x80]) + packet[3:] + b"RELAYED"
        assert bytes.fromhex(seen.read_text().splitlines()[-1]) == packet
        entry = [q for q in lab.queries() if q["bytes"] == len(packet)][-1]
        assert entry["qname"] == ".".join(x.decode("latin-1") for x in [*labels, b"T.Lab.TEST"])
        assert entry["qtype"] == "TYPE65399"
    finally:
        lab.stop("relay-echo")


def test_relay_with_nobody_listening_is_servfail_at_once(lab: Lab) -> None:
    started = time.monotonic()
    reply = lab.dns_exchange(DNSRecord.question("x.d.lab.test", "TXT").pack(), timeout=3)
    assert DNSRecord.parse(reply).header.rcode == 2
    assert time.monotonic() - started < 2  # ICMP port unreachable, not the relay timeout


def test_add_relay_target_at_run_time_and_bad_zones_keep_the_old(lab: Lab) -> None:
    question = DNSRecord.question("q.r.lab.test", "A").pack()
    assert DNSRecord.parse(lab.dns_exchange(question)).header.rcode == 3  # NXDOMAIN
    lab.add_relay_target("r.lab.test", "127.0.0.1:5355")
    assert DNSRecord.parse(lab.dns_exchange(question, timeout=3)).header.rcode == 2
    with pytest.raises(Exception, match="hidden by relay"):
        lab.add_relay_target("cdn.lab.test", "127.0.0.1:5356")
    cdn = DNSRecord.parse(lab.dns_exchange(DNSRecord.question("a1.cdn.lab.test").pack()))
    assert str(cdn.a.rdata) == "203.0.113.13"


has_iodine = shutil.which("iodined") and shutil.which("iodine") and Path("/dev/net/tun").exists()


@pytest.mark.skipif(not has_iodine, reason="iodine (and /dev/net/tun) not available")
def test_real_iodine_tunnel_through_the_relay_and_down_stops_it(make_lab: MakeLab) -> None:
    lab = make_lab()
    # The tunnel's own addresses (198.19.99.0/27) exist only inside the two lab netns.
    server = ["iodined", "-f", "-l", "127.0.0.1", "-p", "5353", "-P", "labpass"]
    lab.spawn([*server, "198.19.99.1/27", "t.lab.test"], role="iodined")
    _wait_udp_listener(lab, 5353)
    client = ["iodine", "-f", "-r", "-P", "labpass", lab.dns4, "t.lab.test"]
    lab.spawn(client, role="iodine", netns=lab.uplink_netns)
    deadline = time.monotonic() + 20
    while "198.19.99.2" not in lab.run(["ip", "-o", "addr"]).stdout:
        assert time.monotonic() < deadline, Path(lab.run_dir, "iodine.log").read_text()
        time.sleep(0.1)

    def names() -> list[str]:
        return [q["qname"] for q in lab.queries() if q["qname"]]

    # iodine's long, non-LDH names got through: its fragment-size probe, which it sends
    # after its address is up (a busy host saw the address before any long name).
    assert wait_until(lambda: max(map(len, names()), default=0) > 200, 20), names()[-5:]
    assert all(n.lower().endswith(".t.lab.test") for n in names())
    procs = lab.processes
    lab.down()  # iodine blanks its password in argv; down must still recognise it
    assert not any(is_ours(p) for p in procs)


@pytest.mark.skipif(shutil.which("dns2tcpd") is None, reason="dns2tcp not installed")
def test_real_dns2tcp_through_the_relay(lab: Lab, tmp_path: Path) -> None:
    rc = tmp_path / "dns2tcpd.rc"
    rc.write_text(
        "listen = 127.0.0.1\nport = 5354\nuser = nobody\nchroot = /tmp\n"
        "domain = d.lab.test\nresources = sink:127.0.0.1:9000\n"
    )
    lab.spawn(["dns2tcpd", "-F", "-f", str(rc)], role="dns2tcpd")
    try:
        _wait_udp_listener(lab, 5354)
        out = lab.run(["dns2tcpc", "-z", "d.lab.test", lab.dns4], timeout=20)
        assert "sink" in out.stdout, out.stdout + out.stderr
        assert any("=auth.d.lab.test" in (q["qname"] or "") for q in lab.queries())
    finally:
        lab.stop("dns2tcpd")


# -- HTTP, UDP echo, ICMP -----------------------------------------------------------------


def test_http_on_every_address_and_port_names_itself(lab: Lab) -> None:
    for addr in lab.http4 + lab.http6:
        for port in (80, 443, 8080):
            status, body = lab.http_get(addr, port, timeout=3)
            shown = f"[{addr}]" if ":" in addr else addr
            assert (status, body) == (200, f"lab {shown}:{port}\n")


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl not installed")
def test_http_with_curl_from_the_uplink(lab: Lab) -> None:
    out = lab.run(["curl", "-sS", "--max-time", "3", "-g", "http://[2001:db8:80::11]:443/"])
    assert out.stdout == "lab [2001:db8:80::11]:443\n", out.stderr


@pytest.mark.parametrize("addr", ["203.0.113.14", "2001:db8:80::12"])
def test_udp_echo(lab: Lab, addr: str) -> None:
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    with lab.socket(family, socket.SOCK_DGRAM) as sock:
        sock.settimeout(3)
        sock.sendto(b"hello lab", (addr, 9999))
        assert sock.recvfrom(100)[0] == b"hello lab"


def test_icmp_echo(lab: Lab) -> None:
    with lab.socket(socket.AF_INET, socket.SOCK_RAW, proto=socket.IPPROTO_ICMP) as sock:
        sock.settimeout(3)
        ident = os.getpid() & 0xFFFF
        body = struct.pack("!BBHHH", 8, 0, 0, ident, 1) + b"lab"
        csum = _checksum(body)
        sock.sendto(body[:2] + struct.pack("!H", csum) + body[4:], ("203.0.113.11", 0))
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline:
            packet, addr = sock.recvfrom(1500)
            icmp = packet[(packet[0] & 0x0F) * 4 :]
            if addr[0] == "203.0.113.11" and icmp[0] == 0:
                return
        pytest.fail("no ICMP echo reply")


@pytest.mark.parametrize("target", ["10.1.2.3", "169.254.169.254", "192.0.2.1", "fd00::1"])
def test_unserved_and_off_machine_addresses_are_unreachable(lab: Lab, target: str) -> None:
    family = socket.AF_INET6 if ":" in target else socket.AF_INET
    with lab.socket(family, socket.SOCK_STREAM) as sock:
        sock.settimeout(0.5)
        with pytest.raises(OSError):
            sock.connect((target, 80))


# -- lifecycle ----------------------------------------------------------------------------


def _host_snapshot() -> dict[str, str]:
    cmds = {
        "link": ["ip", "-o", "link"],
        "addr": ["ip", "-o", "addr"],
        "route4": ["ip", "route", "show", "table", "all"],
        "route6": ["ip", "-6", "route", "show", "table", "all"],
        "rule": ["ip", "rule"],
    }
    out = {k: subprocess.run(v, capture_output=True, text=True).stdout for k, v in cmds.items()}
    # Counters and link-state churn are not the lab's doing; names, addresses and routes are.
    out["link"] = "\n".join(sorted(line.split(":")[1].strip() for line in out["link"].splitlines()))
    return out


def _netns_list() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def test_up_then_down_leaves_nothing_behind_and_the_host_unchanged(make_lab: MakeLab) -> None:
    before = _host_snapshot()
    lab = make_lab()
    assert {lab.uplink_netns, lab.inet_netns} <= _netns_list()
    assert _host_snapshot() == before
    procs = lab.processes
    assert all(is_ours(p) for p in procs) and len(procs) == 2
    assert lab.status()["state"] == "up"
    assert Lab.load(lab.name).dns4 == lab.dns4
    lab.down()
    lab.down()  # idempotent
    assert not {lab.uplink_netns, lab.inet_netns} & _netns_list()
    assert not any(Path(f"/proc/{p.pid}").exists() and is_ours(p) for p in procs)
    assert not lab.state_path.exists() and not Path(lab.run_dir).exists()
    assert _host_snapshot() == before


def test_failed_up_removes_what_it_created(require_root: None) -> None:
    name = f"egl{secrets.token_hex(2)}"
    with pytest.raises(Exception, match="not answering in time"):
        Lab.up(name=name, timeout=0.0)  # servers cannot be ready that fast
    assert not {f"{name}-up", f"{name}-inet"} & _netns_list()
    assert not (Path("/run/egress/lab") / f"{name}.json").exists()
    assert not (Path("/run/egress/lab") / name).exists()
    assert not _lab_processes(name)


def test_up_refuses_a_foreign_netns_and_leaves_it_alone(require_root: None) -> None:
    name = f"egl{secrets.token_hex(2)}"
    subprocess.run(["ip", "netns", "add", f"{name}-inet"], check=True)
    try:
        with pytest.raises(LabExistsError, match="already exists"):
            Lab.up(name=name)
        assert f"{name}-inet" in _netns_list() and f"{name}-up" not in _netns_list()
    finally:
        subprocess.run(["ip", "netns", "delete", f"{name}-inet"], check=True)


def test_bad_zone_file_fails_before_creating_anything(require_root: None, tmp_path: Path) -> None:
    bad = tmp_path / "zones.yaml"
    bad.write_text("zones:\n  - zone: x.test\n    records:\n      a: {A: 300.1.1.1}\n")
    name = f"egl{secrets.token_hex(2)}"
    with pytest.raises(ZoneFileError, match=r"zones.yaml:4:\d+: .*not an IPv4"):
        Lab.up(name=name, zones=bad)
    assert not {f"{name}-up", f"{name}-inet"} & _netns_list()


def test_down_by_name_works_without_the_state_file(make_lab: MakeLab) -> None:
    lab = make_lab()
    procs = lab.processes
    lab.state_path.unlink()
    assert Lab.down_by_name(lab.name) is True
    assert not {lab.uplink_netns, lab.inet_netns} & _netns_list()
    assert not any(is_ours(p) for p in procs)
    assert Lab.down_by_name(lab.name) is False


def test_custom_zone_file(make_lab: MakeLab, tmp_path: Path) -> None:
    zones = tmp_path / "z.yaml"
    zones.write_text("zones:\n  - zone: mine.test\n    records:\n      w: {A: 203.0.113.14}\n")
    lab = make_lab(zones=zones)
    reply = DNSRecord.parse(lab.dns_exchange(DNSRecord.question("w.mine.test").pack()))
    assert str(reply.a.rdata) == "203.0.113.14"
    refused = DNSRecord.parse(lab.dns_exchange(DNSRecord.question("allowed.lab.test").pack()))
    assert refused.header.rcode == 5


def test_cli_up_status_down(require_root: None) -> None:
    name = f"egl{secrets.token_hex(2)}"

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        argv = [sys.executable, "-m", "egress.cli.main", "lab", *args, "--name", name]
        return subprocess.run(argv, capture_output=True, text=True, timeout=60)

    try:
        up = cli("up")
        assert up.returncode == 0, up.stderr
        facts = dict(line.split("=", 1) for line in up.stdout.splitlines())
        assert facts["uplink_netns"] == f"{name}-up" and facts["dns"] == "198.51.100.53"
        assert facts["dns6"] == "2001:db8:53::53" and "203.0.113.10" in facts["http"].split(",")
        assert facts["query_log"].endswith("queries.jsonl") and "is up" in up.stderr
        again = cli("up")
        assert again.returncode == 0 and "already up" in again.stderr
        assert again.stdout == up.stdout
        status = cli("status", "--json")
        assert status.returncode == 0 and json.loads(status.stdout)["state"] == "up"
    finally:
        down = cli("down")
    assert down.returncode == 0 and "is down" in down.stderr
    assert cli("down").returncode == 0
    gone = cli("status")
    assert gone.returncode == 3 and "state=down" in gone.stdout


# -- helpers ------------------------------------------------------------------------------


def _query(ident: bytes, labels: list[bytes], qtype: int) -> bytes:
    name = b"".join(bytes([len(label)]) + label for label in labels) + b"\x00"
    return ident + b"\x01\x00\x00\x01\x00\x00\x00\x00\x00\x00" + name + struct.pack("!HH", qtype, 1)


def _until(
    action: Callable[[], bytes], done: Callable[[bytes], bool], seconds: float = 10.0
) -> bytes:
    deadline = time.monotonic() + seconds
    while True:
        try:
            result = action()
            if done(result):
                return result
        except OSError:
            pass
        if time.monotonic() > deadline:
            pytest.fail("condition not met in time")
        time.sleep(0.05)


def _wait_udp_listener(lab: Lab, port: int, seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while not lab.run(["ss", "-Hlun", f"sport = :{port}"], netns=lab.inet_netns).stdout.strip():
        assert time.monotonic() < deadline, f"nothing listens on UDP {port} in {lab.inet_netns}"
        time.sleep(0.05)


def _checksum(data: bytes) -> int:
    if len(data) % 2:
        data += b"\x00"
    total = sum(struct.unpack(f"!{len(data) // 2}H", data))
    total = (total >> 16) + (total & 0xFFFF)
    total += total >> 16
    return ~total & 0xFFFF


def _lab_processes(name: str) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes().decode(errors="replace")
            except OSError:
                continue
            if "egress.lab." in cmdline and f"/{name}/" in cmdline:
                pids.append(int(entry.name))
    return pids

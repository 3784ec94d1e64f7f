"""The lab's network plumbing: two netns and one veth, built with ``ip`` commands.

iproute2 subprocesses rather than netlink: this runs once per lab, not per packet, and it
keeps the lab independent of egress's own netlink code, which it is used to test. The
host namespace is never touched: both veth ends are created directly inside their netns
(``ip -n NS link add ... peer ... netns OTHER``), so not even a transient link appears there.

Addresses (documentation/benchmark ranges only, RFC 2544, 5737, 3849)::

    NAME-up   inet0  198.18.0.1/30  2001:db8:ffff::1/64   default via .2 / ::2
    NAME-inet up0    198.18.0.2/30  2001:db8:ffff::2/64   no default route
              lo     198.51.100.53, 2001:db8:53::53         DNS
                     203.0.113.10-14, 198.51.100.10-12,
                     2001:db8:80::10-12                     HTTP, UDP echo

IPv6 addresses use ``nodad`` so they are usable at once (DAD would hold them tentative
for a second or more). Forwarding is off in both netns: the inet netns is an end host,
and forwarding in the uplink netns is egress's decision, not the lab's. Both are set, not
inherited: a new netns copies the host's forwarding, which may be on.
"""

from __future__ import annotations

import re
import subprocess
from collections.abc import Sequence
from pathlib import Path

from egress.errors import LabError

UPLINK_IF = "inet0"  # in NAME-up, towards the internet
INET_IF = "up0"  # in NAME-inet, towards the uplink
# The server addresses live on lo: this kernel has no dummy driver, and lo needs none.
SERVICE_IF = "lo"

UPLINK4, INET4, LINK4_PREFIX = "198.18.0.1", "198.18.0.2", 30
UPLINK6, INET6, LINK6_PREFIX = "2001:db8:ffff::1", "2001:db8:ffff::2", 64
DNS4, DNS6 = "198.51.100.53", "2001:db8:53::53"
HTTP4 = (
    "203.0.113.10",
    "203.0.113.11",
    "203.0.113.12",
    "203.0.113.13",
    "203.0.113.14",
    "198.51.100.10",
    "198.51.100.11",
    "198.51.100.12",
)
HTTP6 = ("2001:db8:80::10", "2001:db8:80::11", "2001:db8:80::12")
# Every address of this benchmark range is local in NAME-inet (AnyIP) and answers HTTP on
# ANY_PORT; the DNS server names them ip-198-19-A-B.any.lab.test. Tests that need many
# distinct destinations (one new IP per DNS answer) use them.
ANY4, ANY_PORT, ANY_ZONE = "198.19.0.0/16", 8081, "any.lab.test"

# Set in both netns as soon as they exist (see the module docstring): no forwarding, IPv6 on.
SYSCTLS = (
    "net.ipv4.conf.all.forwarding=0",
    "net.ipv4.conf.default.forwarding=0",
    "net.ipv6.conf.all.forwarding=0",
    "net.ipv6.conf.default.forwarding=0",
    "net.ipv6.conf.all.disable_ipv6=0",
    "net.ipv6.conf.default.disable_ipv6=0",
)
# The same for knobs only newer kernels have (Linux 6.17+: per-interface IPv6 forwarding,
# which new interfaces copy from default): set where they exist (``sysctl -e``).
SYSCTLS_IF_PRESENT = (
    "net.ipv6.conf.all.force_forwarding=0",
    "net.ipv6.conf.default.force_forwarding=0",
)

NETNS_DIR = Path("/run/netns")
IP_TIMEOUT = 20.0
_NAME = re.compile(r"^[a-z0-9][a-z0-9_-]{0,15}$")


def validate_name(name: str) -> str:
    """Lab names become netns and file names: keep them short and boring."""
    if not _NAME.match(name):
        raise LabError(
            f"bad lab name {name!r}: 1-16 characters of a-z, 0-9, '-', '_', "
            "starting with a letter or digit"
        )
    return name


def netns_names(name: str) -> tuple[str, str]:
    """(uplink netns, internet netns) of lab ``name``."""
    return f"{name}-up", f"{name}-inet"


def netns_exists(netns: str) -> bool:
    return (NETNS_DIR / netns).exists()


def uplink_commands() -> list[str]:
    """``ip -batch`` lines run inside NAME-up."""
    return [
        "link set lo up",
        f"link set {UPLINK_IF} up",
        f"address add {UPLINK4}/{LINK4_PREFIX} dev {UPLINK_IF}",
        f"address add {UPLINK6}/{LINK6_PREFIX} dev {UPLINK_IF} nodad",
        # The family of a default route follows its gateway's.
        f"route add default via {INET4} dev {UPLINK_IF}",
        f"route add default via {INET6} dev {UPLINK_IF}",
    ]


def inet_commands() -> list[str]:
    """``ip -batch`` lines run inside NAME-inet. Its only routes are the connected ones."""
    lines = [
        "link set lo up",
        f"link set {INET_IF} up",
        f"address add {INET4}/{LINK4_PREFIX} dev {INET_IF}",
        f"address add {INET6}/{LINK6_PREFIX} dev {INET_IF} nodad",
    ]
    lines += [f"address add {a}/32 dev {SERVICE_IF}" for a in (DNS4, *HTTP4)]
    lines += [f"address add {a}/128 dev {SERVICE_IF} nodad" for a in (DNS6, *HTTP6)]
    lines.append(f"route add local {ANY4} dev {SERVICE_IF}")
    return lines


def run_ip(args: Sequence[str], stdin: str | None = None) -> str:
    """Run one ``ip`` command; its stderr becomes the LabError message."""
    argv = ["ip", *args]
    try:
        done = subprocess.run(
            argv, input=stdin, capture_output=True, text=True, timeout=IP_TIMEOUT, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise LabError(f"{' '.join(argv)}: {exc}") from exc
    if done.returncode != 0:
        raise LabError(f"{' '.join(argv)}: {done.stderr.strip() or f'exit {done.returncode}'}")
    return done.stdout


def create(name: str, created: list[str]) -> None:
    """Build the topology; every netns made is appended to ``created`` at once, so a
    failure half-way leaves the caller a complete list of what to remove."""
    up, inet = netns_names(name)
    for netns in (up, inet):
        if netns_exists(netns):
            raise LabError(f"netns {netns} already exists (try: egressctl lab down --name {name})")
    for netns in (up, inet):
        run_ip(["netns", "add", netns])
        created.append(netns)
        run_ip(["netns", "exec", netns, "sysctl", "-q", "-w", *SYSCTLS])
        run_ip(["netns", "exec", netns, "sysctl", "-q", "-e", "-w", *SYSCTLS_IF_PRESENT])
    run_ip(["-n", up, "link", "add", UPLINK_IF, "type", "veth", "peer", "name", INET_IF,
            "netns", inet])  # fmt: skip
    run_ip(["-n", up, "-batch", "-"], "\n".join(uplink_commands()) + "\n")
    run_ip(["-n", inet, "-batch", "-"], "\n".join(inet_commands()) + "\n")


def destroy(netns_list: Sequence[str]) -> list[str]:
    """Delete each netns (their links go with them); return the errors, never raise,
    so teardown always runs to the end."""
    errors = []
    for netns in netns_list:
        if not netns_exists(netns):
            continue
        try:
            run_ip(["netns", "delete", netns])
        except LabError as exc:
            errors.append(str(exc))
    return errors

"""Scratch namespaces for the tests of the kernel shells (netns, nft, NFLOG, cgroup).

Other test sessions may run on the same machine at the same time, so every namespace,
interface and cgroup name carries this process's pid and a counter. Everything made here
is removed in ``finally`` blocks, also when a test fails.
"""

from __future__ import annotations

import itertools
import os
import secrets
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cache

from egress.kernel import netns
from tests.support import NOBODY, SYSTEM_PYTHON

_counter = itertools.count(1)


def unique(tag: str) -> str:
    """A netns-safe name unique to this test process."""
    return f"egt-{os.getpid()}-{tag}-{next(_counter)}"


def ifname(tag: str) -> str:
    """An interface name (at most 15 characters) unique to this test process."""
    return f"e{os.getpid() % 100000}{tag}{next(_counter)}"[:15]


@cache
def netns_unavailable() -> str | None:
    """Why this machine cannot run the privileged tests, or None if it can."""
    if os.geteuid() != 0:
        return "needs root: creates network namespaces, nftables rulesets and cgroups"
    if shutil.which("ip") is None:
        return "iproute2 (`ip`) is not installed"
    probe = f"eglp{secrets.token_hex(3)}"
    try:
        done = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True,
                              timeout=10)  # fmt: skip
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"cannot run `ip netns add`: {exc}"
    if done.returncode != 0:
        return f"`ip netns add` is impossible here: {done.stderr.strip()}"
    subprocess.run(["ip", "netns", "delete", probe], capture_output=True, timeout=10)
    return None


@contextmanager
def scratch_netns(tag: str = "ns") -> Iterator[str]:
    name = unique(tag)
    netns.create_netns(name)
    try:
        yield name
    finally:
        netns.remove_netns(name)


@dataclass(frozen=True)
class Pair:
    """A sandbox netns wired to an uplink netns by a veth; neither routes anywhere else."""

    sandbox: str
    uplink: str
    sandbox_if: str
    uplink_if: str
    sandbox4: str = "10.201.0.2"
    uplink4: str = "10.201.0.1"
    sandbox6: str = "fd00:201::2"
    uplink6: str = "fd00:201::1"


@contextmanager
def sandbox_pair() -> Iterator[Pair]:
    with scratch_netns("up") as up, scratch_netns("sb") as sb:
        pair = Pair(sb, up, ifname("s"), ifname("u"))
        netns.create_veth_pair(pair.uplink_if, pair.sandbox_if, sb, up)
        for ns, dev, a4, a6 in (
            (up, pair.uplink_if, pair.uplink4, pair.uplink6),
            (sb, pair.sandbox_if, pair.sandbox4, pair.sandbox6),
        ):
            netns.loopback_up(ns)
            netns.add_address(dev, f"{a4}/24", ns)
            netns.add_address(dev, f"{a6}/64", ns)
            netns.set_up(dev, ns)
        netns.add_default_route(pair.uplink4, sb)
        netns.add_default_route(pair.uplink6, sb)
        yield pair


def nobody_argv(ns: str, code: str) -> list[str]:
    """The argv that runs Python code inside ns as nobody:nogroup without capabilities."""
    argv = ["ip", "netns", "exec", ns, "setpriv", "--reuid", str(NOBODY), "--regid", str(NOBODY)]
    return [*argv, "--clear-groups", "--inh-caps=-all", SYSTEM_PYTHON, "-c", code]


def run_as_nobody(ns: str, code: str, timeout: float = 20) -> subprocess.CompletedProcess[str]:
    """Run Python code inside ns as nobody:nogroup without capabilities."""
    return subprocess.run(nobody_argv(ns, code), capture_output=True, text=True, timeout=timeout)


def ns_inode(path: str) -> int:
    return os.stat(path).st_ino


def strip_source_check(ns: str) -> None:
    """Leave the sandbox table in ``ns`` as an egress from before the source check loaded
    it: without the check's three output rules and its chain."""
    nft = ["ip", "netns", "exec", ns, "nft"]
    listed = subprocess.run([*nft, "-a", "list", "chain", "inet", "egress", "output"],
                            capture_output=True, text=True, check=True)  # fmt: skip
    handles = [line.rsplit("# handle ", 1)[1] for line in listed.stdout.splitlines()
               if "fib saddr" in line or "ip6 saddr ::" in line
               or 'oif "lo" tcp flags & rst == rst accept' in line]  # fmt: skip
    assert len(handles) == 3, listed.stdout
    older = "".join(f"delete rule inet egress output handle {h}\n" for h in handles)
    older += "delete chain inet egress spoofed_source\n"
    subprocess.run([*nft, "-f", "-"], input=older, text=True, check=True)

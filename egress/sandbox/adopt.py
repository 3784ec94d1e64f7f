"""Adopt a sandbox an earlier egressd created, from its run-dir record and address claim."""

from __future__ import annotations

import ipaddress
import os
import sys

from egress.datapath.addressing import SandboxNet
from egress.errors import EgressError, SandboxError
from egress.kernel.cgroup import Cgroup
from egress.kernel.nft import NftHandle
from egress.model import Policy
from egress.sandbox.lifecycle import (
    Sandbox,
    forget_spoofed_flows,
    pin_neighbours,
    renew_rules,
    teardown_claim,
)
from egress.store import claims
from egress.store.rundir import Record


def adopt_created(record: Record, policy: Policy) -> Sandbox:
    """A sandbox an earlier egressd created, from its address claim; its rules are
    reloaded only if an older egress loaded them (``renew_rules``).

    Its claim now names this process as owner, so `egressctl gc` leaves it alone.
    """
    found = [c for c in claims.load_all() if c.id == record.id]
    if not found:
        raise SandboxError(f"sandbox {record.id}: no address claim left; cannot adopt")
    claim = found[0]
    cgroup = Cgroup.open(record.id)
    # Made by an egressd before its v1 twins: its sessions would each weigh as one, and
    # spec.limits would not hold.
    for problem in cgroup.adopt_twins(policy.limits):
        print(f"egressd: sandbox {record.id}: {problem}", file=sys.stderr)
    net = SandboxNet(
        claim.index, ipaddress.IPv4Network(claim.net4), ipaddress.IPv6Network(claim.net6)
    )
    # Made by an egress before permanent neighbours: past ~500 such sandboxes on a host,
    # the kernel's one neighbour table (1,024 entries) is full and the rest reach nothing.
    try:
        pin_neighbours(net, claim.netns, claim.host_if, claim.uplink_netns)
    except SandboxError as exc:
        print(f"egressd: sandbox {record.id}: {exc}", file=sys.stderr)
    nft = NftHandle.open(claim.netns)
    try:
        renewed = renew_rules(nft, policy, claim.netns)
    except EgressError:
        nft.close()
        raise
    if renewed:
        print(f"egressd: sandbox {record.id}: rules renewed (an older egress loaded them)",
              file=sys.stderr)  # fmt: skip
        said = forget_spoofed_flows(claim.netns)
        if said:
            print(f"egressd: sandbox {record.id}: {said}", file=sys.stderr)
    sb = Sandbox(
        record.id, policy, net, claim.netns, claim.host_if, claim.uplink_netns,
        cgroup, nft, uid=claim.uid,
    )  # fmt: skip

    def teardown() -> None:
        problems = teardown_claim(claim)
        if problems:
            raise SandboxError("; ".join(problems))

    sb.add_undo("sandbox", teardown)
    sb.add_undo("nft handle", nft.close)
    claim.owner_pid = os.getpid()
    claims.save(claim)
    return sb

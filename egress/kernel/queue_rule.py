"""The iptables-nft rules a sandbox netns needs: NFQUEUE for what nft marked.

nft's own ``queue`` statement needs nft_queue (CONFIG_NFT_QUEUE), which many kernels,
this project's test VMs among them, are built without; iptables-nft's ``-j NFQUEUE``
goes through nft_compat and the xt target instead. So the sandbox's nft table marks the
segments to hold (``datapath.render``'s ``first_bytes`` chain) and these rules, in
iptables-nft's ``mangle`` OUTPUT chain (priority -150), queue them (``render.queue_rules``
says which, and why there are three). The table is
iptables-nft's own (``table ip mangle``, ``table ip6 mangle``): the sandbox's atomic nft
loads never touch it, and removing the netns removes it.

Without these rules nothing is let through unchecked: a marked segment that is not queued
meets a drop in the sandbox's output chain.
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import sys
from collections.abc import Sequence

from egress.errors import SandboxError
from egress.kernel import nft_copy
from egress.kernel.netns import in_netns

TOOLS = {4: "iptables-nft", 6: "ip6tables-nft"}
TIMEOUT_S = 30.0


def install(netns: str | None, rules: Sequence[Sequence[str]], check: bool = False) -> None:
    """Append ``rules`` to mangle OUTPUT, in order, for IPv4 and IPv6 in ``netns``. With
    ``check`` (a netns egress did not make, or one an older egress made), only those not
    there yet."""
    if check:
        for family in (4, 6):
            for rule in rules:
                if not _present(netns, family, rule):
                    _run(netns, family, "-A", rule)
        return
    key = tuple(tuple(rule) for rule in rules)
    copy = _copies.get(key)
    if copy is not None and copy is not _EXEC_ONLY:
        try:
            nft_copy.apply(copy, netns)
            return
        except OSError as exc:  # iptables-nft knows best; and from now on it does it all
            print(f"egress: copying the NFQUEUE rules into {netns} failed ({exc}); "
                  "running iptables-nft for this and later sandboxes", file=sys.stderr,
                  flush=True)  # fmt: skip
            _copies[key] = _EXEC_ONLY
    for rule in rules:  # in order: a later rule acts on what an earlier one marked
        _exec_both(netns, rule)
    if key in _copies:
        return
    with contextlib.suppress(OSError):
        made = nft_copy.capture(netns, _FAMILIES, "mangle")
        # Exactly what a fresh netns gets: a table, its chain, the rules, per family.
        counts = (
            made.count(nft_copy.NEWTABLE) == len(_FAMILIES),
            made.count(nft_copy.NEWRULE) == len(_FAMILIES) * len(rules),
        )
        if all(counts) and made.plain():
            _copies[key] = made


# What iptables-nft made for the rules in a netns that had nothing of its own, read back
# (egress.kernel.nft_copy) and copied into the next fresh netns in one batch: each exec
# of iptables-nft cost 3-7 ms of a create. Only for netns egress made (no ``check``).
_copies: dict[tuple[tuple[str, ...], ...], nft_copy.Copy] = {}
_EXEC_ONLY = nft_copy.Copy(())  # a copy was refused once: iptables-nft from then on
_FAMILIES = (2, 10)  # NFPROTO_IPV4, NFPROTO_IPV6


def _exec_both(netns: str | None, rule: Sequence[str]) -> None:
    # Both at once: each is an exec of its own (3-5 ms from egressd), and they write
    # different tables (ip mangle, ip6 mangle) in transactions the kernel serialises.
    started: list[tuple[int, subprocess.Popen[str]]] = []
    try:
        for family in (4, 6):
            started.append((family, _start(netns, family, "-A", rule)))
    finally:  # one that started is waited for, also when the other could not start
        errors = [_finish(netns, family, "-A", proc) for family, proc in started]
    for error in errors:
        if error is not None:
            raise error


def remove(netns: str | None, rules: Sequence[Sequence[str]]) -> None:
    """Delete every copy of ``rules`` from ``netns`` (a netns egress leaves behind), and
    iptables-nft's mangle table if nothing else is left in it: installing made it."""
    for family in (4, 6):
        for rule in rules:
            while _present(netns, family, rule):
                _run(netns, family, "-D", rule)
        if shutil.which(TOOLS[family]) is not None and _empty(netns, family):
            _nft(netns, ["delete", "table", "ip" if family == 4 else "ip6", "mangle"])


def _empty(netns: str | None, family: int) -> bool:
    """mangle has no rule and no chain of its own (``-S`` lists only the policies)."""
    listing = _capture(netns, [TOOLS[family], "-w", "5", "-t", "mangle", "-S"])
    return listing is not None and all(line.startswith("-P ") for line in listing.splitlines())


def _nft(netns: str | None, args: list[str]) -> None:
    if shutil.which("nft") is not None:
        _capture(netns, ["nft", *args])


def _capture(netns: str | None, argv: list[str]) -> str | None:
    with in_netns(netns):
        try:
            done = subprocess.run(argv, capture_output=True, text=True, timeout=TIMEOUT_S)
        except (OSError, subprocess.TimeoutExpired):
            return None
    return done.stdout if done.returncode == 0 else None


def _present(netns: str | None, family: int, rule: Sequence[str]) -> bool:
    if shutil.which(TOOLS[family]) is None:
        return False  # no iptables-nft, so nobody put the rule there through it
    return _run(netns, family, "-C", rule, quiet=True) == 0


def _run(netns: str | None, family: int, op: str, rule: Sequence[str], quiet: bool = False) -> int:
    proc = _start(netns, family, op, rule)
    error = _finish(netns, family, op, proc, quiet)
    if error is not None:
        raise error
    return proc.returncode


def _start(netns: str | None, family: int, op: str, rule: Sequence[str]) -> subprocess.Popen[str]:
    tool = shutil.which(TOOLS[family])
    if tool is None:
        raise SandboxError(
            f"{TOOLS[family]} not found: name checks (connect.check_names) queue a flow's "
            "first bytes with its NFQUEUE target; install the iptables package, or set "
            "connect.check_names: false"
        )
    argv = [tool, "-w", "5", "-t", "mangle", op, "OUTPUT", *rule]
    with in_netns(netns):  # the child inherits the thread's netns
        try:
            return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        except OSError as exc:
            raise SandboxError(f"{TOOLS[family]} {op}: {exc}") from exc


def _finish(
    netns: str | None, family: int, op: str, proc: subprocess.Popen[str], quiet: bool = False
) -> SandboxError | None:
    """Wait for ``proc``; the error it makes, if any (None with ``quiet``)."""
    try:
        _, stderr = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired as exc:
        proc.kill()
        proc.communicate()
        return SandboxError(f"{TOOLS[family]} {op}: {exc}")
    if proc.returncode != 0 and not quiet:
        why = stderr.strip() or f"exit {proc.returncode}"
        return SandboxError(f"{TOOLS[family]} -t mangle {op} OUTPUT in netns {netns}: {why}")
    return None

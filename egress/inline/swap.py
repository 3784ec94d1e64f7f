"""Live policy swap for one served sandbox: nft rules, set elements and resolver at once.

The resolver's sets hold ``ip . proto . port`` elements learned from DNS answers. A new
policy must not flush them (clients holding a still-allowed answer would be blocked, and
a blocked connect freezes the sandbox), yet the elements of names it no longer allows must
go at once. So ``TrackingResolver`` remembers, per question, which addresses its answers
put in the sets; the swap keeps exactly the elements a still-allowed question justifies
under the new policy's ports, and deletes every other element in the same nft
transaction that replaces the chains' rules. Elements no question justifies (never
tracked) go too: the safe direction.

    swap(policy) ─▶ render ─▶ [flush chains + ruleset + delete elements] one transaction
                 ─▶ core.set_policy ─▶ sandbox, enforcer, scorer see the new policy
    (all in one event-loop turn: no query is decided between the two halves)
"""

from __future__ import annotations

import ipaddress
import sys
import time
from dataclasses import dataclass
from typing import Any

from egress.datapath import constants as c
from egress.datapath.elements import SetUpdate, plan_update
from egress.datapath.render import queue_rules as render_queue_rules
from egress.datapath.render import reload_rules
from egress.errors import DatapathError, EgressError
from egress.inline.server import ResolverServer
from egress.kernel import queue_rule
from egress.kernel.nft import NftHandle
from egress.model import IPAddress, Policy
from egress.policy.matcher import Matcher
from egress.resolver.actions import Action, AllowThenReply
from egress.resolver.answer import learned_ports
from egress.sandbox.lifecycle import Sandbox
from egress.store.paths import read_template
from egress.tunnel import scorer_for

MAX_TRACKED = 100_000


@dataclass
class Learned:
    ips: set[IPAddress]
    until: float


class TrackingResolver(ResolverServer):
    """A ResolverServer that remembers which question put which addresses in the sets.
    (An upstream reply to a question asked before a swap is decided by the core under the
    policy in force when it arrives.)"""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.learned: dict[tuple[str, int], Learned] = {}

    def allow(self, action: AllowThenReply) -> list[Action]:
        self._track(action)
        return super().allow(action)

    def _track(self, action: AllowThenReply) -> None:
        """Remember the addresses this question put in the sets, from the core's own
        action (its question, its addresses, its timeout): nothing is parsed again."""
        now = time.time()
        q = (action.qname, action.qtype)
        seen = self.learned.get(q)
        until = now + action.update.timeout_s
        if seen is None:
            if len(self.learned) >= MAX_TRACKED:
                self.learned = {k: v for k, v in self.learned.items() if v.until > now}
            self.learned[q] = Learned(set(action.ips), until)
        else:
            seen.ips.update(action.ips)
            seen.until = max(seen.until, until)

    def justified(self, policy: Policy, now: float) -> set[str]:
        """Set elements that a still-allowed question justifies under ``policy``."""
        matcher = Matcher(policy)
        keep: set[str] = set()
        for (name, qtype), seen in self.learned.items():
            decision = matcher.decide(name, qtype)
            if seen.until <= now or not decision.allowed:
                continue
            ports = policy.connect.ports
            if decision.rule is not None and not decision.rule.ports.is_empty():
                ports = decision.rule.ports
            update: SetUpdate = plan_update(seen.ips, ports, 1)
            keep.update(update.elements4, update.elements6)
        return keep

    def learned_list(self) -> list[list[Any]]:
        """What ``learned`` holds, as JSON for a successor egressd."""
        return [
            [name, qtype, sorted(str(ip) for ip in seen.ips), seen.until]
            for (name, qtype), seen in self.learned.items()
        ]

    def restore(self, entries: list[list[Any]]) -> None:
        """Take over a predecessor's ``learned_list()``; malformed entries are skipped.
        Each question binds its name to its addresses again (``core.bindings``), so a
        client that cached the answer still passes the first-bytes check; the names of a
        CNAME chain behind it are not handed over, and bind only when asked again."""
        now = time.time()
        for entry in entries[:MAX_TRACKED]:
            try:
                name, qtype, ips, until = entry
                learned = Learned({ipaddress.ip_address(ip) for ip in ips}, float(until))
                self.learned[(str(name), int(qtype))] = learned
            except (TypeError, ValueError):
                continue
            rule = self.core.matcher.rule_for(str(name))
            if rule is not None and learned.until > now:
                ports = learned_ports(rule, self.core.policy)
                self.core.bindings.learn(learned.ips, [str(name)], ports, now, learned.until,
                                         checked=rule.check_names)  # fmt: skip

    def seed_expiry(self, inherit: bool = True) -> None:
        """Learn when the elements already in the sets expire (an adopted sandbox), so
        no answer shortens them: the kernel remembers what our predecessor allowed.
        ``inherit``: no handover says which names they are for (``Bindings.inherit``)."""
        left = [(key, secs) for key, secs in self.nft.allowed_elements() if secs]
        self.core.seed_expiry(left, time.time(), inherit)

    def forget_unjustified(self, keep_names: Matcher) -> None:
        self.learned = {q: v for q, v in self.learned.items() if keep_names.decide(*q).allowed}


def swap_text(nft: NftHandle, policy: Policy, keep: set[str]) -> tuple[str, int]:
    """One nft transaction: the new rules, and the removal of every unjustified element."""
    lines = [reload_rules(read_template("sandbox.nft"), policy)]
    removed = 0
    for set_name in c.ALLOW_SETS:
        gone = [e["key"] for e in nft.list_set("inet", c.TABLE, set_name)]
        gone = [key for key in gone if key not in keep]
        removed += len(gone)
        if gone:
            lines.append(f"delete element inet {c.TABLE} {set_name} {{ {', '.join(gone)} }}")
    return "\n".join(lines) + "\n", removed


def swap(sb: Sandbox, resolver: TrackingResolver, policy: Policy) -> int:
    """Replace ``sb``'s policy in the kernel and in the resolver; returns elements removed.

    Synchronous on purpose: called on the event loop, nothing else runs until both halves
    are in place. An element expiring between listing and deleting fails the transaction
    (ENOENT); it is retried once with a fresh listing.
    """
    resolver.settle()  # the old scorer's part of what it let go first, before it goes
    now = time.time()
    keep = resolver.justified(policy, now)
    # A fresh libnftables context: the one that loaded the ruleset keeps its `define`s,
    # and would call the template's a redefinition.
    # Limits first: less memory than the sandbox uses is refused, and then nothing has
    # changed (set_limits puts back what it wrote). Only a cgroup egress made has them.
    before = sb.cgroup.limits() if sb.cgroup.ours else None
    if before is not None:
        sb.cgroup.set_limits(policy.limits)
    try:
        if policy.connect.check_names:  # the NFQUEUE rule first: until it is there, fail closed
            queue_rule.install(sb.reach, render_queue_rules(), check=True)
        with NftHandle.open(sb.reach, label=sb.netns) as nft:
            for attempt in (1, 2):
                text, removed = swap_text(nft, policy, keep)
                try:
                    nft.load(text)
                    break
                except DatapathError as exc:
                    if attempt == 2 or "No such file or directory" not in str(exc):
                        raise
    except BaseException:
        if before is not None:  # the old policy stays in force, all of it
            try:
                sb.cgroup.set_limits(before)
            except EgressError as exc:  # it grew past them meanwhile: say so, go on
                print(f"egress: sandbox {sb.id}: limits not put back after a failed swap:"
                      f" {exc}", file=sys.stderr)  # fmt: skip
        raise
    resolver.core.set_policy(policy)
    resolver.core.bindings.forget_inherited()  # their elements went with the swap
    resolver.core.scorer = scorer_for(policy.tunnel, time.monotonic)
    resolver.forget_unjustified(resolver.core.matcher)
    sb.policy = policy
    return removed

"""Turn the kernel's drop evidence (an NFLOG prefix and the packet's 5-tuple) into a
Violation: which class, which rule decided, what to tell a person."""

from __future__ import annotations

from egress.datapath.constants import DROP_LOG_PREFIX
from egress.model import Flow, Mode, Policy, Violation, ViolationClass

_DROPS = {DROP_LOG_PREFIX + cls.value: cls for cls in ViolationClass}


def drop_class(prefix: str) -> ViolationClass | None:
    """``egress blocked_connect`` -> BLOCKED_CONNECT; other prefixes are not drops. (A
    lookup: both layers ask it of every logged packet, most of them DNS copies, and an
    enum's ValueError cost more than the rest of judging a cached query.)"""
    found = _DROPS.get(prefix)
    if found is None and prefix.startswith(DROP_LOG_PREFIX):
        found = _DROPS.get(prefix.strip())  # kernel prefixes may carry trailing blanks
    return found


def drop_violation(
    policy: Policy, cls: ViolationClass, flow: Flow | None, uid: int | None, at: float, layer: str
) -> Violation:
    verb = "allowed (audit)" if policy.mode is Mode.AUDIT else "blocked"
    if cls is ViolationClass.FOREIGN_DNS:
        rule = "DNS goes only to the sandbox's resolver"
    elif cls is ViolationClass.SPOOFED_SOURCE:
        rule = "a sandbox sends only from its own addresses"
        verb = "blocked"  # in every mode: there is no destination in it to learn
    else:
        rule = "default deny: no connect.allow rule or DNS-learned address allows it"
    what = str(flow) if flow is not None else "a packet the kernel could not describe"
    detail = f"{what} {verb}" + (f" (uid {uid})" if uid is not None else "")
    return Violation(
        cls=cls, layer=layer, rule=rule, detail=detail, at=at, action=policy.action(cls),
        flow=flow, uid=uid,
    )  # fmt: skip

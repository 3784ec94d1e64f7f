"""What a person reads when a sandbox is frozen: the review block, on the layer's stderr
(`egressctl run`'s, egressd's), with what the workload did, the rule, the process, and
how to resume or kill it."""

from __future__ import annotations

from egress.freeze.enforcer import FreezeEvent


def printable(value: object) -> str:
    """The workload chose this text (its cmdline, its cwd): show it, never let it steer
    the terminal (escape sequences, carriage returns)."""
    return "".join(ch if ch.isprintable() else f"\\x{ord(ch):02x}" for ch in str(value))


def review_block(sandbox_id: str, event: FreezeEvent, hint: str, timeout: float | None) -> str:
    v, p = event.violation, event.process
    process = "not found"
    if p.get("pid"):
        process = f"pid {p['pid']} {printable(p.get('cmdline', ''))}"[:200]
        if p.get("cwd"):
            process += f" (cwd {printable(p['cwd'])})"
        if p.get("method") == "uid":
            process += " [by uid: its socket was already closed]"
    elif p.get("note"):
        process = str(p["note"])
    wait = (
        f"kills it in {timeout:g} s unless resumed"
        if timeout is not None
        else "waiting for a decision"
    )
    return "\n".join(
        [
            f"egress: sandbox {sandbox_id} is FROZEN "
            f"(the {v.layer} layer saw it; frozen {event.latency_ms:.1f} ms later)",
            f"  what:    {v.cls.value}: {printable(v.detail)}",
            f"  rule:    {v.rule}",
            f"  process: {process}",
            f"  resume:  egressctl resume{hint} {sandbox_id}",
            f"  kill:    egressctl kill{hint} {sandbox_id}",
            f"  ({wait})",
        ]
    )

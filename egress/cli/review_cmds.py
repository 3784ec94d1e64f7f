"""The review loop: `ps`, `journal`, `resume`, `kill`, with or without a daemon.

Everything here reads and writes the journal under the state dir and the sandbox's cgroup
directly, so a person can act on a frozen sandbox from any shell on the host.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import select
import sys
import time
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from egress.errors import EgressError, SandboxError
from egress.model import ReviewAction, SandboxState

if TYPE_CHECKING:
    from egress.kernel.cgroup import Cgroup
    from egress.store.journal import Journal

FMT = argparse.RawDescriptionHelpFormatter


def _state_dir_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--state-dir",
        metavar="DIR",
        help="journal directory (default: $EGRESS_STATE_DIR or /var/lib/egress)",
    )


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "ps",
        help="list sandboxes and their state",
        formatter_class=FMT,
        description="Sandboxes in the journal: running, frozen or exited.",
        epilog="example:\n  egressctl ps --json",
    )
    p.add_argument("--json", action="store_true", help="one JSON array, for scripts")
    p.add_argument("--all", action="store_true", help="include exited sandboxes")
    _state_dir_arg(p)
    p.set_defaults(func=cmd_ps)

    j = sub.add_parser(
        "journal",
        help="violations, freezes and decisions, newest first",
        formatter_class=FMT,
        description=(
            "Read the violation journal. With --follow, the last --limit events oldest first,\n"
            "then each new one as it is journaled, until interrupted; with --json as well,\n"
            "one JSON object per line (for log shippers)."
        ),
        epilog=(
            "examples:\n  egressctl journal --sandbox 3f2a1c\n"
            "  egressctl journal --follow --json | your-log-shipper"
        ),
    )
    j.add_argument("--sandbox", metavar="ID", help="only this sandbox")
    j.add_argument("--limit", type=int, default=50, metavar="N", help="at most N events (50)")
    j.add_argument(
        "--json", action="store_true", help="one JSON array, for scripts (JSON lines with --follow)"
    )
    j.add_argument("--follow", "-f", action="store_true", help="go on printing new events")
    _state_dir_arg(j)
    j.set_defaults(func=cmd_journal)

    for name, verb in (
        (
            "resume",
            "thaw a frozen sandbox; it goes on where it stopped (exit 1, saying why, "
            "where another freeze of it keeps it frozen)",
        ),
        ("kill", "kill every process of a sandbox (one whose egressctl run died is removed)"),
    ):
        r = sub.add_parser(
            name,
            help=verb,
            description=verb.capitalize() + ".",
            formatter_class=FMT,
            epilog=f"example:\n  egressctl {name} 3f2a1c",
        )
        r.add_argument("sandbox", metavar="ID")
        r.add_argument("--note", default="", help="why, for the journal")
        _state_dir_arg(r)
        r.set_defaults(func=cmd_decide, action=name)
    register_gc(sub)


def register_gc(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    g = sub.add_parser(
        "gc",
        help="remove sandboxes whose egressctl run is gone",
        formatter_class=FMT,
        description=(
            "Tear down every sandbox whose `egressctl run` process has died (killed, "
            "crashed, or the host's egress was stopped): kill its processes, remove its "
            "netns, veth, uplink rules, cgroup and address claim. A sandbox kept with "
            "--keep is only removed when named. It also lists workload files (the "
            "workload's $HOME, under /var/lib/egress/workloads) that sandboxes left "
            "behind when their claim and netns went without a teardown (their run dir "
            "was removed, or a reboot emptied /run); --orphans or naming one removes "
            "them. Their uids are not handed out again until then."
        ),
        epilog=(
            "examples:\n  egressctl gc --dry-run\n  egressctl gc\n  egressctl gc 3f2a1c\n"
            "  egressctl gc --orphans"
        ),
    )
    g.add_argument("sandbox", nargs="*", metavar="ID",
                   help="only these (also --keep ones, and the files one left behind)")  # fmt: skip
    g.add_argument("--dry-run", action="store_true", help="only list what it would remove")
    g.add_argument(
        "--orphans",
        action="store_true",
        help="also remove the workload files sandboxes left behind, but not while a process "
        "of their uid runs, and only those of sandboxes the journal knows and does not say "
        "are frozen (evidence awaiting a decision); others only when named. A --keep "
        "sandbox's claim is gone after a reboot: its files are removed like any other's",
    )
    _state_dir_arg(g)
    g.set_defaults(func=cmd_gc)


def cmd_gc(args: argparse.Namespace) -> int:
    from egress.sandbox.lifecycle import teardown_claim
    from egress.store import claims

    wanted = set(args.sandbox)
    removed, failed = [], 0
    for claim in claims.load_all():
        named = claim.id in wanted
        if wanted and not named:
            continue
        if not named and (claims.alive(claim.owner_pid) or claim.keep):
            continue
        if args.dry_run:
            removed.append(claim.id)
            gone = "" if claims.alive(claim.owner_pid) else ", gone"
            print(f"sandbox {claim.id} would be removed "
                  f"(netns {claim.netns}; owner pid {claim.owner_pid}{gone})")  # fmt: skip
            continue
        problems = teardown_claim(claim)
        if problems:
            failed += 1
            print(f"sandbox {claim.id}: could not remove: {'; '.join(problems)}")
            continue
        removed.append(claim.id)
        with contextlib.suppress(EgressError), _journal(args) as journal:
            if journal.sandbox(claim.id) is not None:
                journal.set_sandbox_state(claim.id, SandboxState.EXITED)
    for sandbox_id in [] if args.dry_run else removed:
        print(f"sandbox {sandbox_id} removed")
    reported, orphans_failed = _gc_orphans(args, wanted)
    failed += orphans_failed
    if not removed and not failed and not reported:
        print("nothing to remove")
    return 1 if failed else 0


def _gc_orphans(args: argparse.Namespace, wanted: set[str]) -> tuple[int, int]:
    """Workload files left behind (``lifecycle.orphans``): listed, or removed with
    --orphans or by id. Returns how many were reported (listed, kept, removed or to be),
    and failures."""
    from egress.sandbox.lifecycle import orphans, remove_orphan
    from egress.store import uids

    found = orphans(wanted)  # looked at again under the lock before anything is removed
    kept_by_journal = _kept_by_journal(args, [o.entry.sandbox_id for o in found])
    chosen: set[str] = set()
    for o in found:
        e = o.entry
        what = f"workload files of {e.sandbox_id} (uid {e.uid})"
        named = e.sandbox_id in wanted
        why = kept_by_journal.get(e.sandbox_id)
        if o.pids:
            pids = " ".join(map(str, o.pids[:8])) + (" ..." if len(o.pids) > 8 else "")
            print(f"{what}: kept, processes of uid {e.uid} still run (pids {pids}); "
                  "end them, then gc again")  # fmt: skip
        elif why and not named:
            print(f"{what}: kept, {why}; name it to remove them: egressctl gc {e.sandbox_id}")
        elif not (args.orphans or named):
            print(f"{what}: left behind (its claim and netns are gone); "
                  "egressctl gc --orphans removes them")  # fmt: skip
        elif args.dry_run:
            print(f"{what} would be removed (its claim and netns are gone)")
        else:
            chosen.add(e.sandbox_id)
    failures = 0
    if chosen:
        try:
            with uids.locked():  # still orphaned, with nothing of their uid running?
                again = [o for o in orphans(chosen) if not o.pids]
        except SandboxError as exc:
            print(f"workload files: {exc}")
            return len(found), 1
        # Removed outside the lock (a home can be large): the entry holds its uid until it
        # is gone, and no sandbox can take its id while its directory is there.
        gone = []
        for o in again:
            error = remove_orphan(o)
            if error:
                failures += 1
                print(f"workload files of {o.entry.sandbox_id}: could not remove: {error}")
                continue
            print(f"workload files of {o.entry.sandbox_id} (uid {o.entry.uid}) removed")
            gone.append(o.entry.sandbox_id)
        if gone:
            with contextlib.suppress(EgressError), _journal(args) as journal:
                for sandbox_id in gone:
                    row = journal.sandbox(sandbox_id)
                    if row is not None and row["state"] != SandboxState.EXITED:
                        journal.set_sandbox_state(sandbox_id, SandboxState.EXITED)
    return len(found), failures


def _kept_by_journal(args: argparse.Namespace, ids: list[str]) -> dict[str, str]:
    """Why the journal keeps each of ``ids`` unless named: it says the sandbox is frozen
    (its home may be a freeze's evidence), or it has no record of it, or there is no
    journal to ask (another --state-dir's sandbox, say). A home is removed unnamed only
    when the journal knows its sandbox and that it is not frozen."""
    from egress.store.journal import JOURNAL_FILE
    from egress.store.paths import state_dir

    if not ids:
        return {}
    where = state_dir(args.state_dir)
    if not (where / JOURNAL_FILE).exists():
        return {i: f"there is no journal in {where} to say it is not frozen" for i in ids}
    try:
        with _journal(args) as journal:
            rows = {i: journal.sandbox(i) for i in ids}
    except EgressError as exc:
        return {i: f"the journal can't be read ({exc})" for i in ids}
    out = {}
    for i, row in rows.items():
        if row is None:
            out[i] = f"the journal in {where} has no record of it"
        elif row["state"] == SandboxState.FROZEN:
            out[i] = "the journal says it is frozen (awaiting a decision)"
    return out


def _journal(args: argparse.Namespace) -> Any:
    from egress.store.journal import Journal
    from egress.store.paths import state_dir

    return Journal.open(state_dir(args.state_dir))


def cmd_ps(args: argparse.Namespace) -> int:
    with _journal(args) as journal:
        rows = [_live_state(r) for r in journal.sandboxes()]
    if not args.all:
        rows = [r for r in rows if r["state"] != SandboxState.EXITED]
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    if not rows:
        print("no sandboxes" + ("" if args.all else " running (--all shows exited ones)"))
        return 0
    print(f"{'SANDBOX':<8} {'STATE':<8} {'POLICY':<20} {'INLINE':>7} {'OBSERVER':>8}  CREATED")
    for r in rows:
        print(
            f"{r['id']:<8} {r['state']:<8} {r['policy'][:20]:<20} {r['inline_pid'] or '-':>7} "
            f"{r['observer_pid'] or '-':>8}  {_when(r['created_at'])}"
        )
    return 0


def _live_state(row: dict[str, Any]) -> dict[str, Any]:
    """The journal's state, corrected by what the machine shows now."""
    from egress.store.claims import alive

    out = {
        k: row.get(k)
        for k in (
            "id",
            "policy",
            "state",
            "netns",
            "cgroup",
            "created_at",
            "ended_at",
            "inline_pid",
            "observer_pid",
        )
    }
    if out["state"] == SandboxState.EXITED:
        return out
    try:
        frozen = sandbox_cgroup(row).is_frozen()
    except EgressError:
        out["state"] = (
            SandboxState.EXITED
        )  # its cgroup is gone: whatever ran it died without saying so
        return out
    out["state"] = SandboxState.FROZEN if frozen else SandboxState.RUNNING
    for key in ("inline_pid", "observer_pid"):
        pid = out[key]
        if isinstance(pid, int) and not alive(pid):
            out[key] = None
    return out


def sandbox_cgroup(row: dict[str, Any]) -> Cgroup:
    """The cgroup a journaled sandbox runs in: egress's own (by id), or the one it was
    attached to (egressd attach, egressd sidecar), from the paths the journal keeps."""
    from egress.kernel.cgroup import Cgroup
    from egress.kernel.netns import netns_path

    try:
        return Cgroup.open(row["id"])
    except EgressError:
        if not row.get("cgroup"):
            if row.get("netns"):  # attached before its processes ran (a CNI ADD)
                return Cgroup.in_netns(netns_path(row["netns"]))
            raise
        return Cgroup.attach_existing(row["cgroup"], row.get("freezer"))


def _when(at: float | None) -> str:
    if not at:
        return "-"
    return datetime.fromtimestamp(at, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def cmd_journal(args: argparse.Namespace) -> int:
    with _journal(args) as journal:
        if args.sandbox and journal.sandbox(args.sandbox) is None:
            raise SandboxError(f"no sandbox {args.sandbox!r} in {journal.path}")
        if args.follow:
            return _follow(args, journal)
        events = journal.events(args.sandbox, limit=args.limit)
    if args.json:
        print(json.dumps(events, indent=2, default=str))
        return 0
    for e in events:
        _print_event(e, False)
    if not events:
        print("the journal is empty")
    return 0


def _follow(args: argparse.Namespace, journal: Journal) -> int:
    """``journal --follow``: the last ``--limit`` events, then each new one, until
    interrupted (or the reader of a pipe goes away)."""
    from egress.store.follow import POLL_S, Follower

    follower = Follower(journal, args.sandbox)
    events = follower.backlog(args.limit)
    try:
        while True:
            for e in events:
                _print_event(e, args.json)
            sys.stdout.flush()
            time.sleep(POLL_S)
            events = follower.poll()
    except KeyboardInterrupt:
        return 0
    except BrokenPipeError:
        # The reader left: stop quietly, and let Python's exit not complain about it.
        with contextlib.suppress(OSError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


def _print_event(e: dict[str, Any], as_json: bool) -> None:
    if as_json:
        from egress.store.follow import event_json

        print(event_json(e))
    else:
        print(f"{_when(e['at'])}  {e['sandbox_id']:<7} {_describe(e)}")


def _describe(event: dict[str, Any]) -> str:
    kind, r = event["kind"], event["record"]
    if kind == "violation":
        layers = ", ".join(d["layer"] for d in r.get("detected_by") or []) or r["layer"]
        text = f"violation {r['class']} ({r['action']}; seen by {layers}): {r['detail']}"
        proc = r.get("process") or {}
        if proc.get("pid"):
            text += f"\n{'':31}process: pid {proc['pid']} {proc.get('cmdline', '')}"
            if proc.get("cwd"):
                text += f" (cwd {proc['cwd']})"
        elif proc.get("note"):
            text += f"\n{'':31}process: {proc['note']}"
        return text
    if kind == "freeze_requested":
        return f"freeze requested by {r['layer']}"
    if kind == "frozen":
        return f"frozen ({r.get('latency_ms', 0):.2f} ms after detection)"
    if kind == "decision":
        note = f" ({r['note']})" if r.get("note") else ""
        return f"{r['action']} by uid {r['uid']}{note}"
    if kind == "sandbox_started" and r:
        return "sandbox started " + _policy_and_uid(r)
    return str(kind).replace("_", " ")


def _policy_and_uid(r: dict[str, Any]) -> str:
    """(policy NAME, sha256 HEX, uid N): which bytes it enforced, and as whom it ran."""
    parts = [f"policy {r['policy']}"]
    if r.get("policy_sha256"):
        parts.append(f"sha256 {r['policy_sha256']}")
    if r.get("uid") is not None:
        parts.append(f"uid {r['uid']}")
    return f"({', '.join(parts)})"


def cmd_decide(args: argparse.Namespace) -> int:
    with _journal(args) as journal:
        row = journal.sandbox(args.sandbox)
        if row is None:
            raise SandboxError(f"no sandbox {args.sandbox!r} in {journal.path} (see egressctl ps)")
        try:
            if row["state"] == SandboxState.EXITED:
                raise SandboxError("exited")
            cgroup = sandbox_cgroup(row)
        except EgressError:
            raise SandboxError(
                f"sandbox {args.sandbox} has ended; nothing to {args.action}"
            ) from None
        note = args.note or _who()
        if args.action == ReviewAction.RESUME:
            from egress.freeze import review

            review.resume(journal, cgroup, args.sandbox, os.getuid(), note)
            print(f"sandbox {args.sandbox} resumed")
        else:
            journal.record_decision(args.sandbox, args.action, os.getuid(), time.time(), note)
            _kill(cgroup)
            print(f"sandbox {args.sandbox} killed")
            _report_end(journal, args.sandbox)
    return 0


def _kill(cgroup: Cgroup) -> None:
    """cgroup.kill, where a removal racing it (`egressctl gc`, the observer of a dead
    `egressctl run`) is no failure: a cgroup that is gone runs nothing."""
    try:
        cgroup.kill()
    except (EgressError, OSError) as exc:
        if os.path.isdir(cgroup.v2_path):
            raise SandboxError(f"kill: {exc}") from None


END_S = 30.0  # the observer's teardown after a kill: ~0.2 s idle, longer on a busy host


def _report_end(journal: Any, sandbox_id: str) -> None:
    """Who removes a killed sandbox's netns, veth and cgroup. Never this shell: a live
    `egressctl run` (or egressd) ends its own. If run died, its observer layer does (it
    took over the journal's owner_pid): wait for it, so the kill returns with the
    sandbox gone. If nothing alive will, say that `egressctl gc` does."""
    from egress.store import claims

    row = journal.sandbox(sandbox_id) or {}
    ender = row.get("owner_pid")
    if isinstance(ender, int) and ender == row.get("observer_pid"):
        _wait_exit(ender, END_S)
        if (journal.sandbox(sandbox_id) or {}).get("state") == SandboxState.EXITED:
            print(f"sandbox {sandbox_id} removed by its observer layer "
                  "(its egressctl run had died)")  # fmt: skip
            return
    found = [c for c in claims.load_all() if c.id == sandbox_id]
    if found and not claims.alive(found[0].owner_pid):
        hint = f"`egressctl gc {sandbox_id}` does"
        print(f"egressctl: sandbox {sandbox_id}: no egress process is left to remove its "
              f"netns, veth and cgroup; {hint}", file=sys.stderr)  # fmt: skip


def _wait_exit(pid: int, timeout: float) -> None:
    """Until process ``pid`` has exited, or ``timeout``."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    try:
        select.select([fd], [], [], timeout)
    finally:
        os.close(fd)


def _who() -> str:
    sudo = os.environ.get("SUDO_USER")
    return f"via sudo by {sudo}" if sudo else ""

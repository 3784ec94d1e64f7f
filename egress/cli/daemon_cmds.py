"""`egressctl sandbox create|attach|list|show|delete|set-policy|exec`: egressd's API, from a shell.

These talk to egressd over its unix socket (``--daemon PATH``, default
/run/egress/egressd.sock). The review commands (`ps`, `journal`, `resume`, `kill`) work
without a daemon: they read the same journal and act on the same cgroups egressd's
sandboxes use, so they see and act on daemon-served sandboxes too (a resume or kill made
that way is journaled with the uid of the shell; through the API, `POST
/v1/sandboxes/ID/resume|kill`, with the uid of the socket's peer).

The HTTP client they use is ``egress.cli.client``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
from typing import Any

from egress.cli import workload_args
from egress.cli.client import Client, default_socket
from egress.errors import DaemonError, EgressError, SandboxError, UsageError
from egress.kernel.cgroup import Cgroup
from egress.model import SandboxKind, SandboxState

FMT = argparse.RawDescriptionHelpFormatter


def _daemon_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--daemon", metavar="PATH", help="egressd's socket (default: %(default)s)",
                   default=default_socket())  # fmt: skip
    p.add_argument("--json", action="store_true", help="print the API's JSON answer")


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    top = sub.add_parser(
        "sandbox",
        help="create, attach, list, delete sandboxes and swap policies through egressd",
        formatter_class=FMT,
        description="Manage the sandboxes egressd serves, through its API socket.",
        epilog=(
            "examples:\n"
            "  egressctl sandbox create --policy policies/python-dev.yaml\n"
            "  egressctl sandbox attach --netns agent1 --cgroup "
            "/sys/fs/cgroup/unified/agent1 --policy p.yaml\n"
            "  egressctl sandbox set-policy 3f2a1c --policy p2.yaml\n"
            "  egressctl sandbox exec 3f2a1c -- python3 agent.py\n"
            "  egressctl sandbox delete 3f2a1c\n"
            "resume, kill, ps and journal work on daemon sandboxes as on any other."
        ),
    )
    cmds = top.add_subparsers(dest="sandbox_cmd", metavar="COMMAND", required=True)
    c = _sub(cmds, "create", "create a sandbox (egressd makes netns, veth, cgroup)",
             "egressctl sandbox create --policy p.yaml --uplink-netns lab-up")  # fmt: skip
    c.add_argument("--policy", required=True, metavar="FILE")
    c.add_argument("--uplink-netns", metavar="NS", help="netns its traffic leaves through")
    c.add_argument("--upstream", metavar="IP[:PORT]", help="instead of the policy's upstreams")
    c.set_defaults(func=cmd_create)
    a = _sub(cmds, "attach", "enforce a policy in a netns and cgroup you made",
             "egressctl sandbox attach --netns agent1 --cgroup /sys/fs/cgroup/agent1 "
             "--policy p.yaml")  # fmt: skip
    a.add_argument("--netns", required=True, metavar="NAME|PATH")
    a.add_argument(
        "--cgroup",
        metavar="DIR",
        help="cgroup v2 directory (default: the one the processes in the netns come to run "
        "in; until one does, violations are blocked and journaled, not frozen)",
    )
    a.add_argument("--freezer", metavar="DIR", help="v1 freezer cgroup directory, if any")
    a.add_argument("--policy", required=True, metavar="FILE")
    a.add_argument("--uplink-netns", metavar="NS", help="netns upstream DNS queries leave from")
    a.add_argument("--upstream", metavar="IP[:PORT]")
    a.add_argument("--id", metavar="ID", help="the sandbox id to use")
    a.set_defaults(func=cmd_attach)
    ls = _sub(cmds, "list", "sandboxes egressd serves", "egressctl sandbox list --json")
    ls.set_defaults(func=cmd_list)
    for name, verb, func in (
        ("show", "one sandbox, as JSON", cmd_show),
        ("delete", "tear down (or detach from) a sandbox", cmd_delete),
    ):
        d = _sub(cmds, name, verb, f"egressctl sandbox {name} 3f2a1c")
        d.add_argument("sandbox", metavar="ID")
        d.set_defaults(func=func)
    s = _sub(cmds, "set-policy", "replace a sandbox's policy live",
             "egressctl sandbox set-policy 3f2a1c --policy p2.yaml")  # fmt: skip
    s.add_argument("sandbox", metavar="ID")
    s.add_argument("--policy", required=True, metavar="FILE", help="the new policy")
    s.set_defaults(func=cmd_set_policy)
    e = _sub(cmds, "exec", "run a command inside a served sandbox, unprivileged",
             "egressctl sandbox exec --user agent 3f2a1c -- python3 agent.py")  # fmt: skip
    e.description = (
        "Run CMD in the sandbox as egressctl run runs its command: it joins the sandbox's\n"
        "cgroup before it execs (so a freeze stops it and names it), enters its netns, in\n"
        "a PID namespace and a view of the host of its own (see `egressctl run --help`),\n"
        "as the sandbox's own uid with no capabilities and no_new_privs. Waits for it and\n"
        "exits with its status (128+N if killed by signal N); SIGINT, SIGTERM and SIGHUP\n"
        "are passed on. Execs of one sandbox share its uid and $HOME.\n"
        "A frozen sandbox is refused; if it freezes while CMD runs, this says so and waits."
    )
    e.add_argument(
        "--user", metavar="NAME|UID",
        help="run as this existing account, never root (default: the sandbox's own uid)",
    )  # fmt: skip
    workload_args.add(e)
    e.add_argument("sandbox", metavar="ID")
    e.add_argument("argv", nargs=argparse.REMAINDER, metavar="-- CMD ARGS...")
    e.set_defaults(func=cmd_exec)


def _sub(cmds: Any, name: str, text: str, example: str) -> argparse.ArgumentParser:
    p: argparse.ArgumentParser = cmds.add_parser(
        name, help=text, description=text[0].upper() + text[1:] + ".",
        formatter_class=FMT, epilog=f"example:\n  {example}",
    )  # fmt: skip
    _daemon_arg(p)
    return p


def _policy_text(path: str) -> str:
    """The policy file's text, read once here, in egressctl, and only if the workload
    could not have changed it (egress.store.trust; PolicyError, exit 2, if it could): any
    uid or gid of the range egress gives sandboxes' workloads ($EGRESS_UID_RANGE, else the
    default; egressd's --uid-range should be the same). egressd journals the sha256 of
    these bytes."""
    from egress.store.trust import read_policy
    from egress.store.uids import parse_range

    ids = parse_range(None)
    trusted = read_policy(path, workload_uids=ids, workload_gids=ids)
    try:
        return trusted.data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise EgressError(f"--policy {path}: {exc}") from None


def _run(args: argparse.Namespace, method: str, url: str, body: dict[str, Any] | None) -> Any:
    try:
        return Client(args.daemon).call(method, url, body)
    except DaemonError as exc:
        data = exc.data if isinstance(exc.data, dict) else {}
        for problem in data.get("problems") or []:
            print(problem.replace("<api>", getattr(args, "policy", None) or "<api>"),
                  file=sys.stderr)  # fmt: skip
        raise


def _print(args: argparse.Namespace, data: Any, line: str) -> int:
    print(json.dumps(data, indent=2) if args.json else line)
    return 0


def cmd_create(args: argparse.Namespace) -> int:
    body = {"policy": _policy_text(args.policy), "uplink_netns": args.uplink_netns,
            "upstream": args.upstream}  # fmt: skip
    data = _run(args, "POST", "/v1/sandboxes", body)
    return _print(args, data, f"sandbox {data['id']} created (netns {data['netns']})")


def cmd_attach(args: argparse.Namespace) -> int:
    body = {"netns": args.netns, "cgroup": args.cgroup, "freezer": args.freezer,
            "policy": _policy_text(args.policy), "uplink_netns": args.uplink_netns,
            "upstream": args.upstream, "id": args.id}  # fmt: skip
    data = _run(args, "POST", "/v1/sandboxes/attach", body)
    return _print(args, data, f"sandbox {data['id']} attached to netns {data['netns']}")


def cmd_list(args: argparse.Namespace) -> int:
    rows = _run(args, "GET", "/v1/sandboxes", None)
    if args.json:
        return _print(args, rows, "")
    if not rows:
        print("egressd serves no sandboxes")
        return 0
    print(f"{'ID':<8} {'STATE':<8} {'KIND':<9} {'POLICY':<20} NETNS")
    for r in rows:
        print(f"{r['id']:<8} {r['state']:<8} {r['kind']:<9} {r['policy'][:20]:<20} {r['netns']}")
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    print(json.dumps(_run(args, "GET", f"/v1/sandboxes/{args.sandbox}", None), indent=2))
    return 0


def cmd_delete(args: argparse.Namespace) -> int:
    data = _run(args, "DELETE", f"/v1/sandboxes/{args.sandbox}", None)
    return _print(args, data, f"sandbox {args.sandbox} deleted")


def cmd_set_policy(args: argparse.Namespace) -> int:
    body = {"policy": _policy_text(args.policy)}
    data = _run(args, "PUT", f"/v1/sandboxes/{args.sandbox}/policy", body)
    line = f"sandbox {args.sandbox}: policy swapped ({data['removed_elements']} elements removed)"
    return _print(args, data, line)


def cmd_exec(args: argparse.Namespace) -> int:
    from egress.sandbox import view, workload
    from egress.store.uids import parse_range

    argv = list(args.argv)
    if argv and argv[0] == "--":
        argv = argv[1:]
    if not argv:
        raise EgressError("sandbox exec: give the command after --, e.g. -- sh -c 'curl ...'")
    named = workload.named_user(args.user) if args.user is not None else None
    shape = workload_args.read(args, uid_range=parse_range(None))
    extra = workload.resolve_env(shape.env, os.environ)
    data = _run(args, "GET", f"/v1/sandboxes/{args.sandbox}", None)
    if data["kind"] != SandboxKind.CREATED:
        # Its netns and cgroup are another runtime's (their resolv.conf, their way in).
        raise EgressError(
            f"sandbox {args.sandbox} is attached to a netns another runtime made; "
            "start its processes through that runtime"
        )
    cgroup = Cgroup.attach_existing(data["cgroup"], data.get("freezer"), data.get("cpu"),
                                    data.get("pids"), data.get("memory"))  # fmt: skip
    # egressd's answer may be a moment old: the kernel's word, right before the start.
    # A child joining a frozen cgroup would stop before its first instruction.
    if data["state"] == SandboxState.FROZEN or cgroup.is_frozen():
        raise SandboxError(f"sandbox {args.sandbox} is frozen; resume or kill it first: "
                           f"{_decide_hint(args.sandbox)}")  # fmt: skip
    if named is not None:
        who = named
        workload.print_warning(workload.shared_user_warning(who))
    elif data.get("uid") is not None:
        who = workload.allocated_user(data["id"], int(data["uid"]))
    else:
        raise UsageError(
            f"sandbox {args.sandbox} has no uid of its own (an older egressd made it); "
            "give --user NAME"
        )
    # Signals are caught from here on: one that came before CMD started is passed on
    # once it has, rather than killing egressctl and leaving CMD without its parent.
    started: list[workload.Workload] = []
    pending: list[int] = []

    def forward(signum: int, _frame: object) -> None:
        if started:
            workload.signal_forwarder(started[0])(signum)
        else:
            pending.append(signum)

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, forward)
    the_view = view.prepare(data["id"], data["netns"], who, shape.workdir, shape.binds)
    done = threading.Event()
    watcher = threading.Thread(target=_say_when_frozen, args=(args.sandbox, cgroup, done),
                               daemon=True)  # fmt: skip
    watcher.start()
    try:
        env = workload.build_env(who, extra, os.environ)
        procs = cgroup.procs_files
        proc = workload.spawn(data["id"], data["netns"], who, argv, the_view, env, procs)
        started.append(proc)
        for signum in pending:
            workload.signal_forwarder(proc)(signum)
        code = proc.popen.wait()
    finally:
        done.set()
        watcher.join()
        the_view.close()
    return 128 - code if code < 0 else code


WATCH_S = 0.2  # how soon a freeze of the running command is told (v1 has no notification)


def _decide_hint(sandbox_id: str) -> str:
    return (f"`egressctl resume {sandbox_id}` lets it go on, `egressctl kill {sandbox_id}` "
            f"ends it (why: `egressctl journal --sandbox {sandbox_id}`)")  # fmt: skip


def _say_when_frozen(sandbox_id: str, cgroup: Cgroup, done: threading.Event) -> None:
    """Until ``done``: a frozen command waits, silently, for a person's decision; say so
    on stderr, once each time the sandbox freezes. A thread, started before the command:
    a freeze that lands while it is being started stops it before it execs, and the start
    itself (Popen) would wait for it without a word."""
    told = False
    while not done.wait(WATCH_S):
        try:
            frozen = cgroup.is_frozen()
        except EgressError:
            frozen = False  # its cgroup is gone (deleted): the command ends with it
        if frozen and not told:
            print(f"egressctl: sandbox {sandbox_id} froze (a violation); the command "
                  f"is stopped until you decide: {_decide_hint(sandbox_id)}",
                  file=sys.stderr, flush=True)  # fmt: skip
        told = frozen

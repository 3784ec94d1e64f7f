"""`egressctl run` and `egressctl render`: a sandbox's ruleset, and a command inside one."""

from __future__ import annotations

import argparse
import sys

from egress.cli import workload_args
from egress.datapath.addressing import DEFAULT_POOL4, DEFAULT_POOL6, Pools
from egress.datapath.render import PLACEHOLDER_UPLINK, render_sandbox, render_uplink
from egress.errors import Problem
from egress.model import Policy
from egress.policy import load_policy_with_warnings, parse_policy
from egress.policy.loader import MAX_BYTES

RUN_EPILOG = f"""\
The command runs in a new network namespace whose nftables rules allow only what the
policy names, inside its own cgroup, as an unprivileged user with no capabilities.
Everything egress created is removed when it exits (unless --keep). Exit status is the
command's own; 127 when it does not exist; 137 when it was killed after a freeze; 2 when
egressctl refused its arguments (nothing was made then).

Isolation: by default the command runs under a uid and gid of its own (from --uid-range),
in its own PID namespace (`kill -9 -1` ends only the sandbox's processes), seeing a root
it was given: read-only /usr, /bin, /lib*, /etc; its own /proc and a minimal /dev;
private /tmp, /var/tmp, /dev/shm, /run and $HOME; the working directory read-write; and
nothing else of the host unless --ro-bind or --bind names it. Files it writes in the
working directory and in --bind paths belong to you (the sudo user) afterwards. Only
PATH, LANG, LC_*, TERM and TZ pass from your environment, plus what --env names. It
cannot create user namespaces or set set-uid/set-gid bits.

A violation whose policy action is `freeze` stops every process of the sandbox at once
(cgroup freezer), records it in the journal with the process behind it, prints what
happened and waits: `egressctl resume ID` lets it go on, `egressctl kill ID` ends it.

examples:
  cd ~/project && sudo egressctl run --policy /etc/egress/python-dev.yaml -- pip download requests
  egressctl lab up      # a self-contained internet in namespaces, for trying it out
  sudo egressctl run --policy P --uplink-netns egresslab-up --report r.json -- curl http://203.0.113.10/

defaults: --subnet-pool {DEFAULT_POOL4},{DEFAULT_POOL6} (one /30 and one /64 per sandbox)
"""

RENDER_EPILOG = """\
Prints the nft ruleset the policy produces for one sandbox (nft-templates/sandbox.nft),
then, commented out, the uplink table. Values that differ per sandbox are nft `define`s
marked "per sandbox". The output passes `nft -c -f`.

example:
  egressctl render policies/python-dev.yaml > /tmp/r.nft && nft -c -f /tmp/r.nft
"""


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    fmt = argparse.RawDescriptionHelpFormatter
    p = sub.add_parser(
        "run", help="run a command in a sandbox that enforces a policy",
        description="Run CMD in a sandbox that enforces POLICY.", epilog=RUN_EPILOG,
        formatter_class=fmt,
    )  # fmt: skip
    p.add_argument("--policy", required=True, metavar="P", help="policy file (YAML)")
    p.add_argument("--uplink-netns", metavar="N", help="netns holding the veth's host end")
    p.add_argument("--upstream", metavar="IP[:PORT]", help="DNS upstream (overrides policy)")
    p.add_argument(
        "--user", metavar="U",
        help="run CMD as the existing account U, never root (default: a uid of its own)",
    )  # fmt: skip
    workload_args.add(p)
    p.add_argument(
        "--uid-range", metavar="START-END",
        help="uids for sandboxes' workloads (default: $EGRESS_UID_RANGE or "
        "2000000000-2000065535)",
    )  # fmt: skip
    p.add_argument("--report", metavar="FILE", help="write a JSON report of the run to FILE")
    p.add_argument("--keep", action="store_true", help="leave the sandbox in place afterwards")
    p.add_argument("--subnet-pool", metavar="CIDR[,CIDR6]", help="address pools for sandboxes")
    p.add_argument(
        "--state-dir",
        metavar="DIR",
        help="journal directory (default: $EGRESS_STATE_DIR or /var/lib/egress)",
    )
    p.add_argument(
        "--decision-timeout",
        type=float,
        metavar="SECONDS",
        help="after a freeze, kill the sandbox if nobody resumes it this soon",
    )
    p.add_argument("argv", nargs=argparse.REMAINDER, metavar="-- CMD ARGS...")
    p.set_defaults(func=cmd_run)

    r = sub.add_parser(
        "render", help="print the nft ruleset a policy produces",
        description="Print the nft ruleset POLICY produces for one sandbox.",
        epilog=RENDER_EPILOG, formatter_class=fmt,
    )  # fmt: skip
    r.add_argument("file", metavar="FILE", help="policy file (YAML)")
    r.set_defaults(func=cmd_render)


def cmd_render(args: argparse.Namespace) -> int:
    from egress.store.paths import read_template

    policy, warnings = load_policy_with_warnings(args.file)
    for w in warnings:
        print(w, file=sys.stderr)
    print(render_sandbox(read_template("sandbox.nft"), policy))
    uplink = render_uplink(read_template("uplink.nft"), PLACEHOLDER_UPLINK)
    print("# --- uplink netns (per sandbox; shown for reference, loaded separately) ---")
    print("\n".join("# " + line if line else "#" for line in uplink.splitlines()))
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    from egress.kernel import oom
    from egress.kernel.sched import leave_realtime
    from egress.run.runner import RunOptions, run
    from egress.sandbox.view import check_policy_location
    from egress.store.uids import parse_range

    argv = list(args.argv)
    if argv and argv[0] == "--":
        argv = argv[1:]
    if not argv:
        print(
            "egressctl run: no command given; usage: egressctl run --policy P -- CMD",
            file=sys.stderr,
        )
        return 2
    leave_realtime("egressctl run")  # before anything starts: the workload inherits it
    oom.shelter("egressctl run", say=False)  # the workload does not: spawn resets it
    shape = workload_args.read(args, uid_range=parse_range(args.uid_range), report=args.report)
    # Before the policy is read: where it sits may be what is wrong with it.
    check_policy_location(args.policy, shape.workdir, shape.binds)
    policy, warnings, sha256 = _operator_policy(args.policy, args.user, args.uid_range)
    for w in warnings:
        print(w, file=sys.stderr)
    opts = RunOptions(
        argv=argv,
        workdir=shape.workdir,
        binds=shape.binds,
        env=shape.env,
        uid_range=args.uid_range,
        uplink_netns=args.uplink_netns,
        pools=Pools.parse(args.subnet_pool),
        user=args.user,
        report=args.report,
        keep=args.keep,
        upstream=args.upstream,
        policy_path=args.policy,
        state_dir=args.state_dir,
        decision_timeout=args.decision_timeout,
        policy_sha256=sha256,
    )
    return run(policy, opts)


def _operator_policy(
    path: str, user_spec: str | None, uid_range: str | None
) -> tuple[Policy, list[Problem], str]:
    """The policy, its warnings and its sha256, read once from a file the workload could
    not have changed (egress.store.trust); PolicyError (exit 2) if it could have. The
    workload is --user's account, else any uid/gid of the range sandboxes get theirs from."""
    from collections.abc import Container

    from egress.sandbox.workload import named_user
    from egress.store.trust import read_policy
    from egress.store.uids import parse_range

    ids_u: Container[int]
    ids_g: Container[int]
    if user_spec is not None:
        user = named_user(user_spec)
        ids_u, ids_g = {user.uid}, {user.gid}
    else:
        ids_u = ids_g = parse_range(uid_range)
    trusted = read_policy(path, workload_uids=ids_u, workload_gids=ids_g, max_bytes=MAX_BYTES)
    policy, warnings = parse_policy(trusted.data, path)
    return policy, warnings, trusted.sha256

"""`egressctl observe`: run the observer layer for one sandbox (started by `run`)."""

from __future__ import annotations

import argparse
import sys

from egress.errors import SandboxError
from egress.policy import load_policy

EPILOG = """\
`egressctl run` starts this for each sandbox; you only run it by hand to watch a sandbox
made with --keep. It reads the sandbox netns's NFLOG group 101 (copies of DNS queries and
drops) and the drop counter, applies the policy on its own, and freezes the cgroup on a
`freeze` violation. It exits when the netns is gone.

The cgroup is egress's own for the sandbox id, unless --cgroup names one (a sandbox
attached to another runtime's cgroup; --freezer for its v1 freezer twin, if it has one).

examples:
  egressctl observe --sandbox 3f2a1c --netns egress-3f2a1c --policy policies/python-dev.yaml
  egressctl observe --sandbox box1 --netns box1 --policy policies/python-dev.yaml \\
      --cgroup /sys/fs/cgroup/machine.slice/box1
"""


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "observe",
        help="run the observer layer for a sandbox (started by `run`)",
        description="The observer layer: the kernel's evidence, judged independently.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--sandbox", required=True, metavar="ID")
    p.add_argument("--netns", required=True, metavar="NAME")
    p.add_argument("--policy", required=True, metavar="FILE")
    p.add_argument("--state-dir", metavar="DIR", help="journal directory ($EGRESS_STATE_DIR)")
    p.add_argument("--watch-pid", type=int, metavar="PID", help="the inline layer's process")
    p.add_argument("--cgroup", metavar="PATH", help="the sandbox's cgroup v2 directory")
    p.add_argument("--freezer", metavar="PATH", help="its v1 freezer cgroup (with --cgroup)")
    p.add_argument("--peers", metavar="DIR",
                   help="a pod's observer beside `egressd sidecar --peers DIR` (no --cgroup):"
                        " the workload's cgroup is found from the netns's processes, never"
                        " the cgroups named in DIR")  # fmt: skip
    p.set_defaults(func=cmd_observe)


def cmd_observe(args: argparse.Namespace) -> int:
    from egress.kernel import oom
    from egress.kernel.sched import leave_realtime
    from egress.observer.layer import Observer, ObserverConfig
    from egress.store.paths import state_dir

    leave_realtime("egressctl observe")  # it freezes too (e.g. as a pod's observer)
    oom.shelter("egressctl observe", say=False)
    if args.freezer is not None and args.cgroup is None:
        raise SandboxError("--freezer needs --cgroup (the v2 directory it mirrors)")
    peers = None
    if args.peers is not None:
        if args.cgroup is not None:
            raise SandboxError("--peers is for an observer without --cgroup (it finds it)")
        from egress.kernel.netns_cgroup import Peers

        peers = Peers(args.peers, "observer")
    cfg = ObserverConfig(
        args.sandbox,
        args.netns,
        load_policy(args.policy),
        str(state_dir(args.state_dir)),
        args.watch_pid,
        args.cgroup,
        args.freezer,
        peers=peers,
    )
    observer = Observer(cfg)
    print("ready", flush=True)  # `run` waits for this before it starts the workload
    sys.stdout.close()
    observer.start()
    return 0

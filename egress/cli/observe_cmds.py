"""`egressctl observe`: run the observer layer for one sandbox (started by `run`)."""

from __future__ import annotations

import argparse
import sys

from egress.policy import load_policy

EPILOG = """\
`egressctl run` starts this for each sandbox; you only run it by hand to watch a sandbox
made with --keep. It reads the sandbox netns's NFLOG group 101 (copies of DNS queries and
drops) and the drop counter, applies the policy on its own, and freezes the cgroup on a
`freeze` violation. It exits when the netns is gone.

example:
  egressctl observe --sandbox 3f2a1c --netns egress-3f2a1c --policy policies/python-dev.yaml
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
    p.set_defaults(func=cmd_observe)


def cmd_observe(args: argparse.Namespace) -> int:
    from egress.runtime.journal import state_dir
    from egress.runtime.observer import Observer, ObserverConfig

    cfg = ObserverConfig(
        args.sandbox,
        args.netns,
        load_policy(args.policy),
        str(state_dir(args.state_dir)),
        args.watch_pid,
    )
    observer = Observer(cfg)
    print("ready", flush=True)  # `run` waits for this before it starts the workload
    sys.stdout.close()
    observer.start()
    return 0

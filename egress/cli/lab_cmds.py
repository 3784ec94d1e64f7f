"""egressctl lab up | down | status: the fake internet that tests and the demo run against.

The lab's facts go to stdout as ``key=value`` lines (``eval "$(egressctl lab up)"`` sets
shell variables; ``grep ^dns=`` finds one) or as JSON with ``--json``; remarks for people
go to stderr. ``lab up`` on a lab that is already up and healthy says so and exits 0, so
scripts and Makefiles can call it unconditionally; on a broken one it exits 1 and asks for
``lab down`` first. ``lab down`` is idempotent.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from egress.lab import DEFAULT_NAME, Lab, LabError, LabExistsError
from egress.lab.state import lab_dir

LAB_EPILOG = """\
examples:
  sudo egressctl lab up
  sudo ip netns exec egresslab-up dig @198.51.100.53 allowed.lab.test +short
  sudo egressctl lab status
  sudo egressctl lab down
"""

UP_EPILOG = """\
examples:
  sudo egressctl lab up
  sudo egressctl lab up --name mylab --zones my-zones.yaml
  eval "$(sudo egressctl lab up)"; sudo ip netns exec "$uplink_netns" dig "@$dns" allowed.lab.test

output (stdout), one key=value per line:
  name=egresslab
  uplink_netns=egresslab-up        attach sandboxes here (egressctl run --uplink-netns)
  inet_netns=egresslab-inet        the "internet": DNS, HTTP, tunnel servers
  dns=198.51.100.53                authoritative DNS server (UDP and TCP 53)
  dns6=2001:db8:53::53
  http=203.0.113.10,...            HTTP on 80 and 8080, TLS or plain HTTP on 443; UDP echo 9999
  http6=2001:db8:80::10,...
  sites=pypi.lab.test,...          a package index, an npm registry and a git repo (README)
  ca_file=/run/egress/lab/egresslab/tls/ca.pem        the CA behind 443's certificate
  query_log=/run/egress/lab/egresslab/queries.jsonl   one JSON line per query received
  access_log=/run/egress/lab/egresslab/access.jsonl   one JSON line per HTTP request
  state_file=/run/egress/lab/egresslab.json

exit status: 0 up (also when it already was), 1 failed (nothing is left behind)
"""

DOWN_EPILOG = """\
examples:
  sudo egressctl lab down
  sudo egressctl lab down --name mylab

Stops the lab's processes (by recorded PID, after checking each is still the same
process), deletes both netns and the state. Without a state file it still removes the
netns NAME-up and NAME-inet and any lab server inside them. Idempotent: exit 0 when the
lab was not up.
"""

STATUS_EPILOG = """\
examples:
  egressctl lab status
  egressctl lab status --name mylab --json

exit status: 0 up, 1 degraded (a netns or process is missing: run lab down), 3 not up
"""


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add this module's subcommands to egressctl."""
    lab = sub.add_parser(
        "lab",
        help="a self-contained fake internet for tests and the demo",
        description=__doc__,
        epilog=LAB_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    lab.set_defaults(func=_needs_action(lab))
    actions = lab.add_subparsers(dest="lab_command", metavar="ACTION")

    up = _action(actions, "up", "create the lab netns and start its servers", UP_EPILOG)
    up.add_argument("--zones", metavar="FILE", help="zone file (default: the shipped one)")
    up.add_argument("--timeout", type=float, default=20.0, help="seconds to wait for servers")
    up.add_argument("--json", action="store_true", help="print the facts as JSON")
    up.set_defaults(func=cmd_up)

    down = _action(actions, "down", "stop the lab and delete its netns", DOWN_EPILOG)
    down.set_defaults(func=cmd_down)

    status = _action(actions, "status", "is the lab up? its addresses and PIDs", STATUS_EPILOG)
    status.add_argument("--json", action="store_true", help="print the status as JSON")
    status.set_defaults(func=cmd_status)


def _needs_action(parser: argparse.ArgumentParser) -> Callable[[argparse.Namespace], int]:
    def show_help(_args: argparse.Namespace) -> int:
        parser.print_help(sys.stderr)
        return 2

    return show_help


def _action(
    actions: argparse._SubParsersAction[argparse.ArgumentParser], name: str, text: str, epilog: str
) -> argparse.ArgumentParser:
    parser = actions.add_parser(
        name,
        help=text,
        description=text,
        epilog=epilog,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--name", default=DEFAULT_NAME, help=f"lab name (default {DEFAULT_NAME})")
    parser.add_argument("--state-dir", help=f"state directory (default {lab_dir()})")
    return parser


def _print_facts(facts: dict[str, Any], as_json: bool) -> None:
    if as_json:
        print(json.dumps(facts, indent=2))
        return
    for key, value in facts.items():
        if isinstance(value, list):
            value = ",".join(str(v) for v in value)
        if not isinstance(value, dict):
            print(f"{key}={value}")


def _facts(lab: Lab) -> dict[str, Any]:
    return {"name": lab.name, **lab.addresses()}


def cmd_up(args: argparse.Namespace) -> int:
    started = time.monotonic()
    try:
        lab = Lab.up(args.name, args.zones, state_dir=args.state_dir, timeout=args.timeout)
    except LabExistsError as exc:
        try:
            lab = Lab.load(args.name, state_dir=args.state_dir)
        except LabError:  # its netns exist but its state does not
            print(f"egressctl: {exc}", file=sys.stderr)
            return 1
        health = lab.status()
        if health["state"] != "up":
            print(
                f"egressctl: lab {args.name} exists but is {health['state']}; "
                f"run: egressctl lab down --name {args.name}",
                file=sys.stderr,
            )
            return 1
        print(f"lab {args.name} is already up", file=sys.stderr)
        _print_facts(_facts(lab), args.json)
        return 0
    print(f"lab {lab.name} is up ({time.monotonic() - started:.2f} s)", file=sys.stderr)
    _print_facts(_facts(lab), args.json)
    return 0


def cmd_down(args: argparse.Namespace) -> int:
    if Lab.down_by_name(args.name, state_dir=args.state_dir):
        print(f"lab {args.name} is down", file=sys.stderr)
    else:
        print(f"lab {args.name} was not up", file=sys.stderr)
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    path = Path(lab_dir(args.state_dir)) / f"{args.name}.json"
    if not path.exists():
        if args.json:
            print(json.dumps({"name": args.name, "state": "down"}))
        else:
            print(f"name={args.name}\nstate=down")
        return 3
    lab = Lab.load(args.name, state_dir=args.state_dir)
    health = lab.status()
    if args.json:
        print(json.dumps(health, indent=2))
    else:
        _print_facts({"name": lab.name, "state": health["state"], **lab.addresses()}, False)
        for netns, present in health["netns"].items():
            print(f"netns={netns} present={'yes' if present else 'NO'}")
        for proc in health["processes"]:
            alive = "yes" if proc["alive"] else "NO"
            print(f"process={proc['role']} pid={proc['pid']} alive={alive}")
    return 0 if health["state"] == "up" else 1

"""egress-oci-hook: an OCI runtime hook that puts a container behind egress (podman,
CRI-O: hooks.d).

At ``createRuntime`` (or ``prestart``, its older name) the runtime has made the
container's namespaces and cgroup but started nothing in it; it passes the container's
state (id, pid, bundle, annotations) on stdin. The hook asks egressd, over its unix
socket, to attach to the container's netns and cgroup with the policy its annotation
``io.egress.policy=NAME`` names (``NAME.yaml`` under ``--policy-dir``), or, with
``--default-policy``, that one for a container without the annotation (the runtime
runs the hook for those only if its hooks.d file says ``"when": {"always": true}``; the
shipped ones match the annotation). A container without either is left alone. At
``poststop`` it detaches.

A hook that fails stops the container from starting: egressd unreachable, or a policy
missing or invalid, is such a failure (fail closed), said on stderr.

    /etc/containers/oci/hooks.d/egress-attach.json and egress-detach.json: the two
    files in containers/oci-hooks/ (one stage each, the annotation as their condition)

The netns egress attaches to is the one the container's config names by path (podman's
``/run/netns/netns-…``, which outlives an egressd restart), else ``/proc/PID/ns/net``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from egress.cli.client import Client, default_socket
from egress.cli.cni import NAME, container_sandbox_id
from egress.errors import DaemonError, EgressError
from egress.policy import parse_policy

ANNOTATION = "io.egress.policy"
DEFAULT_POLICY_DIR = "/etc/egress/policies"
ATTACH_STAGES = ("createRuntime", "prestart")
TIMEOUT_S = 60.0


class HookError(Exception):
    pass


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="egress-oci-hook",
        description="OCI hook: attach a container to egressd at createRuntime (or prestart) "
        "with the policy its io.egress.policy annotation names; detach at poststop. Reads "
        "the container's OCI state on stdin.",
    )
    p.add_argument("stage", choices=[*ATTACH_STAGES, "poststop"])
    p.add_argument("--socket", default=None, help="egressd's API socket (default: its own)")
    p.add_argument("--policy-dir", default=DEFAULT_POLICY_DIR,
                   help=f"where NAME.yaml is (default: {DEFAULT_POLICY_DIR})")  # fmt: skip
    p.add_argument(
        "--default-policy",
        metavar="NAME",
        help="for containers without the annotation (default: leave them alone)",
    )
    p.add_argument("--uplink-netns", help="netns the resolver's upstream queries leave from")
    p.add_argument(
        "--upstream", metavar="IP[:PORT]", help="the upstream resolver, if not the policy's"
    )
    return p


def owner(state: dict[str, Any]) -> str:
    return f"oci:{state['id']}"


def read_state(raw: bytes) -> dict[str, Any]:
    try:
        state = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise HookError(f"the container state on stdin is not JSON: {exc}") from None
    if not isinstance(state, dict) or not isinstance(state.get("id"), str) or not state["id"]:
        raise HookError("the container state on stdin has no id")
    return state


def policy_for(state: dict[str, Any], args: argparse.Namespace) -> tuple[str, str] | None:
    """(name, text) of the container's policy, or None: not egress's to enforce."""
    annotations = state.get("annotations") or {}
    name = annotations.get(ANNOTATION) if isinstance(annotations, dict) else None
    name = name or args.default_policy
    if not name:
        return None
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise HookError(f"{ANNOTATION}={name!r} is not a policy name")
    path = Path(args.policy_dir) / f"{name}.yaml"
    try:
        text = path.read_text(encoding="utf-8")
        parse_policy(text, str(path))
    except OSError as exc:
        raise HookError(f"policy {name}: cannot read {path}: {exc.strerror}") from None
    except (EgressError, UnicodeDecodeError) as exc:
        raise HookError(f"policy {name} is invalid: {exc}") from None
    return name, text


def netns_of(state: dict[str, Any], pid: int) -> str:
    """The container's netns: the path its config names, else its process's."""
    bundle = state.get("bundle")
    if isinstance(bundle, str):
        try:
            config = json.loads((Path(bundle) / "config.json").read_text())
            for ns in config.get("linux", {}).get("namespaces", []):
                if ns.get("type") == "network" and ns.get("path"):
                    return str(ns["path"])
        except (OSError, ValueError, AttributeError):
            pass
    return f"/proc/{pid}/ns/net"


def cgroup_of(pid: int) -> tuple[str, str | None]:
    from egress.kernel.cgroup import find_mounts
    from egress.kernel.netns_cgroup import NoCgroup, cgroup_paths

    mounts = find_mounts()
    try:
        v2, freezer = cgroup_paths(pid)
    except (OSError, NoCgroup) as exc:
        raise HookError(f"the container's process {pid}: no cgroup: {exc}") from None
    if mounts.v2 is None or v2 == "/":
        raise HookError(f"the container's process {pid} is in no cgroup of its own")
    v2_dir = os.path.join(mounts.v2, v2.lstrip("/"))
    fdir = None
    if mounts.freezer and freezer and freezer != "/":
        fdir = os.path.join(mounts.freezer, freezer.lstrip("/"))
    return v2_dir, fdir


def attach(state: dict[str, Any], args: argparse.Namespace) -> str | None:
    found = policy_for(state, args)
    if found is None:
        return None
    name, text = found
    pid = state.get("pid")
    if not isinstance(pid, int) or pid <= 0:
        raise HookError("the container state has no pid (run the hook at createRuntime)")
    v2, freezer = cgroup_of(pid)
    body: dict[str, Any] = {
        "netns": netns_of(state, pid), "cgroup": v2, "policy": text, "owner": owner(state),
        "id": container_sandbox_id("oci", state["id"]),
    }  # fmt: skip
    if freezer:
        body["freezer"] = freezer
    if args.uplink_netns:
        body["uplink_netns"] = args.uplink_netns
    if args.upstream:
        body["upstream"] = args.upstream
    try:
        box = _client(args).call("POST", "/v1/sandboxes/attach", body)
    except DaemonError as exc:
        if not exc.status:
            raise HookError(f"egressd is unreachable; the container is not started without "
                            f"its egress policy {name}: {exc}") from None  # fmt: skip
        raise HookError(str(exc)) from None
    return str(box["id"])


def detach(state: dict[str, Any], args: argparse.Namespace) -> list[str]:
    api = _client(args)
    try:
        rows = api.call("GET", "/v1/sandboxes")
    except DaemonError as exc:
        print(f"egress-oci-hook: poststop {state['id']}: {exc}; nothing detached",
              file=sys.stderr)  # fmt: skip
        return []
    gone = []
    for row in rows:
        if isinstance(row, dict) and row.get("owner") == owner(state):
            try:
                api.call("DELETE", f"/v1/sandboxes/{row['id']}")
                gone.append(str(row["id"]))
            except DaemonError as exc:
                if exc.status != 404:
                    print(f"egress-oci-hook: poststop {row['id']}: {exc}", file=sys.stderr)
    return gone


def _client(args: argparse.Namespace) -> Client:
    return Client(args.socket or default_socket(), timeout=TIMEOUT_S)


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    try:
        state = read_state(sys.stdin.buffer.read())
        if args.stage == "poststop":
            detach(state, args)
            return
        sandbox = attach(state, args)
        if sandbox is not None:
            print(f"egress-oci-hook: {state['id'][:12]}: sandbox {sandbox}", file=sys.stderr)
    except HookError as exc:
        print(f"egress-oci-hook: {exc}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()

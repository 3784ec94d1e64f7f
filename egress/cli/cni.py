#!/usr/bin/env python3
"""egress-cni: a chained CNI plugin that puts a container's or pod's netns behind egress.

It runs after the network's own plugins (bridge, host-local, ...), as the CNI spec
(1.0, 1.1) says a chained plugin does: the runtime gives the command and the container
in the environment, the network's configuration (with the previous plugin's result) on
stdin, and reads a result or an error as JSON on stdout. The plugin itself holds no
state: egressd, over its unix socket, attaches to the netns (``POST
/v1/sandboxes/attach``, owner ``cni:NETWORK:CONTAINERID:IFNAME``) and detaches.

    ADD     attach CNI_NETNS with the policy the config names, or the one the mapping
            picks for K8S_POD_NAMESPACE/K8S_POD_NAME and the pod's annotations;
            prevResult out as it came in.
            egressd unreachable, or the policy unreadable or invalid: the ADD fails, so
            the container does not start (fail closed).
    DEL     detach, if attached; nothing attached, or egressd gone: success (the rules
            go with the netns).
    CHECK   fails when egressd no longer serves it or its table is gone from the netns.
    STATUS  exit 50 while egressd is unreachable.
    GC      detach this network's sandboxes that are not in cni.dev/attachments.
    VERSION the versions below.

The cgroup to freeze is not known at ADD (the container's first process does not exist
yet): egressd finds it from the processes that come to run in the netns, and until then
blocks violations and journals that it could not freeze.

Configuration (the plugin's entry in the conflist)::

    {"type": "egress-cni",
     "policy": "NAME",                      # policies/NAME.yaml under policyDir
     "policyDir": "/etc/egress/policies",   # default
     "mapping": [{"namespace": "agents", "pod": "*", "policy": "agent"}],  # first match
     # an entry may also ask "annotations": {"KEY": "GLOB"}: the pod's, which containerd
     # and CRI-O pass when the entry has "capabilities":
     # {"io.kubernetes.cri.pod-annotations": true} (they pass no labels)
     "unmatched": "refuse",                 # or "pass": no policy, no egress
     "socket": "/run/egress/egressd.sock",  # default: egressd's
     "uplinkNetns": "NAME", "upstream": "IP[:PORT]"}   # optional, as for attach

Errors are the spec's: ``{"cniVersion", "code", "msg", "details"}`` on stdout, and the
code as the exit status (1-99 the spec's, 100+ egress's).
"""

from __future__ import annotations

import fnmatch
import http.client
import json
import os
import re
import secrets
import socket
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Standard library only, on purpose: this one file is the whole plugin, copied as is to a
# node's /opt/cni/bin (containers/kubernetes), where only python3 is. egressd validates
# the policy and says where it is wrong.

SUPPORTED = ("0.4.0", "1.0.0", "1.1.0")
# The spec's form of a container id and a network name; egress's of a policy name (a file
# name under policyDir, so never a path).
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]*")
DEFAULT_POLICY_DIR = "/etc/egress/policies"
DEFAULT_SOCKET = "/run/egress/egressd.sock"
TIMEOUT_S = 60.0  # egressd attaches in tens of ms; a handover can hold a request ~seconds

# The spec's codes (SPEC.md, "Error"), and egress's own from 100.
INCOMPATIBLE_VERSION = 1
UNSUPPORTED_FIELD = 2
UNKNOWN_CONTAINER = 3
BAD_ENVIRONMENT = 4
IO_FAILURE = 5
DECODE_FAILURE = 6
BAD_CONFIG = 7
TRY_AGAIN = 11
NOT_AVAILABLE = 50
RULES_GONE = 100  # CHECK: egressd no longer serves it, or its table is gone
REFUSED = 101  # egressd refused the attach (the netns has a table already, ...)
INVALID_POLICY = 102  # egressd found the policy invalid (ADD says 7, with where)


class CniError(Exception):
    def __init__(self, code: int, msg: str, details: str = "") -> None:
        super().__init__(msg)
        self.code, self.msg, self.details = code, msg, details


@dataclass(frozen=True)
class Call:
    """One invocation: what the environment and stdin said."""

    command: str
    container_id: str
    netns: str
    ifname: str
    args: dict[str, str]  # CNI_ARGS, K=V;K=V
    config: dict[str, Any]

    @property
    def version(self) -> str:
        return str(self.config.get("cniVersion", "1.0.0"))

    @property
    def network(self) -> str:
        return str(self.config.get("name", ""))

    @property
    def owner(self) -> str:
        return f"cni:{self.network}:{self.container_id}:{self.ifname}"


def parse_call(env: Mapping[str, str], stdin: bytes) -> Call:
    """The invocation, or a CniError with the spec's code."""
    command = env.get("CNI_COMMAND", "")
    if command not in ("ADD", "DEL", "CHECK", "STATUS", "GC", "VERSION"):
        raise CniError(BAD_ENVIRONMENT, f"CNI_COMMAND {command!r} is not a CNI command",
                       "ADD, DEL, CHECK, STATUS, GC or VERSION")  # fmt: skip
    try:
        config = json.loads(stdin or b"{}")
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CniError(DECODE_FAILURE, "the network configuration is not JSON", str(exc)) from None
    if not isinstance(config, dict):
        raise CniError(DECODE_FAILURE, "the network configuration is not a JSON object")
    call = Call(command, env.get("CNI_CONTAINERID", ""), env.get("CNI_NETNS", ""),
                env.get("CNI_IFNAME", ""), _args(env.get("CNI_ARGS", "")), config)  # fmt: skip
    if command == "VERSION":
        return call
    if call.version not in SUPPORTED:
        raise CniError(INCOMPATIBLE_VERSION, f"CNI version {call.version} is not supported",
                       f"supported: {', '.join(SUPPORTED)}")  # fmt: skip
    if command in ("ADD", "DEL", "CHECK"):
        need = ["CNI_CONTAINERID", "CNI_IFNAME"] + (["CNI_NETNS"] if command != "DEL" else [])
        missing = [name for name in need if not env.get(name)]
        if missing:
            raise CniError(BAD_ENVIRONMENT, f"{', '.join(missing)} not set",
                           f"egress-cni {command} needs {', '.join(need)}")  # fmt: skip
        if not NAME.fullmatch(call.container_id):
            raise CniError(BAD_ENVIRONMENT, f"CNI_CONTAINERID {call.container_id!r} is invalid",
                           "letters, digits, _ . - (the spec's)")  # fmt: skip
    if not NAME.fullmatch(call.network):
        raise CniError(BAD_CONFIG, f"network name {call.network!r} is not a CNI network name",
                       "letters, digits, _ . - (the spec's)")  # fmt: skip
    return call


def _args(text: str) -> dict[str, str]:
    out = {}
    for pair in text.split(";"):
        key, sep, value = pair.partition("=")
        if sep and key:
            out[key.strip()] = value.strip()
    return out


def policy_name(call: Call) -> str | None:
    """The policy for this container: the first mapping entry that matches its pod's
    namespace and name (globs), else the config's ``policy``; else, with ``"unmatched":
    "pass"``, None (not egress's: the node's own pods, CoreDNS), or an error."""
    mapping = call.config.get("mapping", [])
    if not isinstance(mapping, list):
        raise CniError(BAD_CONFIG, "mapping must be a list of {namespace, pod, policy}")
    namespace = call.args.get("K8S_POD_NAMESPACE", "")
    pod = call.args.get("K8S_POD_NAME", "")
    notes = pod_annotations(call)
    for i, entry in enumerate(mapping):
        if not isinstance(entry, dict) or not isinstance(entry.get("policy"), str):
            raise CniError(BAD_CONFIG, f"mapping[{i}] needs a policy (a name)")
        unknown = sorted(set(entry) - MAPPING_KEYS)
        if unknown:
            raise CniError(UNSUPPORTED_FIELD, f"mapping[{i}]: unknown key {unknown[0]!r}",
                           "known: " + ", ".join(sorted(MAPPING_KEYS)))  # fmt: skip
        want = entry.get("annotations", {})
        if not isinstance(want, dict):
            raise CniError(BAD_CONFIG, f"mapping[{i}].annotations must map keys to globs")
        if not namespace and not pod:
            break  # not a pod: only the default applies
        if (
            fnmatch.fnmatchcase(namespace, str(entry.get("namespace", "*")))
            and fnmatch.fnmatchcase(pod, str(entry.get("pod", "*")))
            and all(k in notes and fnmatch.fnmatchcase(notes[k], str(v)) for k, v in want.items())
        ):
            return str(entry["policy"])
    name = call.config.get("policy")
    unmatched = call.config.get("unmatched", "refuse")
    if unmatched not in ("refuse", "pass"):
        raise CniError(BAD_CONFIG, f"unmatched must be refuse or pass, not {unmatched!r}")
    if (not isinstance(name, str) or not name) and unmatched == "pass":
        return None
    if not isinstance(name, str) or not name:
        where = f"pod {namespace}/{pod}" if namespace or pod else "this container"
        hint = "set policy (a name under policyDir), or a mapping entry that matches"
        raise CniError(BAD_CONFIG, f"no policy for {where}", hint)
    return name


MAPPING_KEYS = frozenset({"namespace", "pod", "annotations", "policy"})
# The CNI capability containerd and CRI-O fill with the pod's annotations (runtimeConfig),
# for a plugin whose entry asks for it (egress-cni-install's does). They pass no labels.
ANNOTATIONS_CAPABILITY = "io.kubernetes.cri.pod-annotations"


def pod_annotations(call: Call) -> dict[str, str]:
    """The pod's annotations, as the runtime passed them (none if it passed none)."""
    runtime = call.config.get("runtimeConfig")
    found = runtime.get(ANNOTATIONS_CAPABILITY) if isinstance(runtime, dict) else None
    if not isinstance(found, dict):
        return {}
    return {str(k): str(v) for k, v in found.items()}


def policy_path(call: Call, name: str) -> Path:
    if not NAME.fullmatch(name):
        raise CniError(BAD_CONFIG, f"policy name {name!r} is not a file name")
    return Path(str(call.config.get("policyDir") or DEFAULT_POLICY_DIR)) / f"{name}.yaml"


def policy_text(call: Call, name: str) -> str:
    """The policy NAME from policyDir (egressd validates it)."""
    path = policy_path(call, name)
    try:
        return path.read_text(encoding="utf-8")
    except OSError as exc:
        raise CniError(BAD_CONFIG, f"policy {name}: cannot read {path}: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise CniError(BAD_CONFIG, f"policy {name}: {path} is not UTF-8") from None


# -- commands ------------------------------------------------------------------------------


class Unreachable(Exception):
    """egressd's socket could not be reached (no socket, refused, permission)."""


class Api:
    """egressd's HTTP API over its unix socket (the plugin's own few lines of it)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def request(self, method: str, url: str, body: dict[str, Any] | None = None) -> tuple[int, Any]:
        conn = http.client.HTTPConnection("egressd", timeout=TIMEOUT_S)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(TIMEOUT_S)
        try:
            sock.connect(self.path)
        except OSError as exc:
            sock.close()
            raise Unreachable(f"{self.path}: {exc.strerror or exc}") from None
        conn.sock = sock
        payload = None if body is None else json.dumps(body).encode()
        headers = {"Content-Type": "application/json"} if payload is not None else {}
        try:
            conn.request(method, url, payload, headers)
            resp = conn.getresponse()
            raw = resp.read()
        except OSError as exc:
            raise Unreachable(f"{self.path}: {exc}") from None
        finally:
            conn.close()
        try:
            return resp.status, json.loads(raw)
        except ValueError:
            return resp.status, raw.decode(errors="replace")


def client(call: Call) -> Api:
    return Api(str(call.config.get("socket") or DEFAULT_SOCKET))


def mine(call: Call, rows: Any) -> list[dict[str, Any]]:
    """The sandboxes egressd serves for this container's attachment."""
    if not isinstance(rows, list):
        return []
    return [r for r in rows if isinstance(r, dict) and r.get("owner") == call.owner]


def add(call: Call) -> dict[str, Any]:
    prev = call.config.get("prevResult")
    if not isinstance(prev, dict):
        raise CniError(BAD_CONFIG, "egress-cni is a chained plugin: no prevResult",
                       "list it after the plugins that make the interface")  # fmt: skip
    name = policy_name(call)
    if name is None:
        return {**prev, "cniVersion": call.version}  # not egress's ("unmatched": "pass")
    text = policy_text(call, name)
    api = client(call)
    for row in mine(call, _call(api, "GET", "/v1/sandboxes")):  # a retried ADD: anew
        _call(api, "DELETE", f"/v1/sandboxes/{row['id']}")
    body: dict[str, Any] = {"netns": call.netns, "policy": text, "owner": call.owner,
                            "id": container_sandbox_id("cni", call.container_id)}  # fmt: skip
    for key, field in (("uplinkNetns", "uplink_netns"), ("upstream", "upstream")):
        if call.config.get(key):
            body[field] = str(call.config[key])
    try:
        _call(api, "POST", "/v1/sandboxes/attach", body)
    except CniError as exc:
        if exc.code != INVALID_POLICY:
            raise
        where = str(policy_path(call, name))
        raise CniError(BAD_CONFIG, f"egress: policy {name} is invalid",
                       exc.details.replace("<api>", where)) from None  # fmt: skip
    return {**prev, "cniVersion": call.version}


def delete(call: Call) -> None:
    api = client(call)
    try:
        status, rows = api.request("GET", "/v1/sandboxes")
    except Unreachable as exc:
        # Best effort: the rules live in the netns, which goes with the container; the
        # next egressd finds the netns gone and drops the record.
        print(f"egress-cni: DEL {call.container_id}: {exc}; nothing detached", file=sys.stderr)
        return
    if status != 200:  # egressd is there but cannot say (a handover): let the runtime retry
        raise CniError(TRY_AGAIN, f"egress: egressd could not list its sandboxes ({status})",
                       str(rows))  # fmt: skip
    for row in mine(call, rows):
        try:
            _call(api, "DELETE", f"/v1/sandboxes/{row['id']}")
        except CniError as exc:
            if "404" not in exc.msg:  # gone meanwhile: what DEL wants
                print(f"egress-cni: DEL {row['id']}: {exc.msg}", file=sys.stderr)


def check(call: Call) -> None:
    if not isinstance(call.config.get("prevResult"), dict):
        raise CniError(BAD_CONFIG, "egress-cni is a chained plugin: no prevResult")
    api = client(call)
    found = mine(call, _call(api, "GET", "/v1/sandboxes"))
    if not found and policy_name(call) is None:
        return  # not egress's: nothing to check
    if not found:
        raise CniError(RULES_GONE, f"egressd serves no sandbox for {call.owner}")
    box = _call(api, "GET", f"/v1/sandboxes/{found[0]['id']}")
    if not box.get("rules"):
        raise CniError(RULES_GONE, f"table inet egress is gone from {call.netns}",
                       f"sandbox {found[0]['id']}")  # fmt: skip


def status(call: Call) -> None:
    try:
        client(call).request("GET", "/v1/sandboxes")
    except Unreachable as exc:
        raise CniError(NOT_AVAILABLE, "egressd is unreachable", str(exc)) from None


def gc(call: Call) -> None:
    valid = call.config.get("cni.dev/attachments", [])
    if not isinstance(valid, list):
        raise CniError(BAD_CONFIG, "cni.dev/attachments must be a list")
    keep = {
        f"cni:{call.network}:{a.get('containerID')}:{a.get('ifname')}"
        for a in valid
        if isinstance(a, dict)
    }
    api = client(call)
    prefix = f"cni:{call.network}:"
    for row in _call(api, "GET", "/v1/sandboxes"):
        owner = row.get("owner") if isinstance(row, dict) else None
        if isinstance(owner, str) and owner.startswith(prefix) and owner not in keep:
            try:
                _call(api, "DELETE", f"/v1/sandboxes/{row['id']}")
            except CniError as exc:
                print(f"egress-cni: GC {row['id']}: {exc.msg}", file=sys.stderr)


def container_sandbox_id(kind: str, container_id: str) -> str:
    """Readable in `egressctl ps` (``kind`` and the container's short id), unique with a
    random tail: a container started again gets a new sandbox, and the journal keeps the
    old one."""
    short = re.sub(r"[^a-z0-9_-]", "", container_id.lower())[:12] or "c"
    return f"{kind}-{short}-{secrets.token_hex(3)}"


def _call(api: Api, method: str, url: str, body: dict[str, Any] | None = None) -> Any:
    """The JSON of a 2xx answer, else the CniError it is."""
    try:
        status, data = api.request(method, url, body)
    except Unreachable as exc:
        raise CniError(TRY_AGAIN, "egress: egressd is unreachable; the container is not "
                       "started without its egress policy", str(exc)) from None  # fmt: skip
    if status < 400:
        return data
    message = data.get("error") if isinstance(data, dict) else str(data)
    if status == 503:
        raise CniError(TRY_AGAIN, f"egress: egressd is handing over; try again ({message})")
    problems = data.get("problems") if isinstance(data, dict) else None
    details = "; ".join(str(p) for p in problems) if isinstance(problems, list) else ""
    if status == 422 and details:
        raise CniError(INVALID_POLICY, f"egress: {message}", details)
    raise CniError(REFUSED, f"egress: egressd refused {method} {url} ({status}): {message}",
                   details)  # fmt: skip


def run(env: Mapping[str, str], stdin: bytes) -> tuple[int, dict[str, Any] | None]:
    """(exit status, JSON for stdout or None): the whole plugin, for main and tests."""
    version = "1.1.0"
    try:
        call = parse_call(env, stdin)
        version = call.version if call.version in SUPPORTED else version
        if call.command == "VERSION":
            return 0, {"cniVersion": version, "supportedVersions": list(SUPPORTED)}
        if call.command == "ADD":
            return 0, add(call)
        {"DEL": delete, "CHECK": check, "STATUS": status, "GC": gc}[call.command](call)
        return 0, None
    except CniError as exc:
        error = {"cniVersion": version, "code": exc.code, "msg": exc.msg}
        if exc.details:
            error["details"] = exc.details
        return exc.code, error


def main() -> None:
    code, out = run(os.environ, sys.stdin.buffer.read())
    if out is not None:
        sys.stdout.write(json.dumps(out) + "\n")
    sys.exit(code)


if __name__ == "__main__":
    main()
